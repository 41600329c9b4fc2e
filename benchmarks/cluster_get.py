"""What a cluster hit costs the engine alone: ``ClusterTier.get`` of 8 MiB frames over SeaweedFS.

A cluster-tier node's cold read (``benchmarks/cluster.py``, ``make bench``'s "cluster-tier node")
also pays for FUSE, the RAM and disk tiers and the reader, and on a loaded 2-core machine its CPU
figure moves by a third between runs of the same code. This measures only the tier's lookups: one
SeaweedFS on 127.0.0.1, ``--blocks`` frames of 8 MiB written once through ``ClusterTier.put``, then
each checkout (``--repo``, repeatable; default this one) reads them all with ``ClusterTier.get``,
``--in-flight`` at once, in a fresh child process, alternating the checkouts round by round. Per
round and checkout: MiB/s and the child's CPU-s/GiB (user + system, all threads: the GET, the frame
check). Each child imports ``tiering`` from its checkout, so two checkouts of
the same frame format compare their read paths (``git worktree add --detach /tmp/main main``).

Run: .venv/bin/python -m benchmarks.cluster_get --repo /tmp/main --repo . --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 1024 * 1024
BLOCK = 8 * MiB
BUCKET = "clusterget"
# A child that has not read 1 GiB in this long on a loaded machine is broken, not slow.
CHILD_TIMEOUT_S = 600.0


async def child(cfg: dict[str, object]) -> dict[str, object]:
    """In a child whose ``sys.path`` starts with its checkout: put (``cfg["put"]``) or get every frame."""
    from tiering.blocks import BlockKey
    from tiering.clusterkey import ClusterKey
    from tiering.objectstore import S3ObjectStore
    from tiering.tiers.cluster import ClusterTier

    store = S3ObjectStore(str(cfg["bucket"]), "c/", endpoint_url=str(cfg["endpoint"]), connect_timeout_s=5.0,
                          read_timeout_s=60.0, environ=dict(cfg["env"]))  # type: ignore[call-overload]
    tier = ClusterTier(store, source_id="s3://source/", block_size=BLOCK,
                       key=ClusterKey(bytes.fromhex(str(cfg["key"]))), timeout_s=60.0)
    blocks = int(cfg["blocks"])  # type: ignore[call-overload]
    keys = [BlockKey("big.bin", '"etag"', i) for i in range(blocks + 1)]
    try:
        if cfg.get("put"):
            data = os.urandom(BLOCK)
            for key in keys:
                if not await tier.put(key, data):
                    raise RuntimeError(f"could not write block {key.index}")
            return {}
        slots = asyncio.Semaphore(int(cfg["in_flight"]))  # type: ignore[call-overload]

        async def one(key: BlockKey) -> None:
            async with slots:
                if await tier.get(key, BLOCK) is None:
                    raise RuntimeError(f"block {key.index} was a miss")

        await one(keys[0])  # the connection and the presigning, outside the clock
        cpu, begin = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(key) for key in keys[1:]))
        elapsed, cpu = time.perf_counter() - begin, time.process_time() - cpu
        return {"mib_s": round(blocks * BLOCK / MiB / elapsed, 1),
                "cpu_s_per_gib": round(cpu / (blocks * BLOCK / 1024 ** 3), 3)}
    finally:
        await tier.close()


def run_child(repo: Path, cfg: dict[str, object]) -> dict[str, object]:
    """``child(cfg)`` in a fresh interpreter that imports ``tiering`` from ``repo``."""
    done = subprocess.run([sys.executable, __file__, "--child", str(repo), json.dumps(cfg)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{repo}: the child failed: {done.stderr.strip()[-800:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # run_child's: this checkout's tiering is not imported yet
        sys.path.insert(0, argv[1])
        print(json.dumps(asyncio.run(child(json.loads(argv[2])))))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_get", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, action="append", help="a checkout to measure (repeatable; default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=64, help="8 MiB frames read per round")
    parser.add_argument("--in-flight", type=int, default=8, help="lookups at once (make bench's raw GET: 8)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.blocks < 1 or args.in_flight < 1:
        parser.error("--rounds, --blocks and --in-flight must be at least 1")
    repos = [r.resolve() for r in (args.repo or [Path(__file__).resolve().parent.parent])]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.s3servers import SeaweedS3

    with SeaweedS3() as server:
        server.make_bucket(BUCKET)
        cfg: dict[str, object] = {"bucket": BUCKET, "endpoint": server.endpoint_url, "env": server.env(),
                                  "key": os.urandom(32).hex(), "blocks": args.blocks, "in_flight": args.in_flight}
        run_child(repos[-1], {**cfg, "put": True})
        results: dict[str, list[dict[str, object]]] = {str(r): [] for r in repos}
        for n in range(args.rounds):
            for repo in repos if n % 2 == 0 else list(reversed(repos)):
                answer = run_child(repo, cfg)
                results[str(repo)].append({**answer, "load": round(os.getloadavg()[0], 2)})
                print(f"round {n + 1} {repo}: {answer} (load {os.getloadavg()[0]:.2f})", flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
