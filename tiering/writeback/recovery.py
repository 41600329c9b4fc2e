"""``cachefs recover``'s engine: finish the cluster-store journal of a writer that is gone.

See ``tiering.writeback.durable`` for the journal's layout, its records and the lease protocol. A
recovery (``recover_prefix``) takes the lease of one writer prefix (a conditional replace of the
expired lease: one recoverer wins), replays the latest complete record of each key in sequence order into the
source with conditional writes (``If-Match`` on the base ETag the record carries, ``If-None-Match``
for a key the source did not have; an object rewritten since is kept, never overwritten), deletes
the cluster copies as it goes, and leaves the lease as a ``recovered`` tombstone. A data object is
checked (size, MAC, CRC-32) into a temporary file before it is uploaded, so a large checkpoint is
streamed, not held in memory.

Only what a writer holding the cluster key wrote is replayed (``durable``, "Authentication"): a
journal object whose MAC fails (forged, moved from another name, of the previous format, or larger
than any record) is reported in ``forged`` and left where it is; a record whose data piece fails its
MAC is not uploaded (``failed``). A lease that fails its MAC is nobody's: it neither says
"recovered" nor holds the journal past a TTL after the store last saw it written, and it is taken
over like an expired lease, with the same conditional replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tiering.checksum import crc32
from tiering.clusterkey import ClusterKey
from tiering.errors import ObjectChangedError, ObjectNotFoundError, ObjectStoreError
from tiering.objectstore.mtimes import mtime_metadata
from tiering.protocols import ObjectStore
from tiering.writeback.durable import (
    ABSENT,
    DATA,
    JOURNAL,
    LEASE,
    LEASE_RENEW_FRACTION,
    RECOVERED,
    RECOVERING,
    ROOT,
    ClusterRecord,
    ConditionalStore,
    JournalKeys,
    Lease,
    UnauthenticatedError,
    piece_mac,
    read_lease,
    read_object,
    own_older_upload,
    tag_seq,
    seq_name,
    small_body,
)
from tiering.writeback.journal import DELETE, IO_CHUNK, PUT, pread_exact, pwrite_all
from tiering.writeback.settings import DEFAULT_LEASE_TTL_S

log = logging.getLogger("tiering.writeback")


@dataclass
class RecoveryReport:
    prefix: str
    state: str = "recovered"  # recovered, held (lease live), taken (another recoverer), already, lost
    detail: str = ""
    holder_role: str = ""  # held: the role of the live lease's owner (writer or recovering)
    uploaded: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    markers: int = 0
    kept_newer: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # data object missing or corrupt: damage
    forged: list[str] = field(default_factory=list)  # journal objects whose MAC fails: reported, left
    # Records never acknowledged (the writer died while sending them: a data piece never landed),
    # as "KEY (record SEQ)": nothing was lost, the key's previous record (if any) was replayed.
    never_acknowledged: list[str] = field(default_factory=list)


async def list_writers(store: ObjectStore, volume: str) -> list[str]:
    """Every writer prefix of ``volume`` in the cluster store."""
    out: list[str] = []
    base = f"{ROOT}{volume}/"
    for node in sorted((await store.list_dir(base)).dirs):
        for incarnation in sorted((await store.list_dir(f"{base}{node}/")).dirs):
            out.append(f"{base}{node}/{incarnation}/")
    return out


async def recover_prefix(source: ConditionalStore, cluster: ConditionalStore, prefix: str, *, key: ClusterKey,
                         owner: str, wall: Callable[[], float] = time.time, wait_s: float = 0.0,
                         assume_dead: bool = False) -> RecoveryReport:
    """Finish the journal of a dead writer (the module docstring): lease, replay in order, clean up."""
    report = RecoveryReport(prefix)
    keys = JournalKeys.of(key)
    deadline = wall() + wait_s
    while True:
        lease = await read_lease(cluster, prefix, keys.leases)
        if lease is not None and not lease.authentic:
            log.error("recover: the lease of %s fails its check (%s); it is nobody's, taken over once a TTL old",
                      prefix, lease.owner)
        if lease is not None and lease.role == RECOVERED:
            report.state, report.detail = "already", f"recovered by {lease.owner}"
            return report
        if lease is None or assume_dead or lease.expires_in(wall()) <= 0:
            break
        left = lease.expires_in(wall())
        if wall() + left > deadline:
            report.state, report.holder_role = "held", lease.role
            report.detail = f"lease held by {lease.owner} ({lease.role}) for {left:.0f} more s"
            return report
        await asyncio.sleep(min(left + 0.5, max(0.1, deadline - wall())))
    ttl = lease.ttl_s if lease is not None else DEFAULT_LEASE_TTL_S
    mine = Lease(owner, RECOVERING, ttl, source=lease.source if lease else "")
    body = small_body(mine.encode(keys.leases, prefix + LEASE))
    try:
        if lease is None:
            info = await cluster.put_if(prefix + LEASE, *body, if_none_match=True)
        else:
            info = await cluster.put_if(prefix + LEASE, *body, if_match=lease.etag)
    except (ObjectChangedError, ObjectNotFoundError):
        report.state, report.detail = "taken", "another recoverer took the lease first"
        return report
    check = await read_lease(cluster, prefix, keys.leases)  # for a store that ignored the condition
    if check is None or check.owner != owner:
        report.state, report.detail = "taken", "another recoverer took the lease first (read-back)"
        return report
    lease_etag = info.etag

    listing = await cluster.list_dir(prefix + JOURNAL)
    by_key: dict[str, list[ClusterRecord]] = {}
    for name in sorted(listing.files):
        where = prefix + JOURNAL + name
        try:
            found = await read_object(cluster, where)
            if found is None:
                continue
            record = ClusterRecord.decode(keys.records, where, found[0])
        except UnauthenticatedError as exc:
            log.error("recover: journal object %s fails its check (%s); not replayed, left in place", where, exc)
            report.forged.append(name)
            continue
        except (ValueError, TypeError) as exc:
            log.error("recover: journal object %s%s%s is unreadable (%s); skipped", prefix, JOURNAL, name, exc)
            report.failed.append(name)
            continue
        by_key.setdefault(record.key, []).append(record)
    latest: dict[str, ClusterRecord] = {}
    for path, records in by_key.items():
        # The newest record whose pieces are all there: one whose piece never landed was being
        # written when the writer died (its journal object and its piece go up in parallel), so it
        # was never acknowledged, and the key's previous record was still kept for it.
        for record in sorted(records, key=lambda r: -r.seq):
            if await _pieces_present(cluster, prefix, record):
                latest[path] = record
                break
            # Not damage: the writer's close/fsync of it never returned, so no application was told
            # it was saved (a note, not a failure: a periodic Job must not page anyone for it).
            log.info("recover: record %d of %r has a data piece missing: it was never acknowledged; the "
                     "one before it, if any, is used", record.seq, path)
            report.never_acknowledged.append(f"{path} (record {record.seq})")
    renewed = time.monotonic()
    for record in sorted(latest.values(), key=lambda r: r.seq):
        if time.monotonic() - renewed > ttl * LEASE_RENEW_FRACTION:
            try:
                lease_etag = (await cluster.put_if(prefix + LEASE, *body, if_match=lease_etag)).etag
            except (ObjectChangedError, ObjectNotFoundError):
                report.state, report.detail = "lost", "the lease was taken while recovering; stopped"
                return report
            renewed = time.monotonic()
        await _replay(source, cluster, prefix, record, keys, report)
        await cluster.delete(prefix + JOURNAL + seq_name(record.seq))  # data pieces may be shared: swept below
    # Superseded records and every data piece (a piece no authentic record names is of no use to
    # anyone); journal objects that failed their check stay, for whoever looks into them.
    for name in (await cluster.list_dir(prefix + JOURNAL)).files:
        if name not in report.forged:
            await cluster.delete(prefix + JOURNAL + name)
    for name in (await cluster.list_dir(prefix + DATA)).files:
        await cluster.delete(prefix + DATA + name)
    tomb = Lease(owner, RECOVERED, ttl, source=mine.source)
    await cluster.put_if(prefix + LEASE, *small_body(tomb.encode(keys.leases, prefix + LEASE)), if_match=lease_etag)
    return report


async def _replay(source: ConditionalStore, cluster: ObjectStore, prefix: str, record: ClusterRecord,
                  keys: JournalKeys, report: RecoveryReport) -> None:
    key = record.key
    if record.is_marker:
        if record.op == PUT:
            with contextlib.suppress(ObjectChangedError):
                await source.put_if(key, *small_body(b""), if_none_match=True)
        else:
            await source.delete(key)
        report.markers += 1
        return
    if record.op == DELETE:
        base = record.base if record.base is not None else await _unknown_base(source, record)
        if base is None:
            base = await _own_older(source, prefix, record)
        if base is None:
            report.kept_newer.append(key)
        elif base != ABSENT:
            try:
                await source.delete_if(key, base)
                report.deleted.append(key)
            except ObjectChangedError:
                own = await _own_older(source, prefix, record)
                try:
                    if own is None or own == ABSENT:
                        raise ObjectChangedError(key)
                    await source.delete_if(key, own)
                    report.deleted.append(key)
                except ObjectChangedError:
                    report.kept_newer.append(key)
                except ObjectNotFoundError:
                    report.deleted.append(key)
            except ObjectNotFoundError:
                report.deleted.append(key)
        return
    with tempfile.TemporaryFile(prefix="cachefs-recover-") as spool:  # on disk: a checkpoint may be large
        if not await _fetch_data(cluster, prefix, record, keys, spool.fileno()):
            report.failed.append(key)
            return
        base = record.base if record.base is not None else await _unknown_base(source, record)
        if base is None:
            base = await _own_older(source, prefix, record)
        if base == ALREADY:
            report.uploaded.append(key)  # the writer's own upload of this record is there
            return
        if base is None:
            report.kept_newer.append(key)
            return
        fd = spool.fileno()

        async def put(base: str) -> None:
            await source.put_if(key, record.size, lambda s, e: pread_exact(fd, e - s, s),
                                if_none_match=base == ABSENT, if_match=None if base == ABSENT else base,
                                metadata=mtime_metadata(record.mtime) if record.mtime > 0 else None)

        try:
            await put(base)
            report.uploaded.append(key)
        except (ObjectChangedError, ObjectNotFoundError):
            # The source moved on from the base: someone else's newer version, or this writer's own
            # older upload that landed while the node died (its answer, and so the new base, lost).
            own = await _own_older(source, prefix, record)
            try:
                if own is None:
                    raise ObjectChangedError(key) from None
                if own != ALREADY:
                    await put(own)
                report.uploaded.append(key)
            except (ObjectChangedError, ObjectNotFoundError):
                report.kept_newer.append(key)


# What ``_own_older`` answers when the source's object is this very record's upload: the writer sent
# it before the node died, but not the removal of the record (nothing left to do).
ALREADY = "="


async def _own_older(source: ConditionalStore, prefix: str, record: ClusterRecord) -> str | None:
    """What the record may replace besides its base: the ETag of the source's object if it is an
    upload of this same writer older than ``record`` (its tag, ``durable.upload_tag``); ABSENT if the
    object is gone and the record was ``racing`` with this writer's own delete of it; ALREADY if it is
    this record's own upload. None otherwise (untagged, another writer's, or gone with no delete of
    ours in flight)."""
    try:
        info, metadata = await source.head_metadata(record.key)
    except ObjectNotFoundError:
        return ABSENT if record.racing else None
    tagged = tag_seq(metadata, prefix)
    if tagged == record.seq and record.op == PUT and info.size == record.size:
        return ALREADY
    return info.etag if own_older_upload(metadata, prefix, record.seq) else None


async def _unknown_base(source: ObjectStore, record: ClusterRecord) -> str | None:
    """For a record whose base this writer did not know: ABSENT if the source has no object, its
    ETag if it was not modified after the acknowledgement, None (a newer version) otherwise."""
    try:
        info = await source.head(record.key)
    except ObjectNotFoundError:
        return ABSENT
    return info.etag if info.mtime <= record.acked_at else None


async def _pieces_present(cluster: ObjectStore, prefix: str, record: ClusterRecord) -> bool:
    """Whether every data piece of ``record`` is in the cluster store with its length."""
    for piece, length, _ in record.segments:
        try:
            if (await cluster.head(prefix + piece)).size != length:
                return False
        except ObjectNotFoundError:
            return False
    return True


async def _fetch_data(cluster: ObjectStore, prefix: str, record: ClusterRecord, keys: JournalKeys, fd: int) -> bool:
    """Copy the record's data pieces into ``fd``, checking their sizes, their MACs and the CRC-32;
    False if any fails."""
    crc, offset, piece = 0, 0, ""
    try:
        for piece, length, tag in record.segments:
            info = await cluster.head(prefix + piece)
            if info.size != length:
                raise ValueError(f"{piece} is {info.size} bytes, expected {length}")
            running = piece_mac(keys.data, prefix + piece)
            for start in range(0, length, IO_CHUNK):
                chunk = await cluster.get_range(prefix + piece, info.etag, start, min(length, start + IO_CHUNK))
                crc = crc32(chunk, crc)
                running.update(chunk)
                await asyncio.to_thread(pwrite_all, fd, chunk, offset + start)
            if not hmac.compare_digest(running.hexdigest(), tag):
                raise ValueError("its MAC fails (not the bytes the writer acknowledged)")
            offset += length
        if crc != record.crc32:
            raise ValueError("CRC-32 mismatch")
    except (ObjectStoreError, ValueError) as exc:
        log.error("recover: the data of %r (%s%s) is unusable: %s; not uploaded", record.key, prefix, piece, exc)
        return False
    return True
