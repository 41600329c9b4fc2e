"""kill -9 of the daemon at random points of a write-heavy workload loses nothing acknowledged.

One bucket, one cache directory and one mountpoint for the whole test; each trial:

1. a writer thread creates new files, overwrites files of earlier trials and unlinks some, each file
   written with plain ``write`` calls, then ``fsync`` (half of them) and ``close``. A version counts
   as *acknowledged* only after ``close`` returned (and ``fsync`` before it, when called); an unlink
   only after ``unlink`` returned. Every version's SHA-256 is recorded before its first byte is
   written, so the one in flight at the kill is known too;
2. after a random delay (0.1-1.5 s), SIGKILL to the daemon this test started (its recorded PID);
   in a third of the trials a ``cachefs flush`` runs at the same time, so uploads are cut as well;
3. the dead mount is cleared with ``cachefs unmount`` (``--force`` accepted), the same cache
   directory is mounted again, and ``cachefs flush`` must succeed;
4. the bucket is checked against what the writer knows: every acknowledged version is there byte for
   byte (a loss otherwise); an acknowledged unlink stays deleted; the key of the operation in flight
   at the kill holds either its previous state or the complete new version; and no object anywhere
   holds anything else (a corrupt or mixed object otherwise). The remounted mount must serve what
   the bucket holds for every name this trial touched.

The remount of one trial is the mount the next trial writes to, so later trials also replay journals
left by earlier kills and overwrite objects uploaded after them. The trial count, the acknowledged
versions checked and the zero losses are printed. ``CACHEFS_WB_CRASH_TRIALS`` and
``CACHEFS_WB_CRASH_SEED`` change and replay a run.

A failure keeps its evidence in a directory under ``$TMPDIR`` named in the message: the daemons'
logs, the journal records the killed daemon left (decoded with ``tiering.writeback.journal``) and
those left after the flush, the staging files, the bucket listing, and which of the names with a
problem still answer a HEAD (stored but not listed: a listing problem, not a loss).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fuse.conftest import CLI
from tests.fuse.writeback_support import (
    bounded,
    clear_dead_mount,
    errno_name,
    flush_ok,
    get_bytes,
    kill9,
    list_keys,
    s3env,
    sha256,
)
from tiering.writeback.journal import RECORD_SUFFIX, decode_record

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB, MiB = 1024, 1024 * 1024
TRIALS = int(os.environ.get("CACHEFS_WB_CRASH_TRIALS", "22"))
KILL_DELAY_S = (0.1, 1.5)
# How long the writer thread may take to notice the dead daemon (its calls fail with ENOTCONN).
WRITER_JOIN_S = 30
PREFIX = "crash/"
WRITE_CHUNK = 256 * KiB


@dataclass
class Pending:
    """The operation the writer had started and not seen return: after a kill either outcome is allowed."""

    name: str
    sha: str | None  # the complete new version; None for an unlink


@dataclass
class Trial:
    number: int
    # name -> sha256 of the acknowledged state (None: acknowledged unlink), this trial only
    acked: dict[str, str | None] = field(default_factory=dict)
    pending: Pending | None = None
    versions_acked: int = 0
    unlinks_acked: int = 0
    error: BaseException | None = None


class Writer(threading.Thread):
    def __init__(self, root: Path, trial: Trial, rng: random.Random, known: list[str]) -> None:
        super().__init__(daemon=True, name=f"writer-{trial.number}")
        self.root = root
        self.trial = trial
        self.rng = rng
        self.known = known  # names present in the bucket before this trial (to overwrite or unlink)
        self.stop = threading.Event()

    def size(self) -> int:
        r = self.rng.random()
        if r < 0.6:
            return self.rng.randint(0, 64 * KiB)
        if r < 0.95:
            return self.rng.randint(64 * KiB, 1 * MiB)
        return self.rng.randint(1 * MiB, 4 * MiB)

    def run(self) -> None:
        t = self.trial
        n = 0
        try:
            while not self.stop.is_set():
                r = self.rng.random()
                live = [k for k in self.known if t.acked.get(k, "") is not None]
                if r < 0.1 and live:
                    name = self.rng.choice(live)
                    t.pending = Pending(name, None)
                    os.unlink(self.root / name)
                    t.acked[name] = None
                    t.unlinks_acked += 1
                    t.pending = None
                    continue
                if r < 0.3 and self.known:
                    name = self.rng.choice(self.known)  # overwrite (or re-create) a file of an earlier trial
                else:
                    name = f"t{t.number:02d}/f{n:04d}"
                    n += 1
                    if n == 1:
                        os.makedirs(self.root / f"t{t.number:02d}", exist_ok=True)
                data = self.rng.randbytes(self.size())
                digest = sha256(data)
                t.pending = Pending(name, digest)
                fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view[:WRITE_CHUNK]):]
                    if self.rng.random() < 0.5:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                # close (and fsync) returned: acknowledged.
                t.acked[name] = digest
                t.versions_acked += 1
                t.pending = None
                if name not in self.known:
                    self.known.append(name)
        except OSError as exc:  # the daemon is gone: ENOTCONN (or ECONNABORTED) from the next call
            t.error = exc


@pytest.mark.timeout(600)
def test_kill_9_during_writes_loses_nothing_acknowledged(seaweed, mounter, tmp_path: Path) -> None:
    seed = int(os.environ.get("CACHEFS_WB_CRASH_SEED", str(int.from_bytes(os.urandom(4), "big"))))
    print(f"\ncrash test: seed {seed}, {TRIALS} trials (replay: CACHEFS_WB_CRASH_SEED={seed})")
    rng = random.Random(seed)
    bucket = f"wbcrash-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    client = seaweed.client()
    env = s3env(seaweed)
    source = f"s3://{bucket}/{PREFIX.rstrip('/')}"
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    m = mounter.mount(source, env=env, cache_dir=cache, mountpoint=mnt)

    state: dict[str, str] = {}  # name -> sha256 in the bucket after the last verified trial
    digests: dict[tuple[str, str], str] = {}  # (key, etag) -> sha256, so unchanged objects are read once
    totals = {"acked_versions": 0, "acked_unlinks": 0, "pending_landed": 0, "pending_not_landed": 0,
              "checked_objects": 0}
    ways: dict[str, int] = {}
    started = time.monotonic()

    for number in range(1, TRIALS + 1):
        trial = Trial(number)
        with_flush = number % 3 == 0
        writer = Writer(m.path, trial, random.Random(rng.getrandbits(64)), sorted(state))
        writer.start()
        flusher = None
        if with_flush:
            time.sleep(rng.uniform(0.1, 0.5))
            flusher = subprocess.Popen([*CLI, "flush", str(m.path), "--timeout", "60"], env={**os.environ, **env},
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(*KILL_DELAY_S))
        kill9(m)
        writer.join(WRITER_JOIN_S)
        assert not writer.is_alive(), f"trial {number}: the writer still blocks {WRITER_JOIN_S} s after the kill"
        if flusher is not None:
            try:
                flusher.wait(60)
            except subprocess.TimeoutExpired:
                flusher.kill()
                flusher.wait(10)
                pytest.fail(f"trial {number}: cachefs flush still runs 60 s after its daemon was killed")
        t_killed = time.monotonic()
        journal_at_kill = _journal(cache)  # what the dead daemon left for the next one to replay
        way = clear_dead_mount(m)
        ways[way] = ways.get(way, 0) + 1
        t_cleared = time.monotonic()
        m = mounter.mount(source, env=env, cache_dir=cache, mountpoint=mnt)
        t_mounted = time.monotonic()
        flush_ok(m)
        t_flushed = time.monotonic()

        # What the bucket holds now.
        bucket_now: dict[str, str] = {}
        for key, meta in list_keys(client, bucket, PREFIX).items():
            if key.endswith("/"):
                continue  # directory markers (the t<NN>/ directories)
            name = key[len(PREFIX):]
            cache_key = (key, meta["etag"])
            if cache_key not in digests:
                digests[cache_key] = sha256(get_bytes(client, bucket, key))
            bucket_now[name] = digests[cache_key]
        totals["checked_objects"] += len(bucket_now)

        expected: dict[str, str | None] = {**state, **trial.acked}
        pending = trial.pending
        losses: list[str] = []
        for name in sorted(set(expected) | set(bucket_now)):
            want, got = expected.get(name), bucket_now.get(name)
            allowed = {want}
            if pending is not None and pending.name == name:
                allowed.add(pending.sha)
            if got in allowed:
                continue
            if name in trial.acked and trial.acked[name] is not None:
                kind = "LOST: acknowledged version missing" if got is None else "LOST: acknowledged version replaced"
            elif name in trial.acked:
                kind = "acknowledged unlink undone"
            elif got is not None and want is None:
                kind = "object that was never acknowledged nor in flight"
            else:
                kind = "earlier verified state changed"
            losses.append(f"{name}: {kind} (expected {_short(want)}, allowed {sorted(map(_short, allowed))}, "
                          f"bucket {_short(got)})")
        evidence = ""
        if losses:
            lost = [problem.partition(":")[0] for problem in losses]
            evidence = _keep_evidence(seed, number, cache, client, bucket, journal_at_kill, lost)
        assert not losses, (
            f"seed {seed}, trial {number} ({'with' if with_flush else 'without'} a concurrent flush): "
            f"{len(losses)} problems:\n  " + "\n  ".join(losses[:30]) + "\n" + evidence
        )
        if pending is not None:
            landed = bucket_now.get(pending.name) == pending.sha and pending.sha != expected.get(pending.name)
            totals["pending_landed" if landed else "pending_not_landed"] += 1

        # The remounted mount serves what the bucket holds, for every name this trial touched.
        touched = set(trial.acked) | ({pending.name} if pending else set())
        for name in sorted(touched):
            path = m.path / name
            served = bounded(lambda p=path: sha256(p.read_bytes()) if p.exists() else None, 60, f"reading {name}")
            assert served == bucket_now.get(name), (
                f"seed {seed}, trial {number}: the mount serves {_short(served)} for {name}, "
                f"the bucket holds {_short(bucket_now.get(name))}"
            )

        totals["acked_versions"] += trial.versions_acked
        totals["acked_unlinks"] += trial.unlinks_acked
        state = bucket_now
        print(f"  trial {number:2d}: {trial.versions_acked:3d} versions and {trial.unlinks_acked} unlinks acknowledged, "
              f"killed {'during a flush' if with_flush else 'while writing'} "
              f"(writer stopped by {_errname(trial.error)}); {len(bucket_now)} objects verified; "
              f"clear {t_cleared - t_killed:.1f} s, remount {t_mounted - t_cleared:.1f} s, "
              f"flush {t_flushed - t_mounted:.1f} s, verify {time.monotonic() - t_flushed:.1f} s")

    assert totals["acked_versions"] > TRIALS, "the workload acknowledged almost nothing: the test proved nothing"
    print(f"crash test: {TRIALS} kill -9 trials, {totals['acked_versions']} acknowledged versions and "
          f"{totals['acked_unlinks']} acknowledged unlinks, 0 lost, 0 corrupt; in-flight operations "
          f"completed {totals['pending_landed']}, not {totals['pending_not_landed']}; "
          f"{totals['checked_objects']} object checks; dead mounts cleared by {ways}; "
          f"{time.monotonic() - started:.0f} s")


def _journal(cache: Path) -> dict[str, str]:
    """The journal records under ``cache`` now: key -> "op seq=N" (unreadable ones by file name)."""
    found: dict[str, str] = {}
    for path in sorted(cache.glob(f"*/staging/records/*{RECORD_SUFFIX}")):
        try:
            record = decode_record(path.read_bytes())
        except (OSError, ValueError, TypeError) as exc:
            found[path.name] = f"unreadable: {exc}"
            continue
        found[record.key] = f"{record.op} seq={record.seq} size={record.size}"
    return found


def _keep_evidence(seed: int, number: int, cache: Path, client: Any, bucket: str,
                   journal_at_kill: dict[str, str], lost: list[str]) -> str:
    """On a loss, keep what explains it: the daemons' logs, the journal as the killed daemon left it
    and as it is now, the staging directory, the bucket listing (markers included) and whether each
    name answers a HEAD (a listing that leaves keys out is not a loss). Copied to a
    directory that outlives the test's tmp_path; returns a summary for the failure message."""
    keep = Path(tempfile.gettempdir()) / f"cachefs-wbcrash-seed{seed}-trial{number}-{uuid.uuid4().hex[:6]}"
    keep.mkdir(parents=True)
    for log in cache.glob("*/daemon.log*"):
        shutil.copy(log, keep / log.name)
    journal_now = _journal(cache)
    (keep / "journal-at-kill.txt").write_text("".join(f"{k} {v}\n" for k, v in sorted(journal_at_kill.items())))
    (keep / "journal-after-flush.txt").write_text("".join(f"{k} {v}\n" for k, v in sorted(journal_now.items())))
    listing = [f"{p.relative_to(cache)} {p.stat().st_size}" for p in sorted(cache.glob("*/staging/**/*")) if p.is_file()]
    (keep / "staging-files.txt").write_text("\n".join(listing) + "\n")
    keys = list_keys(client, bucket, PREFIX)
    (keep / "bucket.txt").write_text("".join(f"{k} {m.get('size')} {m.get('etag')}\n" for k, m in sorted(keys.items())))
    at_kill = [name for name in lost if name in journal_at_kill or PREFIX + name in journal_at_kill]
    directories = sorted({name.rpartition("/")[0] + "/" for name in lost if "/" in name})
    markers = ", ".join(f"{d} {journal_at_kill.get(d) or journal_at_kill.get(PREFIX + d) or 'no record'}"
                        for d in directories[:5])
    # A HEAD per name, independent of the listing: a key that answers is stored, only not listed.
    stored = []
    for name in lost:
        try:
            client.head_object(Bucket=bucket, Key=PREFIX + name)
            stored.append(name)
        except Exception:  # noqa: BLE001 - evidence only: any error counts as not found
            pass
    replay_lines = []
    for log in sorted(keep.glob("daemon.log*")):
        replay_lines += [line.strip() for line in log.read_text(errors="replace").splitlines()
                         if "replayed the journal" in line or "quarantin" in line or "ERROR" in line]
    return (f"evidence kept in {keep}: of {len(lost)} names with a problem, {len(stored)} answer a HEAD "
            f"(stored, not listed), {len(at_kill)} had a journal record after the kill; their directories' markers at the kill: {markers}; {len(journal_now)} records left "
            f"after the flush; {len(keys)} keys listed; last log lines about replay and errors:\n    "
            + "\n    ".join(replay_lines[-8:]))


def _errname(exc: BaseException | None) -> str:
    if exc is None:
        return "nothing"
    return errno_name(exc.errno) if isinstance(exc, OSError) and exc.errno else type(exc).__name__


def _short(digest: str | None) -> str:
    return "absent" if digest is None else digest[:12]
