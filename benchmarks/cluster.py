"""What the shared cluster tier is for: N nodes read one dataset, the remote source pays for it once.

One run, one machine, everything on 127.0.0.1:

  source         a SeaweedFS holding ``--objects`` objects (``--size`` in all), reached only through
                 a ``ThrottledProxy`` (benchmarks/throttle.py): ``--delay-ms`` per new connection and
                 per request, ``--rate`` MB/s shared by every connection; a stand-in for a remote region
  cluster store  a second SeaweedFS, not throttled: the in-cluster store of ``--cluster-cache``
  nodes          ``--nodes`` cachefs daemons, each with its own mount point and cache directory, all
                 with the same ``--cluster-cache`` (credentials in a profile file, never argv)

Steps, each node reading every object whole (``--readers`` objects at once, 1 MiB calls, into
memory) and then checking each object's SHA-256 against the one computed at upload:

  1. node 1 reads cold (everything from the source), then its write-behind queue is drained
  2. raw GET: every block object of the cluster store fetched once, ``--readers`` GETs in flight, bytes
     thrown away, by each raw GET engine (benchmarks/engines.py); the fastest is the limit
     away: the cluster store's parallel GET rate, the limit for the next nodes
  3. nodes 2..N read cold, **one after the other** (each node's own figure; not concurrently)
  4. one more fresh node is mounted, the cluster store is stopped, and the node reads everything
     (from the source)

Figures: the bytes all N nodes fetched from the source (``/stats`` object_store.bytes_read, summed;
target <= 1.1x the dataset, where without the tier it is N x), the median cold-read rate of nodes
2..N against the raw GET (target >= 0.8x), and step 4's rate against node 1's (source speed).
The page cache is dropped before every timed read unless ``--keep-page-cache``. Results go to
``--out`` as cluster.json and cluster.md. Every wait is bounded, every mount is unmounted in a
``finally``, and only the servers and daemons this script started are stopped.

Run: make bench-cluster [BENCH_CLUSTER_ARGS="--size 256MiB"]
 or: .venv/bin/python -m benchmarks.cluster --help
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import machine_info  # noqa: E402
from benchmarks import analysis, engines, procstat  # noqa: E402
from benchmarks.common import IO_CHUNK, MiB, drop_page_cache  # noqa: E402
from benchmarks.dataplane import profiled  # noqa: E402
from benchmarks.peers import (  # noqa: E402
    LOG_TAIL_CHARS, UNMOUNT_TIMEOUT_S, clean_env, fuse_unmount, log_tail, wait_pid_gone,
)
from benchmarks.throttle import ThrottledProxy  # noqa: E402
from cachefs.client import call  # noqa: E402
from tests.support.s3servers import REGION, SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402
from tiering.settings import DEFAULT_MAX_CONCURRENT_FETCHES  # noqa: E402
from tiering.units import parse_size  # noqa: E402

SOURCE_BUCKET = "dataset"
CLUSTER_BUCKET = "cluster"
CLUSTER_PREFIX = "cache/"
PROFILE = "cluster"
GiB = 1024 * MiB
# A mount is up within seconds; a minute covers a loaded 2-core machine.
MOUNT_TIMEOUT_S = 60.0
# Reading the whole dataset through the slow link: --size at --rate, with a floor and room for a
# loaded machine (a run that takes longer than this is broken, not slow).
READ_SLACK = 4.0
READ_FLOOR_S = 120.0
# How long node 1's write-behind queue gets to reach the cluster store (loopback, unthrottled).
DRAIN_TIMEOUT_S = 300.0
POLL_S = 0.1
# With the cluster store stopped, a cluster request fails at once (connection refused) or after
# this; the source's fetch timeout stays the default (30 s), far above it.
STOPPED_CLUSTER_TIMEOUT_S = "2"
# The targets of issue 14.
SOURCE_BYTES_TARGET = 1.1
RAW_GET_TARGET = 0.8


def read_whole(path: Path, size: int) -> memoryview:
    """The bytes of one sequential read of ``path`` in 1 MiB calls, into one preallocated buffer.

    The hash is taken after the clock stops: the raw GET it is compared with does not hash either,
    and on a small machine the hash would take CPU from the daemon being measured.
    """
    buf = bytearray(size + 1)  # one byte more: a file longer than expected shows as a wrong length
    view = memoryview(buf)
    n = 0
    with open(path, "rb", buffering=0) as fh:
        while n < len(buf) and (got := fh.readinto(view[n:n + IO_CHUNK])):
            n += got
    return view[:n]


class Node:
    """One "node": a cachefs daemon with its own mount point and cache directory."""

    def __init__(self, name: str, work: Path, env: dict[str, str], args: list[str]) -> None:
        self.name = name
        self.mnt = work / f"mnt-{name}"
        self.cache = work / f"cache-{name}"
        self.log = work / f"{name}.log"
        self.env = env
        self.args = args
        self.pid: int | None = None
        self.mounted = False

    def _cli(self, *args: str, timeout_s: float) -> None:
        exe = str(Path(sys.executable).parent / "cachefs")
        result = subprocess.run([exe, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"{self.name}: cachefs {args[0]} failed (exit {result.returncode}): "
                               f"{result.stderr.strip()[-LOG_TAIL_CHARS:]} {log_tail(self.log)}")

    def mount(self) -> "Node":
        self.mnt.mkdir()
        self.mounted = True  # from here on unmount() runs, even if the mount half failed
        self._cli("mount", f"s3://{SOURCE_BUCKET}", str(self.mnt), "--cache-dir", str(self.cache),
                  "--log-file", str(self.log), "--log-level", "WARNING", *self.args, timeout_s=MOUNT_TIMEOUT_S)
        self.pid = int(call(self.mnt, "/info")["pid"])
        return self

    def stats(self) -> dict[str, Any]:
        return call(self.mnt, "/stats")

    def unmount(self) -> None:
        if not self.mounted:
            return
        self.mounted = False
        try:
            self._cli("unmount", str(self.mnt), timeout_s=UNMOUNT_TIMEOUT_S)
        except Exception as exc:  # report it, then make sure nothing stays mounted
            print(f"{self.name}: {exc}", file=sys.stderr)
        finally:
            fuse_unmount(self.mnt)
            if self.pid is not None:
                wait_pid_gone(self.pid)


class ClusterBench:
    def __init__(self, args: argparse.Namespace, source: SeaweedS3, cluster: SeaweedS3, work: Path) -> None:
        self.args = args
        self.source = source
        self.cluster = cluster
        self.work = work
        self.hashes: dict[str, str] = {}
        self.nodes: list[Node] = []
        self.proxy: ThrottledProxy | None = None
        # node -> (CPU seconds, its busiest thread's CPU seconds, wall seconds) of its read
        self.daemon_cpu: dict[str, tuple[float, float, float]] = {}

    def say(self, text: str) -> None:
        print(text, flush=True)

    def generate(self) -> None:
        self.source.make_bucket(SOURCE_BUCKET)
        self.cluster.make_bucket(CLUSTER_BUCKET)
        each = self.args.size // self.args.objects
        items = []
        for i in range(self.args.objects):
            key = f"train/shard-{i:03d}.bin"
            data = os.urandom(each)
            self.hashes[key] = hashlib.sha256(data).hexdigest()
            items.append((key, data))
        self.source.put_many(SOURCE_BUCKET, items)
        self.dataset_bytes = each * self.args.objects

    def env(self) -> dict[str, str]:
        creds = self.work / "credentials"
        if not creds.exists():
            creds.write_text(f"[{PROFILE}]\naws_access_key_id = {self.cluster.access_key}\n"
                             f"aws_secret_access_key = {self.cluster.secret_key}\n")
            creds.chmod(0o600)
        key = self.work / "cluster.key"  # the cluster key every node of the store shares
        if not key.exists():
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
        return {**clean_env(), **self.source.env(), "AWS_SHARED_CREDENTIALS_FILE": str(creds),
                "CACHEFS_CLUSTER_KEY_FILE": str(key)}

    def node(self, name: str, *extra: str) -> Node:
        assert self.proxy is not None
        args = ["--endpoint-url", self.proxy.endpoint_url, "--read-only",
                "--ram-cache", f"{self.args.ram_cache // MiB}MiB",
                "--disk-cache", f"{max(2 * self.dataset_bytes, 256 * MiB) // MiB}MiB",
                "--cluster-cache", f"s3://{CLUSTER_BUCKET}/{CLUSTER_PREFIX}",
                "--cluster-endpoint-url", self.cluster.endpoint_url, "--cluster-profile", PROFILE, *extra]
        node = Node(name, self.work, self.env(), args)
        self.nodes.append(node)
        return node.mount()

    def read_timeout_s(self) -> float:
        return max(READ_FLOOR_S, READ_SLACK * self.dataset_bytes / (self.args.rate * 1e6))

    def timed_read(self, node: Node) -> float:
        """MiB/s of ``node`` reading every object (``--readers`` at once), each then checked by SHA-256."""
        if not self.args.keep_page_cache:
            drop_page_cache()
        keys = sorted(self.hashes)
        each = self.dataset_bytes // len(keys)

        assert node.pid is not None
        meter = procstat.SpanMeter(node.pid)
        begin = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.args.readers) as pool:
            futures = {key: pool.submit(read_whole, node.mnt / key, each) for key in keys}
            results = {key: f.result(timeout=self.read_timeout_s()) for key, f in futures.items()}
        elapsed = time.perf_counter() - begin
        span = meter.stop()
        self.daemon_cpu[node.name] = (span.cpu_s, span.busiest_thread_s, elapsed)
        for key, data in results.items():
            if len(data) != each or hashlib.sha256(data).hexdigest() != self.hashes[key]:
                raise RuntimeError(f"{node.name}: {key} read {len(data)} bytes with the wrong SHA-256")
        return self.dataset_bytes / elapsed / MiB

    def wait_drained(self, node: Node) -> dict[str, Any]:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            section = node.stats()["cluster"]
            if section["write_behind"]["depth"] == 0:
                return section
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{node.name}: write-behind not drained after {DRAIN_TIMEOUT_S:g} s: {section}")
            time.sleep(POLL_S)

    def cluster_objects(self) -> list[tuple[str, int]]:
        """(key, size) of every block object in the cluster store."""
        client = self.cluster.client()
        objects: list[tuple[str, int]] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
            objects.extend((obj["Key"], obj["Size"]) for obj in page.get("Contents", []))
        return objects

    def raw_get(self, objects: list[tuple[str, int]]) -> tuple[str | None, float, dict[str, Any]]:
        """The fastest raw GET engine on the cluster store's blocks (benchmarks/engines.py), and each one's run."""
        creds = engines.Credentials(self.cluster.access_key, self.cluster.secret_key, REGION)
        runs: dict[str, Any] = {}
        for name in engines.ENGINES:
            try:
                runs[name] = engines.measure(name, self.cluster.endpoint_url, CLUSTER_BUCKET, objects, creds,
                                             self.args.raw_get_threads or self.args.readers,
                                             DEFAULT_BLOCK_SIZE).to_json()
            except (engines.EngineUnavailable, RuntimeError) as exc:
                runs[name] = {"unavailable": str(exc)}
        best, rate = analysis.best_engine({n: r.get("mib_s") for n, r in runs.items()})
        if best is None or rate is None:
            raise RuntimeError(f"no raw GET engine could read the cluster store: {runs}")
        return best, rate, runs

    def run(self) -> dict[str, Any]:
        a = self.args
        out: dict[str, Any] = {}
        self.say(f"dataset: {a.objects} objects, {self.dataset_bytes / MiB:.0f} MiB; link {a.delay_ms:g} ms, {a.rate:g} MB/s")
        first = self.node("node1")
        rates = {"node1": self.timed_read(first)}
        self.say(f"node1 (cold, from the source): {rates['node1']:.1f} MiB/s")
        drained = self.wait_drained(first)
        out["node1_write_behind"] = drained["write_behind"]

        objects = self.cluster_objects()
        if not a.keep_page_cache:
            drop_page_cache()
        engine, raw, out["cluster_raw_get_engines"] = self.raw_get(objects)
        out["cluster_raw_get_engine"] = engine
        out["cluster_blocks"] = len(objects)
        self.say(f"raw GET of the cluster store ({len(objects)} block objects), fastest engine {engine}: {raw:.1f} MiB/s")

        for i in range(2, a.nodes + 1):
            node = self.node(f"node{i}")
            assert node.pid is not None
            with profiled(a, node.pid, node.name):  # --profile / --perf: nothing without them
                rates[node.name] = self.timed_read(node)
            self.say(f"{node.name} (cold, own empty cache): {rates[node.name]:.1f} MiB/s")

        per_node = {}
        for node in self.nodes:
            s = node.stats()
            per_node[node.name] = {"source_bytes": s["object_store"]["bytes_read"],
                                   "source_gets": s["object_store"]["get_requests"],
                                   "cluster_hits": s["cluster"]["hits"], "cluster_misses": s["cluster"]["misses"],
                                   "cluster_errors": s["cluster"]["errors"], "read_mib_s": round(rates[node.name], 1),
                                   "daemon_cpu_s": round(self.daemon_cpu[node.name][0], 2),
                                   "busiest_thread_cpu_s": round(self.daemon_cpu[node.name][1], 2),
                                   "cpu_s_per_gib": round(self.daemon_cpu[node.name][0] * GiB / self.dataset_bytes, 2),
                                   "busiest_thread_cpu_s_per_gib":
                                       round(self.daemon_cpu[node.name][1] * GiB / self.dataset_bytes, 2),
                                   "read_s": round(self.daemon_cpu[node.name][2], 2)}
        source_bytes = sum(n["source_bytes"] for n in per_node.values())

        # Mounted while the store is up (a mount refuses an unreachable cluster store), then stopped.
        down = self.node("node-cluster-down", "--cluster-timeout", STOPPED_CLUSTER_TIMEOUT_S)
        self.cluster.stop_keep_data()
        try:
            down_rate = self.timed_read(down)
            down_stats = down.stats()
        finally:
            self.cluster.start()
        self.say(f"cluster store stopped, fresh node: {down_rate:.1f} MiB/s (bytes verified)")

        later = statistics.median([rates[f"node{i}"] for i in range(2, a.nodes + 1)]) if a.nodes > 1 else None
        out.update({
            "nodes": a.nodes,
            "dataset_bytes": self.dataset_bytes,
            "objects": a.objects,
            "link": {"delay_ms": a.delay_ms, "rate_mb_s": a.rate},
            "readers_per_node": a.readers,
            "later_nodes": "one after the other",
            "per_node": per_node,
            "source_bytes_all_nodes": source_bytes,
            "source_bytes_ratio": round(source_bytes / self.dataset_bytes, 3),
            "source_bytes_ratio_without_tier": a.nodes,
            "node1_cold_mib_s": round(rates["node1"], 1),
            "later_nodes_median_mib_s": round(later, 1) if later else None,
            "cluster_raw_get_mib_s": round(raw, 1),
            "later_nodes_ratio_to_raw_get": round(later / raw, 3) if later else None,
            "cluster_down": {"read_mib_s": round(down_rate, 1), "bytes_verified": True,
                             "source_bytes": down_stats["object_store"]["bytes_read"],
                             "cluster_errors": down_stats["cluster"]["errors"],
                             "cluster_state": down_stats["cluster"]["state"],
                             "ratio_to_node1": round(down_rate / rates["node1"], 3)},
            "page_cache_dropped": not a.keep_page_cache,
        })
        out["targets"] = [
            {"name": "source bytes, all nodes / dataset", "measured": out["source_bytes_ratio"],
             "target": f"<= {SOURCE_BYTES_TARGET}",
             "status": "PASS" if out["source_bytes_ratio"] <= SOURCE_BYTES_TARGET else "MISS"},
        ]
        if later:
            ratio = out["later_nodes_ratio_to_raw_get"]
            out["targets"].append({"name": "nodes 2.. cold read / cluster raw GET", "measured": ratio,
                                   "target": f">= {RAW_GET_TARGET}",
                                   "status": "PASS" if ratio >= RAW_GET_TARGET else "MISS"})
        return out


def markdown(r: dict[str, Any]) -> str:
    size = r["dataset_bytes"] / MiB
    lines = [
        f"Dataset {size:.0f} MiB in {r['objects']} objects, {r['nodes']} nodes (later nodes read "
        f"{r['later_nodes']}), source link {r['link']['delay_ms']:g} ms per request + {r['link']['rate_mb_s']:g} MB/s; "
        f"{r['machine']['cpus']} CPUs; one run; page cache dropped: {r['page_cache_dropped']}.",
        "",
        "| figure | measured | reference |",
        "|---|---|---|",
        f"| bytes from the source, all {r['nodes']} nodes | {r['source_bytes_all_nodes'] / MiB:.0f} MiB "
        f"(**{r['source_bytes_ratio']:.2f}x** the dataset) | {r['nodes']}x without the tier; target <= {SOURCE_BYTES_TARGET}x |",
        f"| node 1 cold read (from the source) | {r['node1_cold_mib_s']:.1f} MiB/s | the link: {r['link']['rate_mb_s'] * 1e6 / MiB:.1f} MiB/s |",
    ]
    if r["later_nodes_median_mib_s"] is not None:
        lines.append(f"| nodes 2-{r['nodes']} cold read (median) | {r['later_nodes_median_mib_s']:.1f} MiB/s "
                     f"(**{r['later_nodes_ratio_to_raw_get']:.2f}x** raw GET) | cluster store raw parallel GET "
                     f"{r['cluster_raw_get_mib_s']:.1f} MiB/s ({r['cluster_raw_get_engine']}, the fastest engine); target >= {RAW_GET_TARGET}x |")
    d = r["cluster_down"]
    lines.append(f"| cluster store stopped, fresh node | {d['read_mib_s']:.1f} MiB/s, bytes verified "
                 f"({d['ratio_to_node1']:.2f}x node 1) | source speed |")
    lines += ["", "| node | from source | cluster hits | read MiB/s | daemon CPU s / read s | CPU-s/GiB: daemon, busiest thread |",
              "|---|---|---|---|---|---|"]
    for name, n in r["per_node"].items():
        lines.append(f"| {name} | {n['source_bytes'] / MiB:.0f} MiB | {n['cluster_hits']} | {n['read_mib_s']:.1f} "
                     f"| {n['daemon_cpu_s']:.2f} / {n['read_s']:.2f} "
                     f"| {n['cpu_s_per_gib']:.2f}, {n['busiest_thread_cpu_s_per_gib']:.2f} |")
    lines += ["", "| target | measured | wanted | status |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['measured']} | {t['target']} | {t['status']} |" for t in r["targets"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="the dataset, all objects")
    parser.add_argument("--objects", type=int, default=16, help="objects the dataset is split into")
    parser.add_argument("--nodes", type=int, default=4, help="daemons, each with its own cache directory")
    parser.add_argument("--readers", type=int, default=DEFAULT_MAX_CONCURRENT_FETCHES,
                        help="objects each node reads at once (default: the mount's fetch slots, as many as the raw GET has in flight)")
    parser.add_argument("--raw-get-threads", type=int, default=None,
                        help="GETs the raw GET engines keep in flight (default: --readers; make bench uses 8 beside "
                             "its one sequential reader, --objects 1 --readers 1 --raw-get-threads 8 is that case)")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="source link: delay per connection and request")
    parser.add_argument("--rate", type=float, default=40.0, help="source link: MB/s shared by all connections")
    parser.add_argument("--ram-cache", type=parse_size, default=parse_size("256MiB"), help="each node's RAM tier")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="never drop the system's page cache (for runs beside other work)")
    parser.add_argument("--workdir", type=Path, default=None, help="mounts and caches (default: a temp dir)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy records each later node's daemon (the thread holding the GIL) into DIR/nodeN.txt")
    parser.add_argument("--perf", type=Path, default=None,
                        help="perf records each later node's daemon (every thread, kernel too) into DIR/nodeN.data")
    args = parser.parse_args(argv)
    if args.size < MiB or args.objects < 1 or args.nodes < 1 or args.readers < 1 or (args.raw_get_threads or 1) < 1 or args.rate <= 0 or args.delay_ms < 0:
        parser.error("--size >= 1MiB, --objects >= 1, --nodes >= 1, --readers >= 1, --rate > 0, --delay-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # the temp dir goes inside it, as under /tmp
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachefs-bench-cluster-", dir=args.workdir)))
        source = stack.enter_context(SeaweedS3())
        cluster = stack.enter_context(SeaweedS3())
        bench = ClusterBench(args, source, cluster, work)
        bench.generate()
        bench.proxy = stack.enter_context(
            ThrottledProxy(source.s3_port or 0, delay_s=args.delay_ms / 1000, rate_bytes_s=args.rate * 1e6))
        try:
            result = bench.run()
        finally:
            for node in reversed(bench.nodes):
                node.unmount()
    result = {"started": started, "machine": machine_info(), **result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.json").write_text(json.dumps(result, indent=2))
    (args.out / "cluster.md").write_text(markdown(result))
    print(markdown(result))
    print(f"results: {args.out / 'cluster.json'}, {args.out / 'cluster.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
