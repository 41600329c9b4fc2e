"""Re-reads of files whole on the disk tier: kernel passthrough against the daemon, against local disk.

The limit is the same bytes read from the local disk (the file:// store's own files, page cache
dropped with ``posix_fadvise(DONTNEED)`` before each read). Two mounts of that store share one cache
directory: a writable one (no passthrough: the daemon serves every READ from the disk tier, after a
remount so the RAM tier is empty) and a read-only one (passthrough where the kernel and root allow:
the kernel reads the whole files; their pages are dropped before each epoch). Each row gives MB/s,
the daemon's CPU-seconds for the epoch (``/proc/<pid>/stat``), and the READ requests and
passthrough opens the daemon counted. Figures from one run are comparable with each other only.
Run as root: .venv/bin/python -m benchmarks.passthrough [--dir /tmp/ptb] [--big-mib 1024] [--files 2000]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time

MiB = 1024 * 1024
SMALL_FILE_BYTES = 100 * 1024
# Bound on waiting for the background assembly of the big file's whole file.
ASSEMBLY_WAIT_S = 300


def cli(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "cachefs", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"cachefs {args[0]} failed: {result.stderr.strip()}")
    return result.stdout


def drop(path: str) -> None:
    """Drop the file's pages from the page cache: written back first (DONTNEED leaves dirty pages,
    and a whole file was just written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while chunk := os.read(fd, MiB):
            total += len(chunk)
    finally:
        os.close(fd)
    return total


def daemon_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def epoch(root: str, cache: str, names: list[str]) -> tuple[float, int]:
    for path in glob.glob(f"{cache}/*/whole/*/*"):
        drop(path)
    start = time.perf_counter()
    total = sum(read_all(os.path.join(root, name)) for name in names)
    return time.perf_counter() - start, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/cachefs-passthrough-bench")
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=2000)
    args = parser.parse_args()
    store, mnt, cache = (os.path.join(args.dir, name) for name in ("store", "mnt", "cache"))
    os.makedirs(os.path.join(store, "small"), exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    big = os.path.join(store, "big.bin")
    if not os.path.exists(big) or os.path.getsize(big) != args.big_mib * MiB:
        with open(big, "wb") as fh:
            for _ in range(args.big_mib):
                fh.write(os.urandom(MiB))
    rng = random.Random(1)
    small = [f"small/{i:05d}" for i in range(args.files)]
    for name in small:
        if not os.path.exists(os.path.join(store, name)):
            with open(os.path.join(store, name), "wb") as fh:
                fh.write(rng.randbytes(SMALL_FILE_BYTES))
    sets = {"1 GiB file" if args.big_mib == 1024 else f"{args.big_mib} MiB file": ["big.bin"],
            f"epoch of {args.files} x 100 KiB": small}
    rows: dict[str, dict[str, str]] = {label: {} for label in sets}
    for label, names in sets.items():
        for name in names:
            drop(os.path.join(store, name))
        seconds, total = epoch(store, cache, names)
        rows[label]["local disk"] = f"{total / seconds / 1e6:,.0f} MB/s"

    def mount(*extra: str) -> int:
        cli("mount", f"file://{store}", mnt, "--cache-dir", cache, "--disk-cache", f"{2 * args.big_mib + 1024}MiB",
            *extra)
        from cachefs.client import call
        return int(call(mnt, "/info")["pid"])

    for mode, extra in (("daemon (disk tier)", ()), ("passthrough", ("--read-only",))):
        if not extra:  # blocks to the disk tier, then a remount: the RAM tier is empty
            mount(*extra)
            for names in sets.values():
                epoch(mnt, cache, names)
            cli("unmount", mnt)
        pid = mount(*extra)
        try:
            for label, names in sets.items():
                if extra:  # cold reads, then the opens that assemble the whole files
                    epoch(mnt, cache, names)
                    deadline = time.monotonic() + ASSEMBLY_WAIT_S
                    while json.loads(cli("stats", mnt, "--json"))["fuse"]["whole_files"]["files"] < len(names):
                        if time.monotonic() > deadline:
                            raise SystemExit("the whole files were not assembled in time")
                        for name in names:
                            with open(os.path.join(mnt, name), "rb"):
                                pass
                        time.sleep(0.2)
                before = json.loads(cli("stats", mnt, "--json"))
                cpu = daemon_cpu_s(pid)
                seconds, total = epoch(mnt, cache, names)
                cpu = daemon_cpu_s(pid) - cpu
                after = json.loads(cli("stats", mnt, "--json"))
                reads = after["filesystem"]["reads"] - before["filesystem"]["reads"]
                opens = after["fuse"]["passthrough_opens"] - before["fuse"]["passthrough_opens"]
                rows[label][mode] = (f"{total / seconds / 1e6:,.0f} MB/s, {len(names) / seconds:,.0f} files/s, "
                                     f"daemon {cpu:.2f} CPU-s, {reads} READs, {opens} passthrough opens")
        finally:
            cli("unmount", mnt)
    print(f"load: {os.getloadavg()}")
    for label, row in rows.items():
        print(label)
        for mode, text in row.items():
            print(f"  {mode}: {text}")


if __name__ == "__main__":
    main()
