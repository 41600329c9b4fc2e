"""Shuffled small-file epochs with and without the read order announced (``cachefs.loader``).

One run, one machine, one SeaweedFS on 127.0.0.1, ``--files`` objects of ``--file-kib`` KiB:

  raw GET        every file fetched once, 16 GETs in flight (the mount's fetch slots), bytes thrown
                 away: the parallel small-GET rate, the limit for a cold epoch (files/s)
  cold epoch     a fresh mount and cache dir, page cache dropped, the files read whole in a shuffled
                 order by 1 and by ``--readers`` threads (as DataLoader workers do), without and with
                 the order announced first (the announce call, resolution included, is timed too)
  epochs         (page cache dropped before each) a dataset twice the disk tier (RAM tier 8 MiB): ``--epochs`` shuffled epochs, each
                 announced as it starts, against the same epochs not announced (LRU): files found
                 cached when opened (announced: the daemon's order hits; LRU: files minus GETs, one
                 GET per missed file) and GETs per epoch
  daemon CPU     CPU milliseconds the daemon spent per file in each cold epoch (/proc/PID/stat):
                 a cost that holds across machines better than a rate

Run: .venv/bin/python -m benchmarks.announce [--files 2000] [--file-kib 100] [--readers 8] [--epochs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import raw_parallel_get  # noqa: E402
from cachefs import loader  # noqa: E402
from cachefs.client import request_json  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
CLI = [sys.executable, "-m", "cachefs"]
BUCKET = "bench"
PREFIX = "ds"
# The epochs experiment: a RAM tier that holds almost nothing, so the disk tier's policy decides.
SMALL_RAM = "8MiB"


def cli(*args: str, env: dict[str, str]) -> None:
    result = subprocess.run([*CLI, *args], env={**os.environ, **env}, timeout=900, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cachefs {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")


def drop_page_cache() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def read_all(path: Path) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def daemon_cpu_s(mnt: Path) -> float:
    """User + system CPU seconds the mount's daemon has used so far."""
    pid = request_json(os.getxattr(mnt, "user.cachefs.control").decode(), "/info")["pid"]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stats(mnt: Path) -> dict:
    return request_json(os.getxattr(mnt, "user.cachefs.control").decode(), "/stats")


class Mounted:
    def __init__(self, work: Path, name: str, env: dict[str, str], *opts: str) -> None:
        self.mnt, self.cache, self.env, self.opts = work / f"mnt-{name}", work / f"cache-{name}", env, opts

    def __enter__(self) -> Path:
        self.mnt.mkdir()
        cli("mount", f"s3://{BUCKET}/{PREFIX}", str(self.mnt), "--cache-dir", str(self.cache), *self.opts, env=self.env)
        return self.mnt

    def __exit__(self, *exc: object) -> None:
        cli("unmount", str(self.mnt), env=self.env)
        shutil.rmtree(self.cache, ignore_errors=True)


def epoch(mnt: Path, keys: list[str], readers: int, announce: bool, stream: str) -> float:
    """Files/s of reading ``keys`` in order with ``readers`` threads (announcing first if asked)."""
    paths = [mnt / k for k in keys]
    begin = time.perf_counter()
    if announce:
        result = loader.announce(mnt, paths, stream=stream)
        assert result.ok, result
    with ThreadPoolExecutor(max_workers=readers) as pool:
        total = sum(pool.map(read_all, paths))
    elapsed = time.perf_counter() - begin
    assert total > 0
    return len(keys) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kib", type=int, default=100)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    size = args.file_kib * KiB
    keys = [f"train/{i:05d}.jpg" for i in range(args.files)]
    out: dict[str, object] = {"files": args.files, "file_bytes": size}
    with tempfile.TemporaryDirectory(prefix="cachefs-announce-") as tmp, SeaweedS3() as server:
        work = Path(tmp)
        env = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
        server.make_bucket(BUCKET)
        pool = os.urandom(size * 2)
        server.put_many(BUCKET, ((f"{PREFIX}/{k}", k.encode().ljust(64, b"\0") + pool[i % size: i % size + size - 64])
                                 for i, k in enumerate(keys)))
        drop_page_cache()
        raw = asyncio.run(raw_parallel_get(server, BUCKET, PREFIX + "/", keys, DEFAULT_BLOCK_SIZE))
        out["raw_get_files_per_s"] = round(raw * MiB / size, 1)
        print(f"raw parallel GET: {out['raw_get_files_per_s']} files/s", flush=True)

        order = keys[:]
        random.Random(1).shuffle(order)
        cold: dict[str, float] = {}
        for readers in (1, args.readers):
            for announce in (False, True):
                name = f"{readers}r-{'announced' if announce else 'plain'}"
                drop_page_cache()
                with Mounted(work, name, env) as mnt:
                    cpu = daemon_cpu_s(mnt)
                    cold[name] = round(epoch(mnt, order, readers, announce, "bench"), 1)
                    cold[name + "-daemon-cpu-ms-per-file"] = round((daemon_cpu_s(mnt) - cpu) * 1000 / args.files, 2)
                    if announce:
                        cold[name + "-stalls"] = stats(mnt)["announce"]["stalls"]
                print(f"cold epoch {name}: {cold[name]} files/s", flush=True)
        out["cold"] = cold

        # A dataset twice the disk tier: the disk tier holds half of it (footprint ~ file size).
        disk = f"{args.files * size // 2 // MiB}MiB"
        epochs: dict[str, list[dict[str, float]]] = {}
        for announce in (False, True):
            name = "announced" if announce else "lru"
            rows = epochs.setdefault(name, [])
            with Mounted(work, f"epochs-{name}", env, "--disk-cache", disk, "--ram-cache", SMALL_RAM) as mnt:
                for e in range(args.epochs):
                    shuffled = keys[:]
                    random.Random(100 + e).shuffle(shuffled)
                    drop_page_cache()  # or the kernel serves the next epoch and the tiers see nothing
                    before = stats(mnt)
                    rate = epoch(mnt, shuffled, args.readers, announce, "epochs")
                    after = stats(mnt)
                    gets = after["object_store"]["get_requests"] - before["object_store"]["get_requests"]
                    if announce:
                        hits = after["announce"]["order_hits"] - before["announce"]["order_hits"]
                    else:
                        hits = args.files - gets
                    rows.append({"epoch": e + 1, "files_per_s": round(rate, 1), "gets": gets,
                                 "cached_at_open": round(hits / args.files, 3)})
                    print(f"epochs {name} {e + 1}: {rows[-1]}", flush=True)
        out["epochs"] = epochs
        out["disk_cache"] = disk
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
