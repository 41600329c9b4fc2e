"""What a cold small file costs, and who pays it: the daemon (in all and its busiest thread), the
S3 server and the reader, per file; not announced and announced, one reader, one shuffled order.

One SeaweedFS on 127.0.0.1, ``--files`` objects of ``--file-kib`` KiB, a fresh mount and cache dir
for each pass (``--ram-cache``/``--disk-cache`` as ``make bench`` mounts), the directory listed
before the timed reads. Each pass reads every file whole, once, in the same shuffled order, with
one reader (this process's main thread):

  plain        the order not announced: each file is one cold open/read/close
  announced    the order announced first (``cachefs.loader.announce``, timed too)

and reports files/s, and per file in ms: the daemon's CPU (its process tree, ``benchmarks.procstat``),
its busiest thread's, every daemon thread's above 1% of the total (named by ``py-spy dump``: Python
does not name its OS threads), the user and system CPU of the loop thread and of each thread group
(``cachefs-curl``: libcurl's thread, the small GETs and their disk-tier writes; ``cachefs-get``: the
GET workers of large blocks; ``asyncio``: the disk-tier calls), the server's (``weed``), this
process's (the reader's), how busy the whole machine was (``/proc/stat``), the announced order's hits
and stalls, and the garbage collections of each generation the daemon ran in the pass and their CPU
(``process`` in ``/stats``). Beside them the raw parallel small GET of the same run (the engine's own store path,
16 in flight, no file system): files/s, this process's CPU and the server's per file (the server's
includes the HEADs made before the timed GETs).

``--ram-reread``: after each pass the same files again from the RAM tier, each file's pages dropped
first, so every read reaches the daemon: what the reader's path costs with no fetch behind it.
``--mount-args "..."``: more mount options (``--max-fetches 4``, say).
``--perf DIR``: perf records kernel and user stacks of every daemon thread (``DIR/<pass>.data``,
with ``DIR/<pass>.threads.json`` naming the thread ids, for ``perf report --tid``).
``--profile DIR`` [``--gil``]: py-spy samples the daemon's threads (only the one holding the GIL
with ``--gil``; 200 Hz, raw format, not pausing the daemon) during each pass into ``DIR/<pass>.txt``;
``python -m benchmarks.dataplane --top FILE [--thread NAME]`` prints its heaviest frames (idle
waits included: a thread blocked in ``select`` or a queue shows there without ``--gil``).

docs/dataplane.md ("Small files, profiled") has the figures and what they mean.

Run: .venv/bin/python -m benchmarks.coldfiles [--files 2000] [--passes plain,announced] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import procstat  # noqa: E402
from benchmarks.common import raw_parallel_get_cost  # noqa: E402
from benchmarks.epochs import epoch  # noqa: E402
from cachefs.client import call  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BUCKET = "bench"
DIR = "small"
# The mount's tiers, as benchmarks.bench gives them (a RAM tier and a disk tier that hold the set).
RAM_CACHE = "1GiB"
DISK_CACHE = "2GiB"


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name of the daemon's threads (``py-spy dump``: Python does
    not name its OS threads)."""
    dump = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--nonblocking", "-p", str(pid)],
                          capture_output=True, text=True, timeout=60).stdout
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \(\w+\): "(.*)"', dump, re.M)}


def user_system_s(pid: int, tid: int | None = None) -> tuple[float, float]:
    """User and system CPU seconds of one thread (by default the daemon's main thread: the event loop
    and the FUSE session); (0, 0) for a thread that is gone."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid or pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / procstat.CLK_TCK, int(fields[12]) / procstat.CLK_TCK


def group_user_system(pid: int, names: dict[int, str]) -> dict[str, tuple[float, float]]:
    """User and system CPU seconds by thread group (the name without its number: ``cachefs-get``,
    ``asyncio``, ``MainThread``)."""
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        group = names.get(int(tid), "?").rstrip("0123456789").rstrip("_")
        u, s = user_system_s(pid, int(tid))
        pu, ps = out.get(group, (0.0, 0.0))
        out[group] = (pu + u, ps + s)
    return out


def ram_reread(mnt: Path, pid: int, order: list[str], expected: int) -> dict[str, float]:
    """The same files again from the RAM tier, the page cache of each dropped first: what the
    reader's own path through FUSE costs, with no fetch behind it."""
    paths = [mnt / DIR / k for k in order]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    meter = procstat.SpanMeter(pid)
    rate = epoch(mnt, [f"{DIR}/{k}" for k in order], 1, announce=False, expected_bytes=expected)
    span = meter.stop()
    return {"files/s": round(rate, 1), "daemon ms/file": round(1000 * span.cpu_s / len(order), 3),
            "busiest thread ms/file": round(1000 * span.busiest_thread_s / len(order), 3)}


def start_recorders(args: argparse.Namespace, pid: int, name: str) -> list[subprocess.Popen[bytes]]:
    """py-spy (``--profile``) and perf (``--perf``) recording the daemon ``pid`` into ``<dir>/<name>.*``."""
    commands = []
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        commands.append([str(Path(sys.executable).parent / "py-spy"), "record", "-r", "200", "--threads",
                         "--nonblocking", *(["--gil"] if args.gil else []), "-f", "raw",
                         "-o", str(args.profile / f"{name}.txt"), "-p", str(pid)])
    if args.perf:
        args.perf.mkdir(parents=True, exist_ok=True)
        commands.append(["perf", "record", "-q", "-g", "-p", str(pid), "-o", str(args.perf / f"{name}.data")])
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    if procs:
        time.sleep(1.0)  # both attach before the timed span starts
    return procs


def stop_recorders(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGINT (both write their file on it), then wait; bounded."""
    while procs:
        proc = procs.pop()
        if proc.poll() is None:
            proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def one_pass(server: SeaweedS3, work: Path, name: str, order: list[str], announce: bool, args: argparse.Namespace,
             expected: int) -> dict[str, object]:
    mnt, cache = work / f"mnt-{name}", work / f"cache-{name}"
    mnt.mkdir()
    exe = str(Path(sys.executable).parent / "cachefs")
    env = {**os.environ, **server.env()}
    subprocess.run([exe, "mount", f"s3://{BUCKET}", str(mnt), "--endpoint-url", server.endpoint_url,
                    "--cache-dir", str(cache), "--ram-cache", args.ram_cache, "--disk-cache", args.disk_cache,
                    "--log-level", "WARNING", "--log-file", str(work / f"{name}.log"), *args.mount_args.split()],
                   check=True, env=env, timeout=120)
    recorders: list[subprocess.Popen[bytes]] = []
    try:
        pid = int(call(mnt, "/info")["pid"])
        os.listdir(mnt / DIR)
        recorders = start_recorders(args, pid, name)
        names = thread_names(pid)
        before_threads = procstat.thread_cpu(pid)
        loop_before = user_system_s(pid)
        groups_before = group_user_system(pid, names)
        heap = call(mnt, "/stats").get("process")
        meter = procstat.SpanMeter(pid)
        server_cpu = procstat.process_cpu_s(server.pid)
        own = time.process_time()
        load = os.getloadavg()[0]
        busy = procstat.machine_busy_ticks()
        rate = epoch(mnt, [f"{DIR}/{k}" for k in order], 1, announce=announce, expected_bytes=expected)
        busy_after = procstat.machine_busy_ticks()
        own = time.process_time() - own
        server_cpu = procstat.process_cpu_s(server.pid) - server_cpu
        after_threads = procstat.thread_cpu(pid)
        loop_after = user_system_s(pid)
        stats = call(mnt, "/stats")
        span = meter.stop()
        stop_recorders(recorders)
        names.update(thread_names(pid))
        groups_after = group_user_system(pid, names)
        if args.perf:  # perf names every thread "python3": the Python names, by thread id, beside its data
            (args.perf / f"{name}.threads.json").write_text(json.dumps(names))
        n = len(order)
        per_thread: dict[str, float] = {}
        for (p, tid), cpu in after_threads.items():
            label = names.get(tid, str(tid))
            per_thread[label] = per_thread.get(label, 0.0) + cpu - before_threads.get((p, tid), 0.0)
        total = span.cpu_s
        ram = ram_reread(mnt, pid, order, expected) if args.ram_reread else None
        return {
            "files/s": round(rate, 1),
            "loadavg": round(load, 2),
            "daemon ms/file": round(1000 * total / n, 3),
            "busiest thread ms/file": round(1000 * span.busiest_thread_s / n, 3),
            "threads ms/file (by name)": {k: round(1000 * v / n, 3) for k, v in
                                          sorted(per_thread.items(), key=lambda kv: -kv[1]) if v > 0.01 * total},
            "server ms/file": round(1000 * server_cpu / n, 3),
            "reader ms/file": round(1000 * own / n, 3),
            "machine busy": round((busy_after[0] - busy[0]) / max(1, busy_after[1] - busy[1]), 3),
            "loop user/system ms/file": [round(1000 * (loop_after[i] - loop_before[i]) / n, 3) for i in (0, 1)],
            "thread groups user/system ms/file": {
                g: [round(1000 * (u - groups_before.get(g, (0.0, 0.0))[0]) / n, 3),
                    round(1000 * (s - groups_before.get(g, (0.0, 0.0))[1]) / n, 3)]
                for g, (u, s) in groups_after.items()},
            "store GETs": stats["object_store"]["get_requests"],
            "announced hits/stalls": [stats["announce"]["order_hits"], stats["announce"]["stalls"]],
            # Collections per generation in the pass, and their CPU per file (cachefs.daemon.heap).
            **({} if heap is None else {
                "gc frozen objects": heap["gc_frozen_objects"],
                "gc collections": [a - b for a, b in zip(stats["process"]["gc_collections"], heap["gc_collections"])],
                "gc ms/file": [round(1000 * (a - b) / n, 4) for a, b in zip(stats["process"]["gc_cpu_s"],
                                                                            heap["gc_cpu_s"])]}),
            **({"RAM re-read": ram} if ram else {}),
        }
    finally:
        stop_recorders(recorders)
        subprocess.run([exe, "unmount", str(mnt)], env=env, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kib", type=int, default=100)
    parser.add_argument("--passes", default="plain,announced")
    parser.add_argument("--repeat", type=int, default=1, help="run the passes this many times, alternating")
    parser.add_argument("--ram-cache", default=RAM_CACHE)
    parser.add_argument("--disk-cache", default=DISK_CACHE)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--ram-reread", action="store_true", help="after each pass, the files again from the RAM tier")
    parser.add_argument("--mount-args", default="", help="more options for cachefs mount (one string)")
    parser.add_argument("--perf", type=Path, help="perf record -g of the daemon during each pass, into DIR/<pass>.data")
    parser.add_argument("--gil", action="store_true", help="with --profile: only the thread holding the GIL")
    args = parser.parse_args()
    size = args.file_kib * KiB
    keys = [f"f{i:05d}.jpg" for i in range(args.files)]
    order = keys[:]
    random.Random(15).shuffle(order)
    out: dict[str, object] = {"files": args.files, "file KiB": args.file_kib, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="cachefs-coldfiles-") as tmp, SeaweedS3() as server:
        server.make_bucket(BUCKET)
        pool = os.urandom(size * 2)
        server.put_many(BUCKET, ((f"{DIR}/{k}", k.encode().ljust(64, b"\0") + pool[i % size: i % size + size - 64])
                                 for i, k in enumerate(keys)))
        server_cpu = procstat.process_cpu_s(server.pid)
        mib_s, cpu, total = asyncio.run(raw_parallel_get_cost(server, BUCKET, DIR + "/", keys, DEFAULT_BLOCK_SIZE))
        server_cpu = procstat.process_cpu_s(server.pid) - server_cpu
        out["raw GET"] = {"files/s": round(mib_s * MiB / size, 1), "client ms/file": round(1000 * cpu / args.files, 3),
                          "server ms/file": round(1000 * server_cpu / args.files, 3)}
        print(json.dumps({"raw GET": out["raw GET"]}), flush=True)
        runs: dict[str, list[dict[str, object]]] = {}
        for r in range(args.repeat):
            for name in args.passes.split(","):
                row = one_pass(server, Path(tmp), f"{name}-{r}", order, name == "announced", args,
                               args.files * size)
                runs.setdefault(name, []).append(row)
                print(json.dumps({name: row}), flush=True)
        out["passes"] = runs
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
