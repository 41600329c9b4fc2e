"""The cluster store's write-back journal, as objects: its layout, its formats, their MACs, and the
small store operations recovery and the writer share (``tiering.writeback.durable`` has the design:
the layout, the leases, "Authentication"; ``tiering.writeback.recovery`` replays it).

Split from ``tiering.writeback.durable`` (the writer's mirror, ``DurableJournal``), which imports
everything here and is where callers import it from.
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

log = logging.getLogger("tiering.writeback")

ROOT = "writeback/"
LEASE = "lease"
JOURNAL = "journal/"
DATA = "data/"
INCARNATION_FILE = "durable.json"
FORMAT = 2  # 1: the unauthenticated format (CRC-32 only), refused since
# A journal object or lease larger than this is not one (records are a few hundred bytes, plus ~100
# per data piece of a file appended to and fsync'd again): refused before it is read into memory.
MAX_RECORD_BYTES = 4 * 1024 * 1024
MAX_LEASE_BYTES = 64 * 1024
# The base of a write whose key the source did not hold.
ABSENT = "-"

WRITER, RECOVERING, RECOVERED = "writer", "recovering", "recovered"
# The role of a lease object whose MAC fails: nobody's (see "Authentication" above).
UNAUTHENTICATED = "unauthenticated"


class DurabilityError(CacheError):
    """The cluster store did not take a record in time: close()/fsync() fail, nothing is acknowledged.
    ``timed_out``: it did not answer within the deadline (rather than refusing)."""

    timed_out = False


class TakenOverError(ObjectStoreError):
    """This writer's journal was taken over by a recoverer: it must not upload it."""


class UnauthenticatedError(ValueError):
    """A journal object, data piece or lease whose MAC fails: not written with this cluster key."""


@dataclass(frozen=True)
class JournalKeys:
    """The keys of the write-back journal, derived from the cluster key (one per purpose)."""

    records: MacKey
    data: MacKey
    leases: MacKey

    @classmethod
    def of(cls, key: ClusterKey) -> "JournalKeys":
        return cls(key.derive(JOURNAL_PURPOSE), key.derive(DATA_PURPOSE), key.derive(LEASE_PURPOSE))


def _sign(mac: MacKey, name: str, body: bytes) -> bytes:
    """``<hex MAC> <body>``: the MAC covers the object's name, so it cannot be moved elsewhere."""
    return mac.tag(name.encode("utf-8", "surrogateescape") + b"\x00", body).hex().encode("ascii") + b" " + body


def _verify(mac: MacKey, name: str, raw: bytes) -> bytes:
    """The body of a signed object, or ``UnauthenticatedError``."""
    width = 2 * MAC_SIZE
    if len(raw) < width + 1 or raw[width:width + 1] != b" ":
        raise UnauthenticatedError("no MAC (an object of the previous format, or not cachefs's)")
    try:
        tag = bytes.fromhex(raw[:width].decode("ascii"))
    except ValueError:
        raise UnauthenticatedError("malformed MAC") from None
    body = raw[width + 1:]
    if not hmac.compare_digest(tag, mac.tag(name.encode("utf-8", "surrogateescape") + b"\x00", body)):
        raise UnauthenticatedError("MAC mismatch: not written with this cluster key, or moved from another name")
    return body


def piece_mac(mac: MacKey, name: str) -> "hmac.HMAC":
    """A running MAC of the data piece at ``name`` (its full object name), to be fed its bytes."""
    return mac.running(name.encode("utf-8", "surrogateescape") + b"\x00")


class ConditionalStore(ObjectStore, Protocol):
    """An ``ObjectStore`` with the conditional writes leases and recovery need (S3, in-memory), and
    user metadata: the writer tags its uploads (``upload_tag``), the recoverer reads the tag."""

    async def put_if(self, key: str, size: int, read: ReadRange, *, if_match: str | None = None,
                     if_none_match: bool = False, metadata: Mapping[str, str] | None = None) -> ObjectInfo: ...

    async def delete_if(self, key: str, if_match: str) -> None: ...

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]: ...


# The user metadata a writer with a cluster copy puts on each upload to the source: its journal prefix
# and the record's sequence number. A recoverer that finds the source's object differing from a
# record's base reads it: an older upload of the same writer (sent before the node died, its answer
# never seen, so the record's base was never brought up to date) is replaced, not taken for a newer
# version written by someone else.
TAG_WRITER = "cachefs-writer"
TAG_SEQ = "cachefs-seq"


def upload_tag(prefix: str, seq: int) -> dict[str, str]:
    return {TAG_WRITER: prefix, TAG_SEQ: str(seq)}


def own_older_upload(metadata: Mapping[str, str], prefix: str, seq: int) -> bool:
    """Whether an object with ``metadata`` is an upload of the writer of journal ``prefix`` that is
    older than its record ``seq``."""
    tagged = tag_seq(metadata, prefix)
    return tagged is not None and tagged < seq


def tag_seq(metadata: Mapping[str, str], prefix: str) -> int | None:
    """The record whose upload an object with ``metadata`` is, if the writer of journal ``prefix`` made it."""
    try:
        return int(metadata.get(TAG_SEQ, "")) if metadata.get(TAG_WRITER) == prefix else None
    except ValueError:
        return None


def conditional(store: ObjectStore) -> ConditionalStore | None:
    """``store`` if it has conditional writes (and user metadata), else None."""
    if all(callable(getattr(store, name, None)) for name in ("put_if", "delete_if", "head_metadata")):
        return store  # type: ignore[return-value]
    return None


def writer_prefix(volume: str, node: str, incarnation: str) -> str:
    return f"{ROOT}{volume}/{node}/{incarnation}/"


def safe_node_id(node: str) -> str:
    """A node id usable as one key segment (a hostname, a Kubernetes node name)."""
    text = "".join(c if c.isalnum() or c in "-_." else "_" for c in node.strip())[:128]
    if not text or text in (".", ".."):
        raise ValueError(f"node id {node!r} is not usable (letters, digits, '-', '_', '.')")
    return text


def seq_name(seq: int) -> str:
    return f"{seq:016d}"


def copy_name(seq: int, copy: int) -> str:
    """The name of a record's journal object: ``seq_name``, or for a re-mirrored copy (``copy`` >= 1)
    ``<seq>.<copy>``: a name no request sent before can delete (``DurableJournal._settle``)."""
    return seq_name(seq) if copy == 0 else f"{seq_name(seq)}.{copy}"


def names_record(name: str, seq: int) -> bool:
    """Whether journal object ``name`` (any path ending in it) is a name of record ``seq``."""
    base = JOURNAL + seq_name(seq)
    if name.endswith(base):
        return True
    head, dot, copy = name.rpartition(".")
    return bool(dot) and copy.isdigit() and head.endswith(base)


# ---------------------------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class ClusterRecord:
    """One pending operation in the cluster store (``journal/<seq>``)."""

    seq: int
    key: str
    op: str  # PUT or DELETE
    size: int = 0
    crc32: int = 0
    # The data: (object, length, hex MAC of its bytes) pieces that, in order, make bytes [0, size).
    # A file fsync'd again after an append shares the pieces of its previous record and adds one.
    segments: tuple[tuple[str, int, str], ...] = ()
    base: str | None = None  # source ETag replaced, ABSENT, or None: unknown
    acked_at: float = 0.0  # wall clock of the acknowledgement
    mtime: float = 0.0
    # This writer's own upload or delete of the key was in flight when the record was acknowledged:
    # its outcome (unseen if the node died) may stand in the source instead of ``base``. Written only
    # when true (records without it read as before).
    racing: bool = False

    @property
    def is_marker(self) -> bool:
        return self.key.endswith("/")

    def encode(self, mac: MacKey, name: str) -> bytes:
        """The journal object at ``name`` (the full object name): its MAC, then the JSON body."""
        body = asdict(self)
        if not self.racing:
            del body["racing"]
        body["format"] = FORMAT
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        return _sign(mac, name, text + b"\n")

    @classmethod
    def decode(cls, mac: MacKey, name: str, raw: bytes) -> "ClusterRecord":
        """The record in the journal object ``name``; ``UnauthenticatedError`` if its MAC fails,
        ``ValueError`` if it is malformed."""
        text = _verify(mac, name, raw)
        if not text.endswith(b"\n"):
            raise ValueError("truncated or malformed journal object")
        body = json.loads(text)
        if body.pop("format", None) != FORMAT:
            raise ValueError("unknown journal object format")
        body["segments"] = tuple((str(piece), int(length), str(tag)) for piece, length, tag in body.get("segments", ()))
        record = cls(**body)
        if record.op not in (PUT, DELETE) or not record.key:
            raise ValueError("invalid journal object fields")
        if sum(length for _, length, _ in record.segments) != record.size:
            raise ValueError("the data pieces do not make the recorded size")
        if not names_record(name, record.seq):
            raise ValueError("the record's sequence number is not its object's")
        return record


@dataclass(frozen=True)
class Lease:
    owner: str
    role: str  # WRITER, RECOVERING or RECOVERED
    ttl_s: float
    node: str = ""
    source: str = ""
    etag: str = field(default="", compare=False)  # from the store, not stored in the body
    modified: float = field(default=0.0, compare=False)  # the store's LastModified

    def encode(self, mac: MacKey, name: str) -> bytes:
        return _sign(mac, name, json.dumps({"format": FORMAT, "owner": self.owner, "role": self.role,
                                            "ttl_s": self.ttl_s, "node": self.node, "source": self.source},
                                           sort_keys=True).encode())

    @classmethod
    def decode(cls, mac: MacKey, name: str, raw: bytes, info: ObjectInfo) -> "Lease":
        """The lease at ``name``: an ``UNAUTHENTICATED`` one (nobody's, expiring a default TTL after
        the store's LastModified) if its MAC fails; ``ValueError`` if it is authentic but malformed."""
        try:
            body = json.loads(_verify(mac, name, raw))
        except UnauthenticatedError as exc:
            return cls(f"(unauthenticated: {exc})", UNAUTHENTICATED, DEFAULT_LEASE_TTL_S, etag=info.etag,
                       modified=info.mtime)
        if body.get("format") != FORMAT or body.get("role") not in (WRITER, RECOVERING, RECOVERED):
            raise ValueError("not a cachefs write-back lease")
        return cls(str(body["owner"]), body["role"], float(body["ttl_s"]), str(body.get("node", "")),
                   str(body.get("source", "")), etag=info.etag, modified=info.mtime)

    @property
    def authentic(self) -> bool:
        return self.role != UNAUTHENTICATED

    def expires_in(self, now: float) -> float:
        return self.modified + self.ttl_s - now


async def read_object(store: ObjectStore, key: str, limit: int = MAX_RECORD_BYTES) -> tuple[bytes, ObjectInfo] | None:
    """The whole (small) object and its info, or None if absent (or replaced between HEAD and GET).
    An object larger than ``limit`` is refused (``ValueError``) before a byte of it is read."""
    try:
        info = await store.head(key)
        if info.size > limit:
            raise UnauthenticatedError(f"{key} is {info.size} bytes, more than a journal object or lease can be ({limit})")
        return bytes(await store.get_range(key, info.etag, 0, info.size)) if info.size else b"", info
    except (ObjectNotFoundError, ObjectChangedError):
        return None


async def read_lease(store: ObjectStore, prefix: str, mac: MacKey) -> Lease | None:
    """The lease of ``prefix``, None if there is none; one whose MAC fails is ``UNAUTHENTICATED``."""
    name = prefix + LEASE
    try:
        found = await read_object(store, name, MAX_LEASE_BYTES)
    except ValueError:
        info = await store.head(name)
        return Lease("(unauthenticated: too large)", UNAUTHENTICATED, DEFAULT_LEASE_TTL_S, etag=info.etag,
                     modified=info.mtime)
    if found is None:
        return None
    raw, info = found
    try:
        return Lease.decode(mac, name, raw, info)
    except (ValueError, KeyError, TypeError) as exc:
        raise ObjectStoreError(f"the lease of {prefix} is not readable ({exc})") from None


def small_body(raw: bytes) -> tuple[int, ReadRange]:
    """``size, read`` of a small object held in memory, as ``put``/``put_if`` take them."""
    return len(raw), lambda start, end: raw[start:end]
