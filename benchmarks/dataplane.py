"""What one cold read costs the daemon, next to a plain threaded GET of the same object, in one run.

Measures, on one SeaweedFS on 127.0.0.1 and one fresh mount (docs/dataplane.md explains the figures):

  limit        boto3 ``get_object`` in ``--threads`` threads, ``--part-mib`` ranges: MB/s and this
               process's CPU-s/GiB (the bytes are received and dropped)
  cold         a sequential read of the object through a fresh mount (1 MiB reads): MB/s, the
               daemon's CPU-s/GiB (utime+stime of /proc/PID/stat), its busiest thread's CPU-s/GiB
               (/proc/PID/task/*/stat), and its peak RSS against the RAM tier
  cold direct  the same for a copy of the object read with O_DIRECT (no page cache of the mount filled)
  small files  ``--files`` objects of ``--file-kib`` read once cold and once warm (after the kernel's
               page cache of the mount is dropped by reopening with a fresh mount... no: by re-reading
               through the same mount with ``direct_io`` off, a warm read needs no FUSE read at all), so
               the warm figure is the daemon CPU per file of an open/read/close that the kernel sends

With ``--profile DIR`` py-spy records the daemon during the cold read (``--threads --gil``: only the thread holding the GIL is sampled, so the counts are Python CPU; raw
format, 200 Hz) into ``DIR/cold.txt``; ``benchmarks/dataplane.py --top DIR/cold.txt`` prints the
heaviest frames and threads of such a file.

Run: .venv/bin/python -m benchmarks.dataplane [--size-mib 256] [--files 200]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import read_seconds  # noqa: E402
from cachefs.client import call  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB
CLI = [sys.executable, "-m", "cachefs"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(stat_path: str) -> float:
    """utime + stime of one /proc stat file, in seconds."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def user_system_s(stat_path: str) -> tuple[float, float]:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of every thread of ``pid``, by ``tid:name``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[f"{tid}:{name}"] = cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            pass
    return out


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[0]


def threaded_get(server: SeaweedS3, bucket: str, key: str, size: int, threads: int, part: int) -> dict[str, float]:
    """boto3 ranged GETs in ``threads`` threads; MB/s and CPU-s/GiB of this process."""
    client = server.make_client()
    etag = client.head_object(Bucket=bucket, Key=key)["ETag"]

    def one(start: int) -> int:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{min(size, start + part) - 1}",
                                 IfMatch=etag)["Body"]
        n = 0
        while chunk := body.read(1 * MiB):
            n += len(chunk)
        return n

    server_before = cpu_s(f"/proc/{server.pid}/stat") if server.pid else 0.0
    began, cpu = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, range(0, size, part)))
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    server_cpu = (cpu_s(f"/proc/{server.pid}/stat") - server_before) if server.pid else float("nan")
    assert total == size
    return {"MB/s": size / elapsed / 1e6, "CPU-s/GiB": cpu / (size / GiB), "S3 server CPU-s/GiB": server_cpu / (size / GiB)}


class Mount:
    def __init__(self, source: str, mnt: Path, cache: Path, env: dict[str, str], *extra: str) -> None:
        self.mnt, self.env = mnt, env
        mnt.mkdir(parents=True, exist_ok=True)
        subprocess.run([*CLI, "mount", source, str(mnt), "--cache-dir", str(cache), *extra], check=True,
                       env={**os.environ, **env}, timeout=120)
        self.pid = int(call(mnt, "/info")["pid"])

    def close(self) -> None:
        subprocess.run([*CLI, "unmount", str(self.mnt)], env={**os.environ, **self.env}, timeout=120)


def counters(mnt: Path) -> dict[str, int]:
    """The daemon's FUSE reads and store requests so far."""
    stats = call(mnt, "/stats")
    store = stats["object_store"]
    return {"fuse reads": stats["filesystem"]["reads"], "GET": store["get_requests"],
            "HEAD": store["head_requests"], "LIST": store["list_requests"]}


def measured(pid: int, work: "callable", nbytes: int, mnt: Path, others: dict[str, int] | None = None) -> dict[str, object]:
    """Time ``work`` and charge it the daemon's CPU; ``others`` (name -> pid: the S3 server, this
    process, which is the reader) are charged too, so that the whole machine's CPU per GiB shows."""
    others = others or {}
    before_o = {name: cpu_s(f"/proc/{p}/stat") for name, p in others.items()}
    before_c = counters(mnt)
    before_main = user_system_s(f"/proc/{pid}/task/{pid}/stat")
    before_t, before = threads_cpu(pid), cpu_s(f"/proc/{pid}/stat")
    began = time.perf_counter()
    work()
    elapsed = time.perf_counter() - began
    after_t, after = threads_cpu(pid), cpu_s(f"/proc/{pid}/stat")
    after_c = counters(mnt)
    after_main = user_system_s(f"/proc/{pid}/task/{pid}/stat")
    others_cpu = {name: (cpu_s(f"/proc/{p}/stat") - before_o[name]) / (nbytes / GiB) for name, p in others.items()}
    per_thread = {t: after_t[t] - before_t.get(t, 0.0) for t in after_t}
    busiest = max(per_thread.items(), key=lambda kv: kv[1])
    gib = nbytes / GiB
    return {
        "MB/s": nbytes / elapsed / 1e6, "seconds": elapsed,
        "CPU-s/GiB": (after - before) / gib, "CPU-s": after - before,
        "busiest thread": busiest[0], "busiest CPU-s/GiB": busiest[1] / gib,
        "requests": {k: after_c[k] - before_c[k] for k in after_c},
        # The loop thread (asyncio and the FUSE session run on the main thread): user and system CPU-s/GiB.
        "loop user/system CPU-s/GiB": [round((after_main[i] - before_main[i]) / (nbytes / GiB), 3) for i in (0, 1)],
        "threads": {t: round(v, 3) for t, v in sorted(per_thread.items(), key=lambda kv: -kv[1]) if v > 0.005},
        "others CPU-s/GiB": {name: round(v, 3) for name, v in others_cpu.items()},
    }


def read_direct(path: Path, chunk: int = 1 * MiB) -> int:
    """Read ``path`` with O_DIRECT (into an aligned buffer), so the kernel's page cache answers nothing."""
    import mmap
    buf = mmap.mmap(-1, chunk)
    n = 0
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while got := os.readv(fd, [buf]):
            n += got
    finally:
        os.close(fd)
    return n


def top(path: Path, n: int = 25, thread_name: str = "") -> None:
    """Print the heaviest leaf frames, inclusive frames and threads of a py-spy raw file (of the
    threads whose name contains ``thread_name``)."""
    leaf: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    thread: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if thread_name not in frames[0]:
            continue
        c = int(count)
        total += c
        thread[frames[0]] += c
        leaf[frames[-1]] += c
        for f in set(frames[1:]):
            incl[f] += c
    print(f"{total} samples")
    for title, counter in (("threads", thread), ("leaf frames", leaf), ("inclusive frames", incl)):
        print(f"-- {title}")
        for name, c in counter.most_common(n):
            print(f"{100 * c / total:5.1f}%  {name}")


@contextlib.contextmanager
def profiled(args: argparse.Namespace, pid: int, phase: str) -> Iterator[None]:
    """py-spy (``--profile DIR``: ``DIR/<phase>.txt``) and perf (``--perf DIR``: ``DIR/<phase>.data``,
    kernel and user stacks of every thread) around one phase."""
    procs = []
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-r", "200",
                                       "--threads", "--gil", "-f", "raw", "-o", str(args.profile / f"{phase}.txt"),
                                       "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if args.perf:
        args.perf.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(["perf", "record", "-q", "-g", "-p", str(pid), "-o",
                                       str(args.perf / f"{phase}.data")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if procs:
        time.sleep(1.0)
    try:
        yield
    finally:
        for proc in procs:
            proc.send_signal(2)
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--file-kib", type=int, default=100)
    parser.add_argument("--ram-cache", default="512MiB")
    parser.add_argument("--disk-cache", default=None, help="the mount's --disk-cache (0: no disk tier); the mount is then read-only")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--perf", type=Path, help="perf record (kernel and user stacks) of each phase into this directory")
    parser.add_argument("--top", type=Path)
    parser.add_argument("--thread", default="", help="with --top: only threads whose name contains this")
    args = parser.parse_args()
    if args.top:
        top(args.top, thread_name=args.thread)
        return
    size = args.size_mib * MiB
    results: dict[str, object] = {"loadavg before": loadavg()}
    with tempfile.TemporaryDirectory(prefix="cachefs-dataplane-") as tmp, SeaweedS3() as server:
        work = Path(tmp)
        env = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
        server.make_bucket("bench")
        data = os.urandom(size)
        server.put("bench", "big/big.bin", data)
        server.put("bench", "big/direct.bin", data)  # the same bytes, read cold by an O_DIRECT reader
        del data
        small = os.urandom(args.file_kib * 1024)
        server.put_many("bench", ((f"small/f{i:05d}", small) for i in range(args.files)))
        results["limit (boto3 threads)"] = threaded_get(server, "bench", "big/big.bin", size, args.threads,
                                                        args.part_mib * MiB)
        results["loadavg cold"] = loadavg()
        extra = ["--disk-cache", args.disk_cache, "--read-only"] if args.disk_cache is not None else []
        mount = Mount("s3://bench", work / "mnt", work / "cache", env, "--ram-cache", args.ram_cache, *extra)
        try:
            with profiled(args, mount.pid, "cold"):
                cold = measured(mount.pid, lambda: read_seconds(mount.mnt / "big" / "big.bin"), size, mount.mnt,
                                {"S3 server": server.pid, "reader": os.getpid()})
            cold["peak RSS MiB"] = rss_mib(mount.pid)
            cold["RAM tier"] = args.ram_cache
            results["cold"] = cold
            results["limit / cold"] = cold["MB/s"] / results["limit (boto3 threads)"]["MB/s"]  # type: ignore[index]
            # The same cold read by a reader that opens with O_DIRECT: every byte still crosses the
            # daemon, but the FUSE reply goes into the reader's buffer instead of new page-cache
            # pages. The difference in the loop's system time is what filling the mount's page cache
            # costs the reply (docs/dataplane.md).
            with profiled(args, mount.pid, "cold-direct"):
                direct = measured(mount.pid, lambda: read_direct(mount.mnt / "big" / "direct.bin"), size, mount.mnt,
                                  {"S3 server": server.pid, "reader": os.getpid()})
            results["cold, O_DIRECT reader"] = {k: direct[k] for k in ("MB/s", "CPU-s/GiB", "busiest thread",
                                                                       "busiest CPU-s/GiB", "requests",
                                                                       "loop user/system CPU-s/GiB",
                                                                       "others CPU-s/GiB")}
            # The same bytes again from the RAM tier, with O_DIRECT so that every read reaches the
            # daemon: what the loop thread spends per GiB only to answer FUSE (dispatch and reply).
            ram = measured(mount.pid, lambda: read_direct(mount.mnt / "big" / "big.bin"), size, mount.mnt)
            results["RAM re-read (O_DIRECT)"] = {k: ram[k] for k in ("MB/s", "CPU-s/GiB", "busiest thread",
                                                                     "busiest CPU-s/GiB", "requests",
                                                                     "loop user/system CPU-s/GiB")}
            names = [mount.mnt / "small" / f"f{i:05d}" for i in range(args.files)]
            os.listdir(mount.mnt / "small")  # the listing: sizes and ETags, before the timed reads

            def read_all() -> None:
                for p in names:
                    with open(p, "rb") as f:
                        f.read()

            nbytes = args.files * len(small)
            with profiled(args, mount.pid, "small-cold"):
                c = measured(mount.pid, read_all, nbytes, mount.mnt)
            results["small cold"] = {"ms CPU/file": 1000 * c["CPU-s"] / args.files,  # type: ignore[operator]
                                     "files/s": args.files / c["seconds"], "requests": c["requests"], "threads": c["threads"]}  # type: ignore[operator]
            with profiled(args, mount.pid, "small-warm"):
                w = measured(mount.pid, read_all, nbytes, mount.mnt)
            results["small warm"] = {"ms CPU/file": 1000 * w["CPU-s"] / args.files,  # type: ignore[operator]
                                     "files/s": args.files / w["seconds"], "requests": w["requests"], "threads": w["threads"]}  # type: ignore[operator]
        finally:
            mount.close()
            shutil.rmtree(work / "cache", ignore_errors=True)
    results["loadavg after"] = loadavg()
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
