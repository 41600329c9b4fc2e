"""Daemon CPU per FUSE request and per warm 100 KiB re-read, for one or more cachefs installs side by side.

Each install (``--python``: the interpreter of a virtual environment with cachefs in it; run from a
neutral directory so that its own code is imported) mounts the same ``file://`` tree read-only with
long entry and attribute timeouts, and the rounds alternate between installs so that a change of load
on the machine falls on each alike. Figures are the daemon process's CPU (user + system, from
/proc/PID/stat) divided by:

* **per request**: ``getxattr`` of the mount root's control attribute, a request the kernel never
  answers from a cache, so each call is exactly one FUSE request (GETXATTR) and one reply;
* **per warm file**: open, read (100 KiB) and close of each file, after a first pass put every file
  in the page cache and the kernel's dentry and attribute caches; the requests the daemon still sees
  are counted from its ``/stats`` (``opens``, ``reads``, ``flushes``, ``lookups``);
* **per GiB from the RAM tier**: a ``--big-mib`` file read with ``O_DIRECT`` in 1 MiB reads, after a
  first read put it in the RAM tier, so every read is a FUSE READ answered from memory: the cost of
  the request and its 1 MiB reply, no fetch and no disk.

Not part of the test run. Usage::

    python benchmarks/fuse_requests.py --python /work/main/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cachefs.client import call
from cachefs.mounts import CONTROL_XATTR

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def fs_counters(mnt: Path) -> dict[str, int]:
    fs = call(mnt, "/stats")["filesystem"]
    return {name: fs[name] for name in ("lookups", "opens", "reads", "flushes")}


class Mount:
    def __init__(self, python: str, src: Path, work: Path, index: int) -> None:
        self.path = work / f"mnt{index}"
        self.path.mkdir()
        self.cache = work / f"cache{index}"
        result = subprocess.run([python, "-m", "cachefs", "mount", f"file://{src}", str(self.path), "--read-only",
                                 "--cache-dir", str(self.cache), "--attr-ttl", "3600", "--dir-ttl", "3600",
                                 "--ram-cache", "768MiB"],
                                cwd="/", capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise SystemExit(f"mount with {python} failed: {result.stderr}")
        self.pid = int(call(self.path, "/info")["pid"])

    def close(self, python: str) -> None:
        subprocess.run([python, "-m", "cachefs", "unmount", str(self.path)], cwd="/", capture_output=True, timeout=120)


def per_request(m: Mount, calls: int) -> float:
    name = CONTROL_XATTR
    before = cpu_s(m.pid)
    for _ in range(calls):
        os.getxattr(m.path, name)
    return (cpu_s(m.pid) - before) / calls


def read_files(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass


def per_warm_file(m: Mount, files: int, passes: int) -> tuple[float, dict[str, float]]:
    paths = [m.path / "d" / f"f{i:05d}" for i in range(files)]
    before, counters = cpu_s(m.pid), fs_counters(m.path)
    for _ in range(passes):
        read_files(paths)
    spent = cpu_s(m.pid) - before
    after = fs_counters(m.path)
    n = files * passes
    return spent / n, {k: round((after[k] - counters[k]) / n, 3) for k in after}


def read_direct(path: Path, chunk: int = 1 << 20) -> int:
    import mmap

    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total


def per_gib_from_ram(m: Mount) -> float:
    before = cpu_s(m.pid)
    nbytes = read_direct(m.path / "big")
    return (cpu_s(m.pid) - before) / (nbytes / (1 << 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", action="append", required=True, help="an install's interpreter (repeat)")
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kib", type=int, default=100)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-mib", type=int, default=256)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cachefs-fuse-requests-"))
    src = work / "src" / "d"
    src.mkdir(parents=True)
    body = os.urandom(args.file_kib * 1024)
    for i in range(args.files):
        (src / f"f{i:05d}").write_bytes(body)
    with open(work / "src" / "big", "wb") as fh:
        for _ in range(args.big_mib):
            fh.write(os.urandom(1 << 20))
    mounts = []
    try:
        for index, python in enumerate(args.python):
            mounts.append(Mount(python, work / "src", work, index))
        for m in mounts:  # cold pass: page cache, dentries and attributes filled; the big file in RAM
            read_files([m.path / "d" / f"f{i:05d}" for i in range(args.files)])
            read_direct(m.path / "big")
        results: dict[str, dict[str, list[float]]] = {
            p: {"request us": [], "warm file us": [], "RAM re-read CPU-s/GiB": []} for p in args.python}
        requests: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for python, m in zip(args.python, mounts):
                results[python]["request us"].append(1e6 * per_request(m, args.calls))
                cpu, requests[python] = per_warm_file(m, args.files, args.passes)
                results[python]["warm file us"].append(1e6 * cpu)
                results[python]["RAM re-read CPU-s/GiB"].append(per_gib_from_ram(m))
        print(json.dumps({"load": os.getloadavg(), "files": args.files, "file KiB": args.file_kib,
                          "results": {p: {k: sorted(round(v, 3) for v in vs) for k, vs in r.items()}
                                      for p, r in results.items()},
                          "daemon requests per warm file (last round)": requests}, indent=1))
    finally:
        for python, m in zip(args.python, mounts):
            m.close(python)
        time.sleep(0.5)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
