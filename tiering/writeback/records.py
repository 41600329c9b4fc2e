"""The journal's acknowledgements: which keys have a record on disk, and the space they take.

Each pending operation is acknowledged by one record file per key (``tiering.writeback.journal``
is its format; invariants I1-I3 in ``tiering.writeback.facade``). ``Records`` writes and removes
them, hands out their sequence numbers, and keeps one filesystem block (``RECORD_BYTES``) reserved
in the staging space for each key that has one, so 100,000 pending deletes are counted as the disk
they occupy.

With ``--write-durability cluster`` it also keeps the copy of the journal in the cluster store
(``tiering.writeback.durable``): every record is mirrored there before it is written here, every
removal is mirrored, and the engine's other hooks into that copy (bases, leases, status) go through
here, as no-ops when there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from tiering.protocols import ObjectInfo

from tiering.writeback.durable import DurabilityError, DurableJournal
from tiering.writeback.journal import Record, ScanResult, StagingDir
from tiering.writeback.settings import RECORD_BYTES
from tiering.writeback.space import StagingSpace
from tiering.writeback.staged import StagedFile

log = logging.getLogger("tiering.writeback")


class Records:
    def __init__(self, staging: StagingDir, space: StagingSpace, durable: DurableJournal | None = None) -> None:
        self.staging = staging
        self._space = space
        # --write-durability cluster: every record is in the cluster store before it is written here.
        self.durable = durable
        self._recorded: set[str] = set()  # keys with a record on disk (RECORD_BYTES reserved each)
        self._seq = itertools.count(1)

    def next_seq(self) -> int:
        return next(self._seq)

    async def adopt(self, record: Record) -> None:
        """A record found on disk at start (replay): count it, and continue its sequence."""
        self._seq = itertools.count(max(record.seq + 1, next(self._seq)))
        await self._space.force(RECORD_BYTES)
        self._recorded.add(record.key)

    async def write(self, record: Record) -> None:
        """Write (or atomically replace) the key's record; durable when this returns (I1, I2)."""
        new = record.key not in self._recorded
        if new:
            await self._space.reserve(RECORD_BYTES)
            self._recorded.add(record.key)
        try:
            if self.durable is not None:
                await self.durable.mirror(record)
            await asyncio.to_thread(self.staging.write_record, record)
        except BaseException:
            if new:
                self._recorded.discard(record.key)
                self._space.release(RECORD_BYTES)
            raise

    async def remove(self, key: str, *, durable: bool = False) -> None:
        if key not in self._recorded:
            return
        if self.durable is not None:
            await self.durable.forget(key, durable=durable)
        remove = self.staging.remove_record_durably if durable else self.staging.remove_record
        await asyncio.to_thread(remove, key)
        self._recorded.discard(key)
        self._space.release(RECORD_BYTES)

    # -- the copy in the cluster store (--write-durability cluster) ----------------------------------
    async def replay(self) -> ScanResult:
        """The staging directory's scan (``StagingDir.scan``). With a copy in the cluster store: this
        writer's journal there is taken first (a journal taken over by a recoverer sets the local one
        aside, unscanned), and afterwards holds exactly the records the scan found; leases renewed."""
        if self.durable is not None:
            for note in await self.durable.open():
                log.error("write-back: %s", note)
        scan = await asyncio.to_thread(self.staging.scan)
        if self.durable is not None:
            await self.durable.adopt(scan.records)
            self.durable.start()
        return scan

    async def close_durable(self, *, drained: bool) -> None:
        if self.durable is not None:
            await self.durable.close(drained=drained)

    def note_base(self, key: str, etag: str | None) -> None:
        """The store holds ``key`` at ``etag`` (the version a write or unlink replaces), so that a
        recovery never overwrites a newer one; None: nothing known."""
        if self.durable is not None and etag:
            self.durable.note_base(key, etag)

    def sending(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Around this writer's upload or delete of ``key`` (``DurableJournal.sending``)."""
        return self.durable.sending(key) if self.durable is not None else contextlib.nullcontext()

    def upload_tag(self, seq: int) -> dict[str, str] | None:
        """With a cluster copy: the metadata that marks an upload of record ``seq`` as this writer's."""
        return self.durable.upload_tag(seq) if self.durable is not None else None

    def check_not_stalled(self, sf: StagedFile) -> None:
        """A file whose last acknowledgement timed out on a cluster store that has answered nothing
        since (no record taken, no lease renewed), and that did not change since, fails again at once:
        the close() after a failed fsync() does not wait out a second deadline (issue 38, finding 6)."""
        stalled = sf.timed_out
        if stalled is not None and sf.unacked and self.durable is not None and self.durable.silent_since(stalled[0]):
            error = DurabilityError(f"{stalled[1]} (the cluster store has not answered since; failed again at once)")
            error.timed_out = True
            raise error

    def note_failure(self, sf: StagedFile, exc: BaseException) -> None:
        """An acknowledgement of ``sf`` failed: remember a timeout of the cluster store (``check_not_stalled``)."""
        if isinstance(exc, DurabilityError) and exc.timed_out and self.durable is not None:
            sf.timed_out = (self.durable.monotonic(), str(exc))

    def check_may_upload(self) -> None:
        if self.durable is not None:
            self.durable.check_may_upload()

    async def uploaded(self, key: str, seq: int, info: ObjectInfo | None) -> None:
        if self.durable is not None:
            await self.durable.uploaded(key, seq, info.etag if info is not None else None)

    def durable_in(self, key: str) -> str:
        """Where ``key``'s acknowledged pending operation is durable: ``cluster`` or ``local``."""
        return "cluster" if self.durable is not None and self.durable.where(key) else "local"

    def durable_snapshot(self) -> dict[str, Any] | None:
        return self.durable.snapshot() if self.durable is not None else None
