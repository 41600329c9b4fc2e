"""Write durability ``cluster``: staged writes copied to the cluster store before they are acknowledged.

Why. With ``--write-durability local`` (the default) an acknowledged write is on the node's local
disk: it survives a crash of the daemon or of the node, not the loss of the node (a reclaimed spot
instance, a dead disk, a node pool scaled down). With ``cluster``, close() and fsync() return only
once the staged bytes and the journal record naming them are also in the cluster store (the
S3-compatible store of ``--cluster-cache``, which brings its own replication). Anyone with the
source's and the cluster store's credentials can then finish the uploads: ``cachefs recover``
(``tiering.writeback.recovery``).

Layout. Each writer (one daemon incarnation of one volume on one node) owns a prefix of the
cluster store, relative to ``--cluster-cache``::

    writeback/<volume>/<node>/<incarnation>/
        lease                       who may upload this journal to the source (JSON, see ``Lease``)
        journal/<seq, 16 digits>    one pending operation (JSON, see ``ClusterRecord``)
        data/<seq, 16 digits>       a piece of staged bytes (the bytes the record ``seq`` added)

Authentication. Anyone holding the store's credentials can write under ``writeback/``, and the
volume hash is public, so nothing found there is trusted for what it says. Every journal object
and lease carries an HMAC-SHA256 (``tiering.clusterkey``, one derived key each for records, data
and leases) over its body and its own object name, so an object moved to another prefix or name
fails too; each record names its data pieces with their lengths and the MAC of their bytes. A
record, piece or lease that fails is never replayed or obeyed: recovery reports a forged record
and leaves it; a lease that fails (``UNAUTHENTICATED``) neither fences a writer (which puts its own
lease back) nor makes a recoverer skip a journal, and a recoverer takes it over only once its
store-side LastModified is a TTL old, as an expired lease. What remains possible with the store's
credentials alone is to delete or replay objects the writer itself wrote, at their own names:
denial of service, never a write of someone else's bytes (docs/security.md).

``volume`` is the hash of the source's identity (the name of its cache directory), ``node`` the
node id, ``incarnation`` a random token kept in the staging directory: a daemon restarted with its
cache directory continues its own journal; one whose cache directory is gone starts a new prefix
and leaves the old one to ``cachefs recover``.

The writer's mirror (``DurableJournal``). It mirrors the local journal (``tiering.writeback.journal``,
whose invariants stay as they are): before a record is written locally, its new data piece and its
journal object are put in the cluster store, in parallel (one round trip); a journal object whose
piece did not land was never acknowledged, and the key's previous record is only dropped once the
new one is complete, so a recovery falls back to that one (``tiering.writeback.recovery``); a
record that replaces an older one of the same key makes the older journal object garbage (deleted
in the background: recovery replays only the latest record of each key); a record removed locally
(the upload succeeded, or the key's pending operation was dropped) has its journal object deleted
first. A record's data is a list of pieces: a file appended to and fsync'd again names the pieces
of its previous record plus one piece of the new bytes (the acknowledged prefix of a staged data
file never changes while a record names it, ``tiering.writeback.staged``), and a rename names the
same pieces as its source, so an fsync costs what was appended and a rename costs one small PUT.
Pieces are reference-counted in memory and deleted once no live record names them. Every cluster operation on the
acknowledgement path runs under ``durable_deadline_s(size)``; a failure or a timeout is a
``DurabilityError`` (EIO) for close()/fsync(), and nothing was acknowledged locally: there is no
fallback to local durability.

Never overwriting a newer version. Each journal object carries ``base``: the source's ETag the write
replaces, as this writer knows it (the version it staged from, or its own last upload), ``ABSENT``
(the source never had the key) or None (unknown). When the writer's own upload of an older version
lands after a newer record was mirrored, that record is put again with the new ETag as its base. A
recoverer writes with ``If-Match: base`` (or ``If-None-Match: *`` for ``ABSENT``), so an object
rewritten in the source since is left as it is; with an unknown base, it writes only if the source's
object is absent or not modified after the record was acknowledged (clock skew between the node
and the store counts here, see docs/durability.md).

Leases. ``lease`` names the owner. The writer creates it (``If-None-Match: *``) and renews it every
quarter of its TTL with ``If-Match`` on its last ETag. A recoverer takes a lease whose LastModified
(the store's clock) is more than its TTL old by replacing it with ``If-Match`` on the ETag it read:
of two recoverers, exactly one wins (the other gets 412), and a read-back confirms it. A writer
fences itself: it sends nothing to the source while its last successful renewal is older than half
the TTL, and stops for good when a renewal finds the lease taken (412): a daemon that comes back to
a prefix taken over never uploads that journal a second time (its local records are set aside at
start). When done, the recoverer leaves the lease as a tombstone (``role: recovered``) and deletes
everything else. The race left open: an upload the writer started before fencing itself that takes
longer than half the TTL can land while the recoverer runs; both send the same acknowledged
version, and the recoverer's conditional write keeps whichever landed first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tiering.clusterkey import DATA as DATA_PURPOSE
from tiering.clusterkey import JOURNAL as JOURNAL_PURPOSE
from tiering.clusterkey import LEASE as LEASE_PURPOSE
from tiering.clusterkey import MAC_SIZE, ClusterKey, MacKey
from tiering.errors import CacheError, ObjectChangedError, ObjectNotFoundError, ObjectStoreError
from tiering.protocols import ObjectInfo, ObjectStore, ReadRange
from tiering.writeback.journal import DELETE, IO_CHUNK, PUT, Record, pread_exact
from tiering.writeback.settings import DEFAULT_LEASE_TTL_S

from tiering.writeback.clusterjournal import (  # the journal's objects: re-exported for callers
    ABSENT,
    DATA,
    FORMAT,
    INCARNATION_FILE,
    JOURNAL,
    LEASE,
    MAX_LEASE_BYTES,
    MAX_RECORD_BYTES,
    RECOVERED,
    RECOVERING,
    ROOT,
    TAG_SEQ,
    TAG_WRITER,
    UNAUTHENTICATED,
    WRITER,
    ClusterRecord,
    ConditionalStore,
    DurabilityError,
    JournalKeys,
    Lease,
    TakenOverError,
    UnauthenticatedError,
    _sign,
    _verify,
    conditional,
    copy_name,
    names_record,
    own_older_upload,
    piece_mac,
    read_lease,
    read_object,
    safe_node_id,
    seq_name,
    small_body,
    tag_seq,
    upload_tag,
    writer_prefix,
)

log = logging.getLogger("tiering.writeback")

# Keys whose source ETag the writer remembers (the base of its next write of them): the files it
# wrote or staged most recently. 100,000 entries are ~20 MB; a key forgotten has an unknown base,
# which recovery checks by modification time instead (see ``_unknown_base``).
KNOWN_KEYS = 100_000

# Lease lifetime (DEFAULT_LEASE_TTL_S, a minute: ``--write-lease-ttl``). A writer renews it every
# quarter of it; a minute without a renewal means the daemon is gone (or cut off), which is soon
# enough for a node that will not come back, and long enough that a store answering slowly for a
# few renewals does not hand a live writer's journal to a recoverer. The writer stops uploading
# after half of it without a renewal, which leaves the other half for clock skew between the
# recoverer and the store, and for an upload in flight.
LEASE_RENEW_FRACTION = 0.25
# The acknowledgement deadline: a floor for a small record (two PUTs inside the cluster take
# milliseconds; 15 s rides out a store that is briefly slow or a botocore retry) plus the object's
# size at 8 MiB/s, far below any in-cluster link: only a store that stopped answering reaches it.
DURABLE_DEADLINE_FLOOR_S = 15.0
DURABLE_MIN_RATE = 8 * 1024 * 1024


# Re-mirroring a record after a request on it whose outcome is unknown (``DurableJournal._settle``):
# first retry after a second, doubling to half a minute, given up (and logged) after an hour, by
# when the lease has long run out and a recoverer owns the journal anyway.
SETTLE_FIRST_PAUSE_S = 1.0
SETTLE_MAX_PAUSE_S = 30.0
SETTLE_LIMIT_S = 3600.0


def durable_deadline_s(size: int) -> float:
    """How long one acknowledgement may wait for the cluster store (data and record)."""
    return DURABLE_DEADLINE_FLOOR_S + max(0, size) / DURABLE_MIN_RATE


# ---------------------------------------------------------------------------------------------- writer
@dataclass
class _Mirrored:
    record: ClusterRecord
    local: tuple[str, int, int] | None  # (local data file, size, crc32)
    copies: int = 0  # re-mirrored copies (``copy_name``) after a request whose outcome was unknown

    def names(self) -> list[str]:
        """Every journal object name that holds this record (relative to the prefix)."""
        return [JOURNAL + copy_name(self.record.seq, n) for n in range(self.copies + 1)]


class DurableJournal:
    """The writer's copy of its journal in the cluster store (the module docstring)."""

    def __init__(self, store: ConditionalStore, *, key: ClusterKey, volume: str, node: str, source: str,
                 data_dir: Path, staging_root: Path, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.keys = JournalKeys.of(key)
        self.volume = volume
        self.node = safe_node_id(node)
        self.source = source
        self.data_dir = data_dir
        self.staging_root = staging_root
        self.lease_ttl_s = lease_ttl_s
        self.wall = wall
        self.monotonic = monotonic
        self.prefix = ""
        self.owner = ""
        self.taken_over = False
        self._lease_etag = ""
        self._renewed_at = 0.0  # monotonic
        self._mirrored_at = 0.0  # monotonic: the last record the store took
        self._sending: collections.Counter[str] = collections.Counter()  # keys with an upload in flight
        self._renewer: asyncio.Task[None] | None = None
        self._by_key: dict[str, _Mirrored] = {}
        self._by_file: dict[str, str] = {}  # local data file -> the key whose live record names it
        self._piece_refs: collections.Counter[str] = collections.Counter()  # data object -> live records
        # key -> the source's ETag as this writer knows it (or ABSENT), the most recent KNOWN_KEYS.
        self._known: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self.stats = {"records": 0, "data_bytes": 0, "failures": 0, "removed": 0, "forged_leases": 0,
                      "resettled": 0}

    # -- life cycle ---------------------------------------------------------------------------------
    async def open(self) -> list[str]:
        """Before the local journal is replayed: find (or start) this writer's incarnation and take
        its lease. Returns the reasons local records were set aside (a prefix taken over)."""
        notes: list[str] = []
        found = self._load_incarnation()
        if found is not None:  # under the node id it was started with (a host name may change)
            node, incarnation = found
            prefix = writer_prefix(self.volume, node, incarnation)
            lease = await read_lease(self.store, prefix, self.keys.leases)
            owner = f"writer:{node}:{incarnation}"
            if lease is not None and not lease.authentic:
                # Not a recoverer's: a forgery (or damage) over this writer's lease. Put ours back.
                self._note_forged(prefix, lease)
                self.prefix, self.owner = prefix, owner
                await self._renew(lease.etag)
                if not self.taken_over:
                    return notes
                self.taken_over = False
                lease = await read_lease(self.store, prefix, self.keys.leases)
            if lease is not None and lease.role == WRITER and lease.owner == owner:
                self.prefix, self.owner = prefix, owner
                await self._renew(lease.etag)
                if not self.taken_over:
                    return notes
                self.taken_over = False  # taken between the read and the renewal: as below
                lease = await read_lease(self.store, prefix, self.keys.leases)
            if lease is not None and lease.authentic:  # a recoverer has (or had) it: what it holds is not ours to upload
                notes.append(f"the cluster journal {prefix} was taken over by {lease.owner} ({lease.role}): this "
                             "node's local journal is set aside, not uploaded a second time")
                self._set_aside_local()
            # No lease: that journal was closed with nothing pending. A new one starts; local records,
            # if any are left, are copied into it by ``adopt``.
        incarnation = secrets.token_hex(6)
        self.prefix = writer_prefix(self.volume, self.node, incarnation)
        self.owner = self._owner(incarnation)
        lease = Lease(self.owner, WRITER, self.lease_ttl_s, node=self.node, source=self.source)
        info = await self.store.put_if(self.prefix + LEASE, *small_body(lease.encode(self.keys.leases, self.prefix + LEASE)),
                                       if_none_match=True)
        self._lease_etag, self._renewed_at = info.etag, self.monotonic()
        self._save_incarnation(incarnation)
        return notes

    async def adopt(self, records: Sequence[Record]) -> None:
        """After the local replay: the cluster holds exactly the replayed records (mirrors missing
        ones, drops ones the local journal no longer has: never acknowledged, or done)."""
        listing = await self.store.list_dir(self.prefix + JOURNAL)
        present: dict[int, ObjectInfo] = {}
        for name, info in listing.files.items():
            if name.isdigit():
                present[int(name)] = info
        wanted = {r.seq for r in records}
        for record in sorted(records, key=lambda r: r.seq):
            if record.seq in present:
                name = self.prefix + JOURNAL + seq_name(record.seq)
                try:
                    found = await read_object(self.store, name)
                    if found is not None:
                        decoded = ClusterRecord.decode(self.keys.records, name, found[0])
                        if decoded.key == record.key and decoded.op == record.op and decoded.crc32 == record.crc32:
                            self._set(record.key, _Mirrored(decoded, _local_of(record)))
                            continue
                        raise ValueError("it is not the local record")
                except (ValueError, TypeError) as exc:
                    log.warning("write-back: the cluster copy of %r is unreadable (%s); sending it again",
                                record.key, exc)
            await self.mirror(record)
        for seq in sorted(set(present) - wanted):
            await self._delete_quietly(self.prefix + JOURNAL + seq_name(seq))
        for name in listing.files:  # copies re-mirrored by an earlier incarnation: each record is whole above
            if not name.isdigit():
                await self._delete_quietly(self.prefix + JOURNAL + name)
        for name in (await self.store.list_dir(self.prefix + DATA)).files:
            if self._piece_refs.get(DATA + name, 0) == 0:
                await self._delete_quietly(self.prefix + DATA + name)

    def start(self) -> None:
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def close(self, *, drained: bool) -> None:
        """Stop renewing; with nothing pending, remove the prefix (its lease last)."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if drained and not self.taken_over and self.prefix:
            try:
                async with asyncio.timeout(DURABLE_DEADLINE_FLOOR_S):
                    for sub in (JOURNAL, DATA):
                        for name in (await self.store.list_dir(self.prefix + sub)).files:
                            await self.store.delete(self.prefix + sub + name)
                    await self.store.delete_if(self.prefix + LEASE, self._lease_etag)
                (self.staging_root / INCARNATION_FILE).unlink(missing_ok=True)
            except (ObjectStoreError, TimeoutError, OSError) as exc:
                log.warning("write-back: could not remove the cluster journal %s (%s); `cachefs recover` "
                            "finds it empty", self.prefix, exc)

    def snapshot(self) -> dict[str, Any]:
        """The ``cluster_journal`` part of the write-back stats."""
        return {"prefix": self.prefix, "pending_records": len(self._by_key), "taken_over": self.taken_over,
                "lease_fresh": self.fresh(), "records_mirrored": self.stats["records"],
                "data_bytes_mirrored": self.stats["data_bytes"], "records_removed": self.stats["removed"],
                "failures": self.stats["failures"], "records_resettled": self.stats["resettled"]}

    # -- what the write-back engine calls ------------------------------------------------------------
    def note_base(self, key: str, etag: str) -> None:
        """The source holds ``key`` at ``etag`` (a version this writer staged from, or uploaded)."""
        self._known[key] = etag
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    @contextlib.contextmanager
    def sending(self, key: str) -> Iterator[None]:
        """This writer's upload or delete of ``key`` to the source is in flight inside this block:
        records of ``key`` acknowledged meanwhile are ``racing`` with it."""
        self._sending[key] += 1
        try:
            yield
        finally:
            self._sending[key] -= 1
            if self._sending[key] <= 0:
                del self._sending[key]

    def upload_tag(self, seq: int) -> dict[str, str]:
        """The metadata of this writer's upload of record ``seq`` (``upload_tag``)."""
        return upload_tag(self.prefix, seq)

    def silent_since(self, when: float) -> bool:
        """Whether the cluster store has answered neither a lease renewal nor a record since ``when``
        (monotonic): a file whose acknowledgement timed out then fails again at once (``WriteBack.commit``)."""
        return max(self._renewed_at, self._mirrored_at) < when

    def fresh(self) -> bool:
        """May this writer upload to the source now (its lease renewed recently, not taken over)?"""
        return not self.taken_over and self.monotonic() - self._renewed_at < self.lease_ttl_s / 2

    def check_may_upload(self) -> None:
        if self.taken_over:
            raise TakenOverError(f"the cluster journal {self.prefix} was taken over by a recoverer: this "
                                 "daemon no longer uploads it")
        if not self.fresh():
            raise TakenOverError(f"the lease on {self.prefix} was not renewed for {self.lease_ttl_s / 2:g} s "
                                 "(cluster store unreachable?): uploads wait until it is")

    def where(self, key: str) -> bool:
        """Whether ``key``'s pending operation is in the cluster store."""
        return key in self._by_key

    async def mirror(self, record: Record) -> None:
        """Make ``record`` durable in the cluster store (data, then journal object) or raise
        ``DurabilityError``. Called before the record is written locally."""
        if self.taken_over:
            raise DurabilityError(f"the cluster journal {self.prefix} was taken over; nothing is acknowledged")
        size = record.size if record.op == PUT and not record.is_marker else 0
        try:
            async with asyncio.timeout(durable_deadline_s(size)):
                await self._mirror(record)
        except TimeoutError:
            self.stats["failures"] += 1
            error = DurabilityError(f"the cluster store did not take {record.key!r} within "
                                    f"{durable_deadline_s(size):g} s (--write-durability cluster): not "
                                    "acknowledged")
            error.timed_out = True
            raise error from None
        except (ObjectStoreError, OSError) as exc:
            self.stats["failures"] += 1
            raise DurabilityError(f"the cluster store refused {record.key!r} ({exc}) (--write-durability "
                                  "cluster): not acknowledged") from exc

    async def _mirror(self, record: Record) -> None:
        name = seq_name(record.seq)
        local = _local_of(record)
        segments, new = (await self._plan(DATA + name, local)) if local is not None else ((), None)
        for piece, _, _ in segments:  # held from now: a piece shared with a record released meanwhile stays
            self._piece_refs[piece] += 1
        base: str | None
        if record.is_marker:
            base = None
        elif record.key in self._known:
            base = self._known[record.key]
        elif record.op == PUT and not record.may_exist:
            base = ABSENT
        else:
            base = None
        cr = ClusterRecord(record.seq, record.key, record.op, size=record.size, crc32=record.crc32,
                           segments=segments, base=base, acked_at=self.wall(), mtime=record.mtime,
                           racing=record.key in self._sending)
        raw = cr.encode(self.keys.records, self.prefix + JOURNAL + name)
        try:
            # The new piece and the journal object go in parallel (one round trip for an fsync): a
            # journal object whose piece never landed was never acknowledged, and the key's previous
            # record stays until this returns, so recovery falls back to it (``recovery``).
            async with asyncio.TaskGroup() as group:
                group.create_task(self.store.put(self.prefix + JOURNAL + name, len(raw), lambda s, e: raw[s:e]))
                if new is not None and local is not None:
                    group.create_task(self._upload_piece(new[0], local[0], new[1], new[2]))
        except BaseException as exc:  # a failure, or the deadline (cancelled)
            self._release(cr)
            if isinstance(exc, BaseExceptionGroup) and isinstance(exc.exceptions[0], Exception):
                raise exc.exceptions[0] from None
            raise
        self.stats["records"] += 1
        self._mirrored_at = self.monotonic()
        old = self._set(record.key, _Mirrored(cr, local), counted=True)
        if old is not None and old.record.seq != cr.seq:
            for name in old.names():
                self._spawn(self._delete_quietly(self.prefix + name))
            self._release(old.record)

    def _set(self, key: str, mirrored: _Mirrored, *, counted: bool = False) -> _Mirrored | None:
        """Make ``mirrored`` the key's live record (its pieces referenced, unless ``counted`` already);
        the one it replaces."""
        if not counted:
            for piece, _, _ in mirrored.record.segments:
                self._piece_refs[piece] += 1
        old = self._pop(key)
        self._by_key[key] = mirrored
        if mirrored.local is not None:
            self._by_file[mirrored.local[0]] = key
        return old

    def _pop(self, key: str) -> _Mirrored | None:
        """Forget the key's live record; its pieces stay referenced until ``_release``."""
        old = self._by_key.pop(key, None)
        if old is not None and old.local is not None and self._by_file.get(old.local[0]) == key:
            del self._by_file[old.local[0]]
        return old

    def _release(self, record: ClusterRecord) -> None:
        """``record`` is no longer live: data objects no live record names are deleted (background)."""
        for piece, _, _ in record.segments:
            self._piece_refs[piece] -= 1
            if self._piece_refs[piece] <= 0:
                del self._piece_refs[piece]
                self._spawn(self._delete_quietly(self.prefix + piece))

    async def _plan(self, obj: str, local: tuple[str, int, int]) -> tuple[tuple[tuple[str, int, str], ...],
                                                                           tuple[str, int, int] | None]:
        """The pieces of the staged version ``local``: those of a live record that names the same
        local data file with a prefix of it (an append fsync'd again; a rename), plus ``obj`` for the
        bytes past it, with the MAC of its bytes (read from the staged file in a worker thread);
        and ``(obj, start, length)`` to upload, if any. That prefix is intact: the acknowledged
        prefix of a data file is never modified while a record names it (``tiering.writeback.staged``)."""
        name, size, _crc = local
        pieces: tuple[tuple[str, int, str], ...] = ()
        done = 0
        holder = self._by_file.get(name)
        other = self._by_key.get(holder) if holder is not None else None
        if other is not None and other.local is not None and other.local[0] == name and other.local[1] <= size:
            pieces, done = other.record.segments, other.local[1]
        if done == size:
            return pieces, None
        tag = await asyncio.to_thread(self._piece_tag, self.prefix + obj, name, done, size - done)
        return pieces + ((obj, size - done, tag),), (obj, done, size - done)

    def _piece_tag(self, obj: str, name: str, start: int, length: int) -> str:
        """The MAC of bytes [start, start+length) of the staged file ``name``, as piece ``obj``."""
        running = piece_mac(self.keys.data, obj)
        fd = os.open(self.data_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for at in range(0, length, IO_CHUNK):
                running.update(pread_exact(fd, min(IO_CHUNK, length - at), start + at))
        finally:
            os.close(fd)
        return running.hexdigest()

    async def _upload_piece(self, obj: str, name: str, start: int, length: int) -> None:
        fd = await asyncio.to_thread(os.open, self.data_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await self.store.put(self.prefix + obj, length, lambda s, e: pread_exact(fd, e - s, start + s))
        finally:
            os.close(fd)
        self.stats["data_bytes"] += length

    async def forget(self, key: str, *, durable: bool) -> None:
        """``key``'s record is being removed locally. ``durable``: the removal matters (a record left
        behind would be replayed wrongly: an unlinked file never uploaded), so its journal object is
        deleted before this returns, or ``DurabilityError``; otherwise (the upload of that very record
        succeeded) in the background: a leftover is harmless, since its base no longer matches the
        source. Data objects always go in the background."""
        mirrored = self._pop(key)
        if mirrored is None:
            return
        if not durable:
            for name in mirrored.names():
                self._spawn(self._delete_quietly(self.prefix + name))
            self._release(mirrored.record)
            self.stats["removed"] += 1
            return
        try:
            async with asyncio.timeout(DURABLE_DEADLINE_FLOOR_S):
                for name in mirrored.names():
                    await self.store.delete(self.prefix + name)
        except (ObjectStoreError, TimeoutError) as exc:
            self.stats["failures"] += 1
            self._by_key[key] = mirrored  # still live (its pieces were never released)
            if mirrored.local is not None:
                self._by_file[mirrored.local[0]] = key
            # The DELETE may have been sent and still run (a store that froze, then resumed): the
            # record the failed unlink leaves acknowledged would then be gone from the cluster journal.
            # It is put again under a name that request cannot reach (``_settle``).
            self._spawn(self._settle(key, mirrored))
            raise DurabilityError(f"the cluster store did not drop the record of {key!r} "
                                  f"({exc or 'timeout'}) (--write-durability cluster)") from exc
        self.stats["removed"] += 1
        self._release(mirrored.record)

    async def _settle(self, key: str, mirrored: _Mirrored) -> None:
        """After a request on ``mirrored``'s journal object whose outcome is unknown: put the record
        again under a new name (``copy_name``), retried with a growing pause until it lands, the record
        is no longer live, or SETTLE_LIMIT_S passes (logged: a node lost then may lose that record)."""
        pause, deadline = SETTLE_FIRST_PAUSE_S, self.monotonic() + SETTLE_LIMIT_S
        while self._by_key.get(key) is mirrored and self.monotonic() < deadline:
            name = JOURNAL + copy_name(mirrored.record.seq, mirrored.copies + 1)
            raw = mirrored.record.encode(self.keys.records, self.prefix + name)
            try:
                async with asyncio.timeout(DURABLE_DEADLINE_FLOOR_S):
                    await self.store.put(self.prefix + name, len(raw), lambda s, e: raw[s:e])
            except (ObjectStoreError, TimeoutError) as exc:
                log.info("write-back: re-mirroring the record of %r failed (%s); trying again in %g s", key,
                         exc or "timeout", pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, SETTLE_MAX_PAUSE_S)
                continue
            if self._by_key.get(key) is mirrored:
                mirrored.copies += 1
                self.stats["resettled"] += 1
                log.info("write-back: the record of %r is in the cluster store again (%s), after a request on it "
                         "whose outcome was unknown", key, name)
            else:  # removed meanwhile (uploaded, or unlinked for good): the copy is garbage
                await self._delete_quietly(self.prefix + name)
            return
        if self._by_key.get(key) is mirrored:
            log.error("write-back: the record of %r could not be put in the cluster store again within %g s; "
                      "it is on local disk, and may be missing from the cluster journal", key, SETTLE_LIMIT_S)

    async def uploaded(self, key: str, seq: int, etag: str | None) -> None:
        """The source now holds operation ``seq`` of ``key`` (``etag``; None: deleted). A newer record
        mirrored meanwhile is put again with this as its base (the module docstring)."""
        if key.endswith("/"):
            return
        self.note_base(key, etag if etag is not None else ABSENT)
        mirrored = self._by_key.get(key)
        if mirrored is None or mirrored.record.seq <= seq or mirrored.record.base == self._known[key]:
            return  # nothing newer pending (``forget`` follows), or its base is right already
        cr = replace(mirrored.record, base=self._known[key], racing=key in self._sending)
        try:
            async with asyncio.timeout(DURABLE_DEADLINE_FLOOR_S):  # the key's lock is held meanwhile
                for name in mirrored.names():  # every copy: none may keep the older base
                    await self.store.put(self.prefix + name, *small_body(cr.encode(self.keys.records, self.prefix + name)))
            mirrored.record = cr
        except (ObjectStoreError, TimeoutError) as exc:
            log.warning("write-back: could not update the base of %r in the cluster journal (%s); a recovery "
                        "would take this writer's own upload for a newer version and keep it", key,
                        exc or "timeout")

    # -- internals ----------------------------------------------------------------------------------
    def _owner(self, incarnation: str) -> str:
        return f"writer:{self.node}:{incarnation}"

    def _load_incarnation(self) -> tuple[str, str] | None:
        """``(node, incarnation)`` of the journal this staging directory belongs to, if any."""
        try:
            body = json.loads((self.staging_root / INCARNATION_FILE).read_text())
        except (OSError, ValueError):
            return None
        node, value = body.get("node"), body.get("incarnation")
        if body.get("volume") != self.volume or not isinstance(node, str) or not isinstance(value, str):
            return None
        try:
            return (safe_node_id(node), value) if value.isalnum() else None
        except ValueError:
            return None

    def _save_incarnation(self, incarnation: str) -> None:
        path = self.staging_root / INCARNATION_FILE
        tmp = path.with_name(".tmp-" + INCARNATION_FILE)
        tmp.write_text(json.dumps({"incarnation": incarnation, "volume": self.volume, "node": self.node}))
        os.replace(tmp, path)

    def _set_aside_local(self) -> None:
        records = self.staging_root / "records"
        if records.is_dir() and any(records.iterdir()):
            target = self.staging_root / f"taken-over-{int(self.wall())}"
            os.replace(records, target)
            records.mkdir()
            log.error("write-back: local journal moved to %s: a recoverer finished it", target)

    def _note_forged(self, prefix: str, lease: Lease) -> None:
        self.stats["forged_leases"] += 1
        log.error("write-back: the lease of %s fails its check (%s): not a recoverer's; this writer puts its "
                  "own back", prefix, lease.owner)

    async def _renew(self, etag: str) -> None:
        lease = Lease(self.owner, WRITER, self.lease_ttl_s, node=self.node, source=self.source)
        body = small_body(lease.encode(self.keys.leases, self.prefix + LEASE))
        try:
            info = await self.store.put_if(self.prefix + LEASE, *body, if_match=etag)
        except (ObjectChangedError, ObjectNotFoundError):
            # Only a lease written with the cluster key takes this journal over: anything else in
            # its place (a forgery, or nothing: deleted) is replaced by this writer's own.
            current = await read_lease(self.store, self.prefix, self.keys.leases)
            if current is not None and current.authentic and current.role == WRITER and current.owner == self.owner:
                self._lease_etag, self._renewed_at = current.etag, self.monotonic()  # ours (a lost answer)
                return
            if current is None or not current.authentic:
                if current is not None:
                    self._note_forged(self.prefix, current)
                else:
                    self.stats["forged_leases"] += 1
                    log.error("write-back: the lease of %s is gone (not a recoverer's doing); this writer puts "
                              "its own back", self.prefix)
                try:
                    if current is None:
                        info = await self.store.put_if(self.prefix + LEASE, *body, if_none_match=True)
                    else:
                        info = await self.store.put_if(self.prefix + LEASE, *body, if_match=current.etag)
                except (ObjectChangedError, ObjectNotFoundError):
                    return  # changed again meanwhile: the next renewal looks again
                self._lease_etag, self._renewed_at = info.etag, self.monotonic()
                return
            if not self.taken_over:
                log.error("write-back: the cluster journal %s was taken over by a recoverer; this daemon stops "
                          "uploading it", self.prefix)
            self.taken_over = True
            return
        self._lease_etag, self._renewed_at = info.etag, self.monotonic()

    async def _renew_loop(self) -> None:
        step = self.lease_ttl_s * LEASE_RENEW_FRACTION
        while not self.taken_over:
            await asyncio.sleep(step)
            try:
                async with asyncio.timeout(step):
                    await self._renew(self._lease_etag)
            except (ObjectStoreError, TimeoutError) as exc:
                log.warning("write-back: renewing the lease on %s failed (%s)", self.prefix, exc or "timeout")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete_quietly(self, key: str) -> None:
        try:
            await self.store.delete(key)
        except ObjectStoreError as exc:  # garbage only: recovery replays the latest record of each key
            log.debug("write-back: could not delete %s from the cluster store: %s", key, exc)


def _local_of(record: Record) -> tuple[str, int, int] | None:
    if record.op == PUT and not record.is_marker and record.data:
        return record.data, record.size, record.crc32
    return None
