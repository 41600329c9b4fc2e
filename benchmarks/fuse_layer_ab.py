"""``benchmarks/fuse_layer.py``'s per-request figures for two versions of cachefs side by side.

What a change to the FUSE layer's hot path buys is smaller than what the load of a shared machine
moves from one round to the next, so this mounts both versions at once (a read-only mount for the
GETXATTR figure, a writable one for the warm 100 KiB re-read, each version's daemon running its own
source tree through ``PYTHONPATH``) and alternates their rounds, measuring the libfuse null server in
each round too; it prints the medians, the ratios to the null server, the load and every round. A tree
is a directory holding ``cachefs``, ``tiering`` and ``csi_driver``, e.g. the code before a change::

    mkdir /tmp/before && git archive main cachefs tiering csi_driver | tar -x -C /tmp/before
    .venv/bin/python -m benchmarks.fuse_layer_ab --before /tmp/before --threads 2 --rounds 9

(``--after`` defaults to this checkout.) ``benchmarks/fuse_requests.py`` compares two Python
environments (pyfuse3 against this layer); this compares two source trees in one environment, by
``fuse_layer``'s figures and against its null server. docs/dataplane.md, "Per request, profiled",
has its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import fuse_layer  # noqa: E402
from cachefs.mounts import CONTROL_XATTR  # noqa: E402

CHECKOUT = Path(__file__).resolve().parent.parent


def run(trees: dict[str, Path], threads: int, rounds: int, calls: int, files: int, passes: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cachefs-fuse-ab-"))
    opened: list[Any] = []
    saved = os.environ.get("PYTHONPATH")
    cwd = os.getcwd()
    # ``python -m cachefs`` puts its working directory first on sys.path: started from a checkout, its
    # daemon would import that checkout's cachefs whatever PYTHONPATH says.
    os.chdir(work)
    try:
        src = work / "src"
        (src / "d").mkdir(parents=True)
        body = os.urandom(100 * 1024)
        names = [f"d/f{i:05d}" for i in range(files)]
        for name in names:
            (src / name).write_bytes(body)
        binary, unavailable = fuse_layer.build_null_server(work)
        if binary is None:
            raise SystemExit(f"the null server is needed: {unavailable}")
        null = fuse_layer.NullServer(binary, work / "null")
        opened.append(null)
        mounts = {}
        for label, tree in trees.items():
            os.environ["PYTHONPATH"] = str(tree)  # the daemon (python -m cachefs) imports this tree
            # (each daemon's /proc/PID/environ shows which)
            extra = ("--fuse-threads", str(threads))
            ro = fuse_layer.CachefsMount(src, work / f"ro-{label}", work / f"cache-ro-{label}", "--read-only", *extra)
            opened.append(ro)
            rw = fuse_layer.CachefsMount(src, work / f"rw-{label}", work / f"cache-rw-{label}", *extra)
            opened.append(rw)
            mounts[label] = (ro, rw)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        samples: dict[str, list[float]] = {"null_us": []}
        for label in trees:
            samples[f"{label}_request_us"] = []
            samples[f"{label}_writable_file_us"] = []
        order = list(trees)
        for number in range(rounds):  # alternating, so that a change of load falls on each alike
            samples["null_us"].append(fuse_layer.per_request_us(null.pid, null.path, "user.null", calls))
            labels = order if number % 2 == 0 else order[::-1]
            for label in labels:
                ro, _ = mounts[label]
                samples[f"{label}_request_us"].append(fuse_layer.per_request_us(ro.pid, ro.path, CONTROL_XATTR, calls))
            for label in labels:
                _, rw = mounts[label]
                got = fuse_layer.warm_pass([rw.path / n for n in names], passes, rw)
                samples[f"{label}_writable_file_us"].append(got["daemon_us"])
        medians = {k: round(fuse_layer.median(v), 2) for k, v in samples.items()}
        return {"threads": threads, "rounds": rounds, "trees": {k: str(v) for k, v in trees.items()},
                "medians": medians,
                "request_ratio": {label: round(medians[f"{label}_request_us"] / medians["null_us"], 2) for label in trees},
                "loadavg": [round(x, 2) for x in os.getloadavg()],
                "rounds_each": {k: [round(x, 2) for x in v] for k, v in samples.items()}}
    finally:
        for item in reversed(opened):
            item.close()
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuse_layer_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a tree with cachefs, tiering, csi_driver")
    parser.add_argument("--after", type=Path, default=CHECKOUT)
    parser.add_argument("--threads", type=int, default=1, help="--fuse-threads of every mount")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    for tree in (args.before, args.after):
        if not (tree / "cachefs" / "__init__.py").is_file():
            parser.error(f"{tree} holds no cachefs package; give a directory with cachefs, tiering and csi_driver")
    result = run({"before": args.before.resolve(), "after": args.after.resolve()}, args.threads, args.rounds,
                 args.calls, args.files, args.passes)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
