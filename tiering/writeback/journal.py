"""The staging directory on disk: staged data files and one journal record per dirty object.

Layout (inside the per-source cache directory, next to the disk tier's ``blocks/``)::

    staging/
        FORMAT              "cachefs-staging 1\\n": refused if it says anything else
        data/<token>.dat    staged bytes of one version of one file (token: 24 random hex digits)
        records/<h>.rec     the pending operation on one object key (h: SHA-256 of the key, 32 hex)
        records/.tmp-*      a record being written (removed at start-up)
        quarantine/         records (and their data) that failed verification at start-up

Record format (version 1): one line, ``<crc32 of the JSON, 8 hex digits> <JSON>\\n``, the JSON
with sorted keys and ASCII only::

    {"crc32": 305419896, "data": "9f..e1.dat", "format": 1, "key": "ckpt/step-100.pt",
     "may_exist": false, "mtime": 1700000000.5, "op": "put", "seq": 42, "since": 1700000000.1,
     "size": 1048576}

``op`` is ``put`` (upload ``size`` bytes of ``data``, whose CRC-32 is ``crc32``; a key ending in
``/`` is a directory marker and has no data) or ``delete``. ``seq`` orders records across keys and
restarts. ``may_exist`` says whether the store may hold the key already (then a later unlink must
delete it there). A golden-bytes test pins the format.

One record per key: the file name is a hash of the key, so writing a record for a key atomically
replaces its previous record, and the on-disk journal is always "the latest acknowledged operation
on each key". This is why the journal is a directory of small files rather than an append-only log:
no compaction, no torn tail, and replay is a directory scan.

Writing a record: write a temp file, fsync it, rename it over ``<h>.rec``, fsync the directory. A
record only ever names a data file that was fsync'd (and whose directory entry was fsync'd) before
the record was written. Removing a record (after its upload) needs no fsync: if the removal is lost
in a crash, the upload is simply repeated, which is harmless (uploads are idempotent).

``scan()`` (start-up, before the mount) is the replay: it removes temp files, drops records it
cannot parse into ``quarantine/``, checks each put's data file (long enough; longer files are cut
back to the recorded size, since what lies beyond is unacknowledged; the CRC-32 of the recorded
prefix must match) and quarantines any that fail, gives a data file named by two records (a rename
cut short by a crash) a copy of its own, and removes data files no record names (unacknowledged
writes). Every record it returns is safe to upload as it is.

All methods block; the engine calls them from worker threads.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tiering.checksum import crc32
from tiering.fileio import fsync_dir

log = logging.getLogger("tiering.writeback")

FORMAT_FILE = "FORMAT"
FORMAT_TEXT = "cachefs-staging 1\n"
RECORD_FORMAT = 1
DATA_DIR = "data"
RECORDS_DIR = "records"
QUARANTINE_DIR = "quarantine"
DATA_SUFFIX = ".dat"
RECORD_SUFFIX = ".rec"
TMP_PREFIX = ".tmp-"

PUT = "put"
DELETE = "delete"
# Bytes read per call when verifying or copying staged data.
IO_CHUNK = 8 * 1024 * 1024


class StagingFormatError(Exception):
    """The staging directory was written by an incompatible version; nothing is touched."""


@dataclass(frozen=True)
class Record:
    key: str
    op: str  # PUT or DELETE
    seq: int
    data: str | None = None  # data file name (puts of files only)
    size: int = 0
    crc32: int = 0
    mtime: float = 0.0  # the file's mtime (wall clock) when acknowledged
    since: float = 0.0  # when the object first became dirty (wall clock), for "oldest dirty"
    may_exist: bool = True

    @property
    def is_marker(self) -> bool:
        return self.key.endswith("/")


def record_name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32] + RECORD_SUFFIX


def encode_record(record: Record) -> bytes:
    body = asdict(record)
    body["format"] = RECORD_FORMAT
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return b"%08x " % crc32(text) + text + b"\n"


def decode_record(raw: bytes) -> Record:
    """Parse a record; ``ValueError`` naming the problem if it is not a whole, valid record."""
    if not raw.endswith(b"\n") or len(raw) < 11 or raw[8:9] != b" ":
        raise ValueError("truncated or malformed record")
    text = raw[9:-1]
    if int(raw[:8], 16) != crc32(text):
        raise ValueError("record checksum mismatch")
    body = json.loads(text)
    if body.pop("format", None) != RECORD_FORMAT:
        raise ValueError("unknown record format")
    record = Record(**body)
    if record.op not in (PUT, DELETE) or not record.key or record.size < 0:
        raise ValueError("invalid record fields")
    if record.op == PUT and not record.is_marker and not record.data:
        raise ValueError("a file put without a data file")
    return record


def pread_exact(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, looping over short reads; fewer only at end of file."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        size -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def crc_range(fd: int, start: int, end: int, crc: int = 0) -> int:
    """CRC-32 of bytes ``[start, end)`` of ``fd`` continued from ``crc``; ``OSError`` if the file is short."""
    pos = start
    while pos < end:
        chunk = pread_exact(fd, min(IO_CHUNK, end - pos), pos)
        if not chunk:
            raise OSError(errno.EIO, f"staged data file ends at {pos}, expected {end} bytes")
        crc = crc32(chunk, crc)
        pos += len(chunk)
    return crc


def copy_range(src_fd: int, dst_fd: int, length: int) -> None:
    """Copy bytes ``[0, length)`` of ``src_fd`` to the empty ``dst_fd``: in-kernel where possible."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, done, done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            n = -1
        if n == -1:
            chunk = pread_exact(src_fd, min(IO_CHUNK, length - done), done)
            if not chunk:
                raise OSError(errno.EIO, f"staged data file ends at {done}, expected {length} bytes")
            pwrite_all(dst_fd, chunk, done)
            n = len(chunk)
        elif n == 0:
            raise OSError(errno.EIO, f"staged data file ends at {done}, expected {length} bytes")
        done += n


@dataclass
class ScanResult:
    records: list[Record]
    quarantined: list[str]  # keys (or record file names) set aside, each logged
    removed_tmp: int = 0
    removed_orphans: int = 0
    truncated: int = 0  # data files cut back to their acknowledged size
    copied: int = 0  # data files shared by two records, given a copy each


class StagingDir:
    """The files of the staging area. Not thread-safe per key: the engine serialises each key."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.data_dir = self.root / DATA_DIR
        self.records_dir = self.root / RECORDS_DIR
        self.quarantine_dir = self.root / QUARANTINE_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / FORMAT_FILE
        try:
            found = marker.read_text()
        except FileNotFoundError:
            found = None
        if found is not None and found != FORMAT_TEXT:
            raise StagingFormatError(f"{self.root} holds staged data of another format ({found.strip()!r}); "
                                     f"this cachefs reads {FORMAT_TEXT.strip()!r} only")
        for directory in (self.data_dir, self.records_dir):
            directory.mkdir(exist_ok=True)
        if found is None:
            tmp = self.root / (TMP_PREFIX + FORMAT_FILE)
            tmp.write_text(FORMAT_TEXT)
            os.replace(tmp, marker)
            fsync_dir(self.root)

    # -- data files --------------------------------------------------------------------------------

    def create_data(self) -> tuple[str, int]:
        """A new, empty data file: ``(name, fd)`` (read-write). Its directory entry is not yet durable."""
        while True:
            name = secrets.token_hex(12) + DATA_SUFFIX
            try:
                fd = os.open(self.data_dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            return name, fd

    def open_data(self, name: str) -> int:
        return os.open(self.data_dir / name, os.O_RDWR | os.O_CLOEXEC)

    def unlink_data(self, name: str) -> None:
        try:
            os.unlink(self.data_dir / name)
        except FileNotFoundError:
            pass

    def sync_data_dir(self) -> None:
        fsync_dir(self.data_dir)

    # -- records -----------------------------------------------------------------------------------

    def write_record(self, record: Record) -> None:
        """Make ``record`` the durable pending operation of its key (temp, fsync, rename, fsync dir)."""
        tmp = self.records_dir / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                pwrite_all(fd, encode_record(record), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.records_dir / record_name(record.key))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.records_dir)

    def remove_record(self, key: str) -> None:
        """Forget the pending operation of ``key`` (no fsync: a lost removal only repeats an upload)."""
        try:
            os.unlink(self.records_dir / record_name(key))
        except FileNotFoundError:
            pass

    def remove_record_durably(self, key: str) -> None:
        """Forget it and make that durable: for records whose replay would be wrong, not just redundant."""
        self.remove_record(key)
        fsync_dir(self.records_dir)

    # -- replay ------------------------------------------------------------------------------------

    def scan(self) -> ScanResult:
        result = ScanResult(records=[], quarantined=[])
        by_key: dict[str, Record] = {}
        with os.scandir(self.records_dir) as entries:
            names = sorted(entry.name for entry in entries)
        for name in names:
            path = self.records_dir / name
            if name.startswith(TMP_PREFIX):
                path.unlink(missing_ok=True)
                result.removed_tmp += 1
                continue
            if not name.endswith(RECORD_SUFFIX):
                continue
            try:
                record = decode_record(path.read_bytes())
                if record_name(record.key) != name:
                    raise ValueError("record file name does not match its key")
            except (ValueError, TypeError, OSError) as exc:
                log.error("write-back: journal record %s is unreadable (%s); moved to %s, nothing uploaded for it",
                          path, exc, self.quarantine_dir)
                self._quarantine(name, None)
                result.quarantined.append(name)
                continue
            by_key[record.key] = record

        # Data files named by a record, each given to the record with the highest seq first.
        users: dict[str, list[Record]] = {}
        for record in sorted(by_key.values(), key=lambda r: -r.seq):
            if record.op == PUT and record.data:
                users.setdefault(record.data, []).append(record)
        for data, records in users.items():
            checked = self._check_data(data, records, result)
            for record in records:
                if record.key in checked:
                    continue
                log.error("write-back: staged data of %r (%s) failed verification; record and data moved to %s, "
                          "not uploaded", record.key, data, self.quarantine_dir)
                self._quarantine(record_name(record.key), None)
                by_key.pop(record.key, None)
                result.quarantined.append(record.key)
            # A data file named by several records (a rename cut short): one keeps it, others get copies.
            keepers = [r for r in records if r.key in checked]
            for record in keepers[1:]:
                copy_name = self._copy_data(data, record.size)
                moved = replace(record, data=copy_name)
                self.write_record(moved)
                by_key[record.key] = moved
                result.copied += 1

        referenced = {r.data for r in by_key.values() if r.op == PUT and r.data}
        with os.scandir(self.data_dir) as entries:
            for entry in entries:
                if entry.name not in referenced:
                    try:
                        os.unlink(entry.path)
                        result.removed_orphans += 1
                    except FileNotFoundError:
                        pass
        result.records = sorted(by_key.values(), key=lambda r: r.seq)
        return result

    def _check_data(self, data: str, records: list[Record], result: ScanResult) -> set[str]:
        """Keys of ``records`` whose recorded prefix of ``data`` is intact; cuts the file to the longest."""
        try:
            fd = os.open(self.data_dir / data, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return set()
        good: set[str] = set()
        try:
            length = os.fstat(fd).st_size
            longest = 0
            for record in records:
                if length < record.size:
                    continue
                if crc_range(fd, 0, record.size) == record.crc32:
                    good.add(record.key)
                    longest = max(longest, record.size)
            if good and length > longest:
                os.ftruncate(fd, longest)  # bytes past the acknowledged size were never acknowledged
                os.fsync(fd)
                result.truncated += 1
        finally:
            os.close(fd)
        return good

    def _copy_data(self, data: str, size: int) -> str:
        src = os.open(self.data_dir / data, os.O_RDONLY | os.O_CLOEXEC)
        try:
            name, dst = self.create_data()
            try:
                copy_range(src, dst, size)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        self.sync_data_dir()
        return name

    def _quarantine(self, record_file: str, data: str | None) -> None:
        self.quarantine_dir.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        source = self.records_dir / record_file
        try:
            raw = source.read_bytes()
            os.replace(source, self.quarantine_dir / f"{stamp}-{record_file}")
        except OSError:
            return
        try:
            found = decode_record(raw).data
        except (ValueError, TypeError):
            found = None
        for name in filter(None, {data, found}):
            if (self.data_dir / name).exists():
                # A copy, not a move: another record may still use the same data file.
                src = os.open(self.data_dir / name, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    dst = os.open(self.quarantine_dir / f"{stamp}-{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                  | os.O_CLOEXEC, 0o600)
                    try:
                        copy_range(src, dst, os.fstat(src).st_size)
                    finally:
                        os.close(dst)
                finally:
                    os.close(src)
        fsync_dir(self.records_dir)
