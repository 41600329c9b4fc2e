"""Which daemon thread a cold large read keeps busiest, for two (or more) source trees side by side.

``make bench``'s "busiest thread" of a cold read is one number, and on a shared 2-core machine it
moves more from one round to the next than a change to the FUSE layer moves it. This uploads one
object (``--size-mib``, 1 GiB by default) to a SeaweedFS on 127.0.0.1, then, round after round,
mounts it fresh with each tree in turn (a tree: a directory holding ``cachefs`` and ``tiering``,
whose daemon runs through ``PYTHONPATH``; ``NAME=`` alone is this checkout), reads it once
sequentially in 1 MiB calls as ``make bench`` does (``benchmarks.common.read_seconds``: the first
open's lookups included), and charges each thread of the daemon its utime and stime over the read
(``/proc/PID/task/*/stat``), named by ``py-spy dump`` (the kernel's thread names are all
``python``). The order of the trees alternates from one round to the next. Every round is printed
as a JSON line (MiB/s, the daemon's CPU-s/GiB, each busy thread's CPU-s/GiB as total, user,
system, the load average), then the medians of each tree::

    mkdir /tmp/before && git archive main cachefs tiering | tar -x -C /tmp/before
    .venv/bin/python -m benchmarks.cold_threads_ab --tree before=/tmp/before --tree after= --rounds 5

docs/dataplane.md, "The reply copy on four writers", has its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import read_seconds  # noqa: E402
from benchmarks.dataplane import GiB, MiB, cpu_s, loadavg  # noqa: E402
from cachefs.client import call  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
# Threads shown per round: the loop, the readers, the writers and the busiest GET workers.
SHOWN = 8
MOUNT_TIMEOUT_S = 120


def threads_user_system(pid: int) -> dict[str, tuple[float, float]]:
    """utime and stime of each thread of ``pid``, in seconds, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def thread_names(pid: int) -> dict[str, str]:
    """Python's name of each thread of ``pid``, by thread id (``py-spy dump``)."""
    spy = str(Path(sys.executable).parent / "py-spy")
    text = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
    return {m.group(1): m.group(2) for m in re.finditer(r'Thread (\d+) \([^)]*\): "([^"]+)"', text)}


def one_read(name: str, tree: str, env: dict[str, str], work: Path, size: int, extra: list[str]) -> dict[str, Any]:
    mnt, cache = work / "mnt", work / "cache"
    mnt.mkdir(exist_ok=True)
    run_env = {**os.environ, **env}
    if tree:
        run_env["PYTHONPATH"] = tree
    cli = [sys.executable, "-m", "cachefs"]
    # (Run from ``work``: ``python -m`` puts its working directory first on the path, before PYTHONPATH.)
    subprocess.run([*cli, "mount", "s3://bench", str(mnt), "--cache-dir", str(cache), "--log-level", "WARNING",
                    *extra], check=True, env=run_env, timeout=MOUNT_TIMEOUT_S, stdout=subprocess.DEVNULL, cwd=work)
    pid = int(call(mnt, "/info")["pid"])
    try:
        load = loadavg()
        before, before_all = threads_user_system(pid), cpu_s(f"/proc/{pid}/stat")
        began = time.perf_counter()
        got, _ = read_seconds(mnt / "big.bin")
        elapsed = time.perf_counter() - began
        after, after_all = threads_user_system(pid), cpu_s(f"/proc/{pid}/stat")
        if got != size:
            raise RuntimeError(f"read {got} bytes of {size}")
        names = thread_names(pid)
        gib = size / GiB
        per = {}
        for tid, (user, system) in after.items():
            user0, system0 = before.get(tid, (0.0, 0.0))
            per[f"{tid}:{names.get(tid, '?')}"] = [round((user + system - user0 - system0) / gib, 3),
                                                   round((user - user0) / gib, 3), round((system - system0) / gib, 3)]
        ranked = sorted(per.items(), key=lambda kv: -kv[1][0])
        return {"tree": name, "load": load, "MiB/s": round(size / elapsed / MiB, 1),
                "daemon CPU-s/GiB": round((after_all - before_all) / gib, 3), "busiest": ranked[0],
                "threads (total, user, system CPU-s/GiB)": ranked[:SHOWN]}
    finally:
        subprocess.run([*cli, "unmount", str(mnt)], env=run_env, timeout=MOUNT_TIMEOUT_S, stdout=subprocess.DEVNULL,
                       cwd=work)
        shutil.rmtree(cache, ignore_errors=True)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                        help="a source tree to mount with (PATH empty: this checkout); repeat")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--mount-args", default="--ram-cache 1GiB", help="more `cachefs mount` options, one string")
    args = parser.parse_args()
    trees = [tuple(t.split("=", 1)) if "=" in t else (t, "") for t in args.tree]
    size = args.size_mib * MiB
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cachefs-cold-threads-") as tmp, SeaweedS3() as server:
        env = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
        server.make_bucket("bench")
        server.put("bench", "big.bin", os.urandom(size))
        for number in range(args.rounds):
            for name, tree in (trees if number % 2 == 0 else trees[::-1]):
                result = one_read(name, tree, env, Path(tmp), size, args.mount_args.split())
                result["round"] = number
                print(json.dumps(result), flush=True)
                rounds.append(result)
    for name, _ in trees:
        mine = [r for r in rounds if r["tree"] == name]
        print(f"{name}: median MiB/s {median([r['MiB/s'] for r in mine])}, daemon CPU-s/GiB "
              f"{median([r['daemon CPU-s/GiB'] for r in mine])}, busiest thread CPU-s/GiB "
              f"{median([r['busiest'][1][0] for r in mine])}")


if __name__ == "__main__":
    main()
