"""The side-by-side benchmark: cachefs, rclone mount and s3fs-fuse on one SeaweedFS, next to true limits.

One run starts SeaweedFS on 127.0.0.1 (and a second one as the cluster tier's store), uploads the
datasets (one large object, ``--files`` small ones in one directory), then runs ``--rounds``
rounds. Each round:

1. samples how quiet the machine is (load average; the CPU others used while the harness idled
   for ``QUIET_WINDOW_S``) and warns loudly when it was not (``analysis.quiet_warnings``);
2. measures the limits, the raw GET engines in an order that turns each round
   (``benchmarks.engines``: aiohttp, boto3 threads, obstore, awscrt, each on the same objects with
   the same part size and requests in flight), a local-disk read and a page-cache read;
3. measures each scenario on every tool, the tools in an order that turns each round
   (``analysis.rotation``), scenario after scenario, so that the tools of one scenario run minutes
   apart, not a whole round apart.

Scenarios of ``--set quick`` (``make bench``, <= 15 minutes on 2 cores) and their limits:

  figure            what is timed                                 limit (same round, same bytes)
  cold_read         first read of the large object, fresh mount   the fastest raw GET engine, 8 MiB
                    and cache                                     ranges, --threads in flight
  warm_read         second read, same mount                       page cache: a local copy, 2nd read
  disk_tier_read    remount on the same cache dir, the cache      local-disk read of a local copy,
                    dir's pages dropped (fadvise DONTNEED)        its pages dropped the same way
  epoch_1r          the small files whole, one shuffled order,    the fastest raw small GET engine
                    1 reader, fresh mount                         (one GET per file, 16 in flight)
  epoch_1r_ann.     cachefs: the same with the order announced    the same
  cluster_read      cachefs: a fresh node reads the large object  the fastest raw GET engine on the
                    from the cluster tier (filled once, before)   cluster store's block objects
  peak_rss          VmHWM of the tool's processes, per round      RAM tier + RSS_HEADROOM_MIB

For every figure and tool the CPU of the tool's processes (cachefs: the daemon and its children;
rclone, s3fs: their process) over the timed span is kept, per GiB (per file, in ms, for the small
files), and the CPU of its busiest thread (``benchmarks.procstat``). ``--set full`` (``make
bench-full``) adds the long figures: small files by name cold and warm, listing, write + drain,
N-reader epochs, and the hit ratio of epochs over a dataset twice the disk tier.

Every figure is the median of the rounds; every raw sample is kept. A limit that a tool beats by
more than ``analysis.LIMIT_NOISE`` is a bug of the benchmark and is reported as one. Results go to
``--out`` as results.json, results.md and results.png.

Run: make bench [BENCH_ARGS="--size 256MiB --files 500 --rounds 1"]
 or: .venv/bin/python -m benchmarks.bench --help
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import analysis, engines, epochs, procstat  # noqa: E402
from benchmarks.common import (  # noqa: E402
    MiB, drop_page_cache, raw_multipart_upload, read_mib_s, read_seconds, wait_stored, write_seconds,
)
from benchmarks.peers import PART_SIZE, PARTS_IN_FLIGHT, TOOLS, CachefsTool, PeerError, Tool  # noqa: E402
from cachefs.client import call  # noqa: E402
from tests.support.s3servers import REGION, SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402
from tiering.units import format_size, parse_size  # noqa: E402

GiB = 1024 * MiB
BUCKET = "bench"
BIG_KEY = "big/big.bin"
SMALL_DIR = "small"
CLUSTER_BUCKET = "cluster"
CLUSTER_PREFIX = "cache/"
CLUSTER_PROFILE = "benchcluster"
# The RSS target: the RAM tier may be full, plus this much for the interpreter, the engine's tables
# and in-flight buffers (16 fetches of 8 MiB alone are 128 MiB at worst).
RSS_HEADROOM_MIB = 150
# The disk tier of every tool holds the large file and the small ones of one measurement, with room
# to spare so that no eviction happens: this measures the data path, not eviction.
DISK_SLACK = 2
# The chart's y axis stops here; a bar above it is cut and labelled with its value.
CHART_CLIP = 20.0
# Bounds for the drain: a 1 GiB upload on loopback takes seconds; ten minutes means it is stuck.
DRAIN_TIMEOUT_S = 600.0
# How long the harness idles before each round to see what others use of the machine: long enough
# for a few hundred scheduler ticks per CPU, short next to a round.
QUIET_WINDOW_S = 2.0
# Small-file engines keep this many GETs in flight: cachefs's fetch slots (a loader's prefetch).
SMALL_GET_THREADS = 16
# The cluster tier's write-behind gets this long to reach the cluster store after the seed read.
CLUSTER_DRAIN_TIMEOUT_S = 300.0
POLL_S = 0.1


@dataclass(frozen=True)
class Figure:
    key: str
    title: str
    unit: str
    limit: str
    higher_is_better: bool = True
    only: tuple[str, ...] | None = None  # the tools it is measured for (None: all)
    full_only: bool = False  # measured by --set full only
    cost: str | None = "GiB"  # CPU is reported per GiB, per "file" (ms) or not at all (None)


CACHEFS = ("cachefs",)
FIGURES = [
    Figure("cold_read", "cold sequential read", "MiB/s", "raw_get"),
    Figure("warm_read", "warm re-read", "MiB/s", "page_cache"),
    Figure("disk_tier_read", "disk-tier read (remount)", "MiB/s", "local_disk_read"),
    Figure("epoch_1r", "shuffled epoch, cold, 1 reader", "files/s", "raw_small_get", cost="file"),
    Figure("epoch_1r_announced", "shuffled epoch, cold, 1 reader, order announced", "files/s", "raw_small_get",
           only=CACHEFS, cost="file"),
    Figure("cluster_read", "cluster-tier node, cold read", "MiB/s", "cluster_raw_get", only=CACHEFS),
    Figure("peak_rss", "peak RSS", "MiB", "rss_budget", higher_is_better=False, cost=None),
    Figure("small_cold", "small files by name, cold", "files/s", "local_small_cold", full_only=True, cost="file"),
    Figure("small_warm", "small files by name, warm", "files/s", "local_small_warm", full_only=True, cost="file"),
    Figure("list_cold", "listing, cold", "entries/s", "local_list_cold", full_only=True, cost=None),
    Figure("list_warm", "listing, warm", "entries/s", "local_list_warm", full_only=True, cost=None),
    Figure("write_close", "write + close", "MiB/s", "local_disk_write", full_only=True),
    Figure("drain", "drain (close -> in store)", "MiB/s", "raw_multipart", full_only=True, cost=None),
    Figure("write_to_store", "write -> in store", "MiB/s", "raw_multipart", full_only=True, cost=None),
    Figure("epoch_nr", "shuffled epoch, cold, N readers", "files/s", "raw_small_get", full_only=True, cost="file"),
    Figure("epoch_nr_announced", "shuffled epoch, cold, N readers, order announced", "files/s", "raw_small_get",
           only=CACHEFS, full_only=True, cost="file"),
    Figure("hit_lru", "epochs 2x the disk tier: hit ratio, LRU", "share", "disk_fits", only=CACHEFS,
           full_only=True, cost=None),
    Figure("hit_order", "epochs 2x the disk tier: hit ratio, announced", "share", "disk_fits", only=CACHEFS,
           full_only=True, cost=None),
]
FIGURE_BY_KEY = {f.key: f for f in FIGURES}
LIMITS = {
    "raw_get": "the fastest raw GET engine, large object (MiB/s)",
    "raw_get_cpu": "the cheapest raw GET engine, large object (CPU-s/GiB)",
    "raw_get_thread": "the raw GET engine with the least busy busiest thread (CPU-s/GiB)",
    "page_cache": "page-cache read of a local file (MiB/s)",
    "local_disk_read": "local-disk read, the file's pages dropped (MiB/s)",
    "raw_small_get": "the fastest raw small GET engine, 16 in flight (files/s)",
    "raw_small_get_cpu": "the cheapest raw small GET engine (CPU ms/file)",
    "cluster_raw_get": "the fastest raw GET engine on the cluster store's blocks (MiB/s)",
    "rss_budget": f"RAM tier + {RSS_HEADROOM_MIB} MiB (MiB)",
    "local_small_cold": "local small files, pages dropped (files/s)",
    "local_small_warm": "local small files, page cache warm (files/s)",
    "local_list_cold": "local scandir + stat (entries/s)",
    "local_list_warm": "local scandir + stat, again (entries/s)",
    "local_disk_write": "local-disk write + fsync + close (MiB/s)",
    "raw_multipart": "raw boto3 multipart upload (MiB/s)",
    "disk_fits": "share of the small-file dataset the hit-ratio run's disk tier holds",
}
# Engine targets: the objects each limit is measured on.
ENGINE_TARGETS = {"big": "raw_get", "small": "raw_small_get", "cluster": "cluster_raw_get"}


# -- measurements ---------------------------------------------------------------------------------


def small_pass(paths: list[Path], workers: int) -> float:
    """Files per second of opening, reading to the end and closing every file in ``paths``."""
    start = time.perf_counter()
    if workers <= 1:
        for path in paths:
            read_seconds(path)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(read_seconds, paths))
    return len(paths) / (time.perf_counter() - start)


def list_pass(directory: Path, expected: int) -> float:
    """Entries per second of ``os.scandir`` + ``stat`` of every entry of ``directory``."""
    start = time.perf_counter()
    n = 0
    with os.scandir(directory) as it:
        for entry in it:
            entry.stat()
            n += 1
    elapsed = time.perf_counter() - start
    if n != expected:
        raise RuntimeError(f"listed {n} entries in {directory}, expected {expected}")
    return n / elapsed


def evict(path: Path) -> int:
    """Drop ``path``'s pages (a file, or every file under a directory) from the page cache.

    Dirty pages are written first (``fdatasync``), since DONTNEED leaves them. Only these files lose
    their pages: nothing system-wide, no root needed, no other process on the machine disturbed.
    Returns the number of files.
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue  # gone, or a socket: nothing cached to drop
        try:
            with contextlib.suppress(OSError):
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def timed_read(path: Path, pid: int) -> tuple[float, procstat.Span]:
    """MiB/s of one sequential read of ``path``, and what the tool ``pid`` spent on it."""
    meter = procstat.SpanMeter(pid)
    rate = read_mib_s(path)
    return rate, meter.stop()


class Bench:
    def __init__(self, args: argparse.Namespace, server: SeaweedS3, cluster: SeaweedS3 | None, work: Path) -> None:
        self.args = args
        self.server = server
        self.cluster = cluster
        self.work = work
        self.size = args.size
        self.data = b""
        self.names = [f"f{i:05d}.bin" for i in range(args.files)]
        self.small_bytes = args.files * args.file_size
        self.full = args.set == "full"
        self.hit_rows: list[dict[str, Any]] = []
        # tool -> figure -> samples ({"round", "value", "cpu", "thread", "loadavg"}).
        self.samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.limits: dict[str, list[float]] = {}
        # target ("big", "small", "cluster") -> engine -> one EngineRun (as JSON) per round.
        self.engine_runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.engine_unavailable: dict[str, str] = {}
        self.rounds: list[dict[str, Any]] = []
        self.errors: dict[str, list[str]] = {}
        self.unavailable: dict[str, str] = {}
        self.warnings: list[str] = []
        self.evicting = not args.keep_page_cache
        self.cluster_keys: list[tuple[str, int]] = []
        self.cluster_seed: dict[str, Any] = {}
        self.cluster_unavailable: str | None = None if cluster is not None else "not asked for (--no-cluster)"
        self.rss: dict[str, list[float]] = {}
        self.log: list[str] = []

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        self.log.append(line)
        print(line, flush=True)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        self.say("WARNING: " + text)

    def add(self, tool: str, figure: str, run: int, value: float, span: procstat.Span | None = None,
            amount: float | None = None) -> None:
        """One sample; ``amount`` is the GiB (cost per GiB) or files (cost per file, ms) of the span."""
        fig = FIGURE_BY_KEY[figure]
        cpu = thread = None
        if span is not None and amount:
            scale = 1000.0 if fig.cost == "file" else 1.0
            cpu, thread = span.cpu_s * scale / amount, span.busiest_thread_s * scale / amount
        self.samples.setdefault(tool, {}).setdefault(figure, []).append(
            {"round": run + 1, "value": value, "cpu": cpu, "thread": thread, "loadavg_1m": round(os.getloadavg()[0], 2)})

    def credentials(self, server: SeaweedS3) -> engines.Credentials:
        return engines.Credentials(server.access_key, server.secret_key, REGION)

    # -- datasets ---------------------------------------------------------------------------------

    def generate(self) -> None:
        args = self.args
        self.server.make_bucket(BUCKET)
        begin = time.perf_counter()
        self.data = os.urandom(self.size)
        self.server.put(BUCKET, BIG_KEY, self.data)
        local = self.work / "local"
        (local / SMALL_DIR).mkdir(parents=True)
        (local / "big.bin").write_bytes(self.data)
        # Distinct bytes per small file (its name first, then a slice of the random data at an offset
        # of its own), so that no store or cache can deduplicate them.
        pool = self.data if len(self.data) >= args.file_size * 2 else os.urandom(args.file_size * 2)
        span = len(pool) - args.file_size

        def body(i: int, name: str) -> bytes:
            offset = (i * 4099) % max(span, 1)
            return name.encode().ljust(64, b"\0")[:64] + pool[offset + 64:offset + args.file_size]

        items = [(name, body(i, name)) for i, name in enumerate(self.names)]
        for name, content in items:
            (local / SMALL_DIR / name).write_bytes(content)
        self.server.put_many(BUCKET, ((f"{SMALL_DIR}/{name}", content) for name, content in items))
        if not self.full:
            self.data = b""  # only the write figures need the bytes again
        self.say(f"datasets: {format_size(self.size)} object + {args.files} x {format_size(args.file_size)}, "
                 f"uploaded in {time.perf_counter() - begin:.1f} s")

    # -- the cluster tier -------------------------------------------------------------------------

    def cluster_tool(self) -> CachefsTool:
        assert self.cluster is not None
        creds = self.work / "cluster-credentials"
        if not creds.exists():
            fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"[{CLUSTER_PROFILE}]\naws_access_key_id = {self.cluster.access_key}\n"
                         f"aws_secret_access_key = {self.cluster.secret_key}\n")
        return CachefsTool(self.server, BUCKET, self.work, ram_bytes=self.args.ram_cache,
                           disk_bytes=DISK_SLACK * self.size + 256 * MiB,
                           extra_args=("--cluster-cache", f"s3://{CLUSTER_BUCKET}/{CLUSTER_PREFIX}",
                                       "--cluster-endpoint-url", self.cluster.endpoint_url,
                                       "--cluster-profile", CLUSTER_PROFILE),
                           extra_env={"AWS_SHARED_CREDENTIALS_FILE": str(creds)})

    def seed_cluster(self) -> None:
        """Fill the cluster store once: a first node reads the large object, its write-behind drains."""
        if self.cluster is None:
            return
        try:
            self.cluster.make_bucket(CLUSTER_BUCKET)
            base = self.work / "cluster-seed"
            (base / "mnt").mkdir(parents=True)
            with self.cluster_tool().mounted(base / "mnt", base / "cache") as m:
                read_mib_s(m.path / BIG_KEY)
                deadline = time.monotonic() + CLUSTER_DRAIN_TIMEOUT_S
                while (section := call(m.path, "/stats")["cluster"])["write_behind"]["depth"] != 0:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"the cluster write-behind did not drain in {CLUSTER_DRAIN_TIMEOUT_S:g} s")
                    time.sleep(POLL_S)
                self.cluster_seed = section["write_behind"]
            shutil.rmtree(base, ignore_errors=True)
            client = self.cluster.client()
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
                self.cluster_keys += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
            if not self.cluster_keys:
                raise RuntimeError("the seed read left no block in the cluster store")
            held = sum(s for _, s in self.cluster_keys)
            self.say(f"cluster store: {len(self.cluster_keys)} block objects, {format_size(held)}")
            if held < self.size:
                # The write-behind queue drops blocks when it is full (by design: the cluster tier is
                # best effort); the node then reads the rest from the source, which the figure shows.
                self.warn(f"the cluster store holds {format_size(held)} of the {format_size(self.size)} object "
                          f"(seed write-behind: {self.cluster_seed}); the cluster-tier node reads the rest from the source")
        except (PeerError, OSError, RuntimeError, TimeoutError, KeyError, subprocess.SubprocessError) as exc:
            self.cluster_unavailable = f"{type(exc).__name__}: {exc}"
            self.warn(f"cluster tier: unavailable: {self.cluster_unavailable}")

    # -- limits -----------------------------------------------------------------------------------

    def drop_all(self) -> None:
        """--drop-caches only (root; system-wide): for the full set's cold listing."""
        if self.args.drop_caches and not drop_page_cache():
            self.args.drop_caches = False
            self.warn("--drop-caches: not allowed here (root only); cold listings are measured warm")

    def measure_engines(self, run: int) -> None:
        targets: list[tuple[str, engines.Credentials, str, str, list[tuple[str, int]], int]] = [
            ("big", self.credentials(self.server), self.server.endpoint_url, BUCKET, [(BIG_KEY, self.size)],
             self.args.threads),
            ("small", self.credentials(self.server), self.server.endpoint_url, BUCKET,
             [(f"{SMALL_DIR}/{n}", self.args.file_size) for n in self.names], SMALL_GET_THREADS),
        ]
        if self.cluster is not None and self.cluster_keys:
            targets.append(("cluster", self.credentials(self.cluster), self.cluster.endpoint_url, CLUSTER_BUCKET,
                            self.cluster_keys, self.args.threads))
        for name in self.args.engine_names:
            reason = engines.unavailable_reason(name)
            if reason and name not in self.engine_unavailable:
                self.engine_unavailable[name] = reason
                self.warn(f"engine {name}: unavailable: {reason}")
        live = [n for n in self.args.engine_names if n not in self.engine_unavailable]
        for target, creds, endpoint, bucket, sizes, threads in targets:
            for name in analysis.rotation(live, run):
                try:
                    result = engines.measure(name, endpoint, bucket, sizes, creds, threads, DEFAULT_BLOCK_SIZE)
                except (RuntimeError, OSError, ValueError) as exc:
                    self.errors.setdefault(f"engine {name}", []).append(f"round {run + 1}, {target}: {exc}")
                    self.say(f"engine {name} ({target}): failed: {exc}")
                    continue
                self.engine_runs.setdefault(target, {}).setdefault(name, []).append({"round": run + 1, **result.to_json()})
        summary = []
        for target in self.engine_runs:
            for name, runs in self.engine_runs[target].items():
                last = runs[-1]
                if last["round"] == run + 1:
                    rate = f"{last['mib_s']:.0f} MiB/s" if target != "small" else f"{last['requests_s']:.0f} files/s"
                    summary.append(f"{target}/{name} {rate} {last['cpu_s_per_gib']:.2f} CPU-s/GiB")
        self.say("engines: " + ", ".join(summary))

    def measure_limits(self, run: int) -> None:
        local = self.work / "local"
        add = lambda key, value: self.limits.setdefault(key, []).append(value)  # noqa: E731
        self.measure_engines(run)
        if self.evicting:
            evict(local / "big.bin")
        add("local_disk_read", read_mib_s(local / "big.bin"))
        read_mib_s(local / "big.bin")
        add("page_cache", read_mib_s(local / "big.bin"))
        add("rss_budget", self.args.ram_cache / MiB + RSS_HEADROOM_MIB)
        if self.full:
            scratch = self.work / "local-write.bin"
            add("local_disk_write", self.size / write_seconds(scratch, self.data, fsync=True) / MiB)
            scratch.unlink()
            key = f"raw/multipart-{run}.bin"
            seconds = raw_multipart_upload(self.server, BUCKET, key, self.data, part_size=PART_SIZE,
                                           parallel=PARTS_IN_FLIGHT)
            add("raw_multipart", self.size / seconds / MiB)
            self.server.delete(BUCKET, key)
            add("disk_fits", min(1.0, self.hit_disk_bytes() / self.small_bytes))
            paths = [local / SMALL_DIR / name for name in self.names]
            self.drop_all()
            add("local_list_cold", list_pass(local / SMALL_DIR, len(self.names)))
            add("local_list_warm", list_pass(local / SMALL_DIR, len(self.names)))
            if self.evicting:
                evict(local / SMALL_DIR)
            add("local_small_cold", small_pass(paths, self.args.file_workers))
            add("local_small_warm", small_pass(paths, self.args.file_workers))
        self.say("limits: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in self.limits.items()))

    # -- the scenarios, one tool at a time ----------------------------------------------------------

    def note_rss(self, tool: str, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.rss.setdefault(tool, []).append(procstat.tree_peak_rss_mib(pid))

    def big_file(self, tool: Tool, run: int) -> None:
        """Cold read, warm re-read, then a remount on the same cache dir (its pages dropped): disk tier."""
        base = self.work / f"{tool.name}-{run}-big"
        mnt, cache = base / "mnt", base / "cache"
        mnt.mkdir(parents=True)
        gib = self.size / GiB
        try:
            with tool.mounted(mnt, cache) as m:
                rate, span = timed_read(mnt / BIG_KEY, m.pid)
                self.add(tool.name, "cold_read", run, rate, span, gib)
                os.sync()  # the cold pass's cache-file write-out is not the warm read's to pay
                rate, span = timed_read(mnt / BIG_KEY, m.pid)
                self.add(tool.name, "warm_read", run, rate, span, gib)
                self.note_rss(tool.name, m.pid)
            if self.evicting:
                evict(cache)
            with tool.mounted(mnt, cache) as m:
                rate, span = timed_read(mnt / BIG_KEY, m.pid)
                self.add(tool.name, "disk_tier_read", run, rate, span, gib)
                self.note_rss(tool.name, m.pid)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def epoch_1r(self, tool: Tool, run: int) -> None:
        order = [f"{SMALL_DIR}/{name}" for name in epochs.shuffled(self.names, epochs.SEED)]
        modes = [False, True] if tool.name == "cachefs" else [False]
        readers = [(1, "1r")] + ([(self.args.epoch_readers, "nr")] if self.full else [])
        for n, label in readers:
            for announce in modes:
                key = f"epoch_{label}" + ("_announced" if announce else "")
                base = self.work / f"{tool.name}-{run}-{key}"
                (base / "mnt").mkdir(parents=True)
                try:
                    with tool.mounted(base / "mnt", base / "cache") as m:
                        meter = procstat.SpanMeter(m.pid)
                        rate = epochs.epoch(base / "mnt", order, n, announce=announce, expected_bytes=self.small_bytes)
                        self.add(tool.name, key, run, rate, meter.stop(), len(order))
                        self.note_rss(tool.name, m.pid)
                finally:
                    shutil.rmtree(base, ignore_errors=True)

    def cluster_read(self, run: int) -> None:
        base = self.work / f"cluster-node-{run}"
        (base / "mnt").mkdir(parents=True)
        try:
            with self.cluster_tool().mounted(base / "mnt", base / "cache") as m:
                rate, span = timed_read(m.path / BIG_KEY, m.pid)
                stats = call(m.path, "/stats")
                self.add("cachefs", "cluster_read", run, rate, span, self.size / GiB)
                self.note_rss("cachefs", m.pid)
            source = stats["object_store"]["bytes_read"]
            if source > 0:
                self.warn(f"round {run + 1}: the cluster-tier node read {format_size(source)} from the source "
                          "(not every block came from the cluster tier)")
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def small_by_name(self, tool: Tool, run: int) -> None:
        base = self.work / f"{tool.name}-{run}-small"
        (base / "mnt").mkdir(parents=True)
        try:
            self.drop_all()
            with tool.mounted(base / "mnt", base / "cache") as m:
                got = list_pass(base / "mnt" / SMALL_DIR, len(self.names))
                self.add(tool.name, "list_cold", run, got)
                self.add(tool.name, "list_warm", run, list_pass(base / "mnt" / SMALL_DIR, len(self.names)))
            with tool.mounted(base / "mnt", base / "cache2") as m:
                paths = [base / "mnt" / SMALL_DIR / name for name in self.names]
                for key in ("small_cold", "small_warm"):
                    meter = procstat.SpanMeter(m.pid)
                    rate = small_pass(paths, self.args.file_workers)
                    self.add(tool.name, key, run, rate, meter.stop(), len(paths))
                self.note_rss(tool.name, m.pid)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def write(self, tool: Tool, run: int) -> None:
        base = self.work / f"{tool.name}-{run}-write"
        (base / "mnt").mkdir(parents=True)
        key = f"written-{tool.name}-{run}.bin"
        client = self.server.client()
        os.sync()
        try:
            with tool.mounted(base / "mnt", base / "cache") as m:
                meter = procstat.SpanMeter(m.pid)
                wrote = write_seconds(base / "mnt" / key, self.data, fsync=False)
                span = meter.stop()
                start = time.perf_counter()
                tool.settle(m, DRAIN_TIMEOUT_S)
                wait_stored(client, BUCKET, key, self.size, DRAIN_TIMEOUT_S)
                drained = time.perf_counter() - start
                self.note_rss(tool.name, m.pid)
            self.server.delete(BUCKET, key)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        self.add(tool.name, "write_close", run, self.size / wrote / MiB, span, self.size / GiB)
        self.add(tool.name, "drain", run, self.size / drained / MiB)
        self.add(tool.name, "write_to_store", run, self.size / (wrote + drained) / MiB)

    def hit_disk_bytes(self) -> int:
        """The hit-ratio run's disk tier: half the small-file dataset (at least two blocks)."""
        return max(self.small_bytes // 2, 2 * DEFAULT_BLOCK_SIZE)

    def hit_ratio(self, tool: Tool, run: int) -> None:
        """cachefs only: --epochs shuffled epochs over a dataset twice the disk tier, LRU vs announced."""
        narrow = CachefsTool(self.server, BUCKET, self.work, ram_bytes=epochs.SMALL_RAM, disk_bytes=self.hit_disk_bytes())
        relative = [f"{SMALL_DIR}/{name}" for name in self.names]
        for announce, key in ((False, "hit_lru"), (True, "hit_order")):
            base = self.work / f"hit-{key}-{run}"
            (base / "mnt").mkdir(parents=True)
            try:
                with narrow.mounted(base / "mnt", base / "cache"):
                    rows = epochs.hit_ratio_run(base / "mnt", relative, self.args.epochs, self.args.epoch_readers,
                                                announce=announce, expected_bytes=self.small_bytes)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            self.hit_rows.append({"run": run + 1, "policy": "announced" if announce else "lru", "epochs": rows})
            later = epochs.later_epochs_hit_ratio(rows)
            if later is not None:
                self.add("cachefs", key, run, later)

    # -- rounds -----------------------------------------------------------------------------------

    def quiet_check(self, run: int, own: list[int]) -> None:
        sample = procstat.quiet_sample(QUIET_WINDOW_S, own)
        reasons = analysis.quiet_warnings(sample.loadavg[0], sample.foreign_busy, sample.cpus)
        self.rounds.append({"round": run + 1, "loadavg": list(sample.loadavg), "foreign_busy": sample.foreign_busy,
                            "quiet": not reasons, "warnings": reasons})
        self.say(f"round {run + 1}: load average {sample.loadavg}, others used {sample.foreign_busy:.0%} of the CPUs")
        for reason in reasons:
            self.warn(f"round {run + 1}: the machine was not quiet: {reason}; rates of this round are lower bounds")

    def guarded(self, tool: Tool, run: int, what: str, step: Any) -> None:
        """Run one scenario of one tool; a failure is recorded and the run goes on."""
        if tool.name in self.unavailable:
            return
        try:
            step(tool, run)
        except (PeerError, OSError, RuntimeError, TimeoutError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            text = f"round {run + 1}, {what}: {type(exc).__name__}: {exc}"
            self.errors.setdefault(tool.name, []).append(text + "\n" + traceback.format_exc())
            self.say(f"{tool.name} {text}")
            if tool.name not in self.samples:
                self.unavailable[tool.name] = f"failed in round {run + 1} ({what}): {type(exc).__name__}: {exc}"

    def run(self, tools: list[Tool]) -> None:
        for tool in tools:
            reason = tool.unavailable_reason()
            if reason:
                self.unavailable[tool.name] = reason
                self.say(f"{tool.name}: unavailable: {reason}")
        live = [t for t in tools if t.name not in self.unavailable]
        own = [os.getpid()] + [s.pid for s in (self.server, self.cluster) if s is not None and s.pid]
        cachefs = next((t for t in live if t.name == "cachefs"), None)
        for run in range(self.args.rounds):
            self.quiet_check(run, own)
            self.measure_limits(run)
            order = analysis.rotation(live, run)
            self.rounds[-1]["order"] = [t.name for t in order]
            scenarios: list[tuple[str, Any, list[Tool]]] = [("big file", self.big_file, order),
                                                            ("epoch", self.epoch_1r, order)]
            if cachefs is not None and self.cluster_keys:
                scenarios.append(("cluster node", lambda _t, r: self.cluster_read(r), [cachefs]))
            if self.full:
                scenarios += [("small files by name", self.small_by_name, order), ("write", self.write, order)]
                if cachefs is not None:
                    scenarios.append(("hit ratio", self.hit_ratio, [cachefs]))
            for what, step, who in scenarios:
                for tool in who:
                    self.guarded(tool, run, what, step)
            for name, values in self.rss.items():
                if values:
                    self.add(name, "peak_rss", run, max(values))
            self.rss = {}
            self.say(f"round {run + 1} done")


# -- results ----------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    mem = read("/proc/meminfo") or ""
    total = next((int(line.split()[1]) // 1024 for line in mem.splitlines() if line.startswith("MemTotal:")), None)
    cpu = next((line.split(":", 1)[1].strip() for line in (read("/proc/cpuinfo") or "").splitlines()
                if line.startswith("model name")), platform.processor())
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_total_mib": total,
        "kernel_settings": {name: read(f"/proc/sys/vm/{name}") for name in
                            ("dirty_ratio", "dirty_background_ratio", "dirty_expire_centisecs", "swappiness")},
        "fuse_max_user_bgreq": read("/sys/module/fuse/parameters/max_user_bgreq"),
    }


ratio = analysis.ratio


def engine_table(bench: Bench) -> dict[str, dict[str, dict[str, Any]]]:
    """target -> engine -> medians over the rounds (rate, CPU per GiB and per request, busiest thread)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for target, per_engine in bench.engine_runs.items():
        for name, runs in per_engine.items():
            out.setdefault(target, {})[name] = {
                "mib_s": analysis.median(r["mib_s"] for r in runs),
                "requests_s": analysis.median(r["requests_s"] for r in runs),
                "cpu_s_per_gib": analysis.median(r["cpu_s_per_gib"] for r in runs),
                "busiest_thread_s_per_gib": analysis.median(r["busiest_thread_s_per_gib"] for r in runs),
                "cpu_ms_per_request": analysis.median(r["cpu_s"] * 1000 / r["requests"] for r in runs if r["requests"]),
                "threads": runs[-1]["threads"], "part_size": runs[-1]["part_size"], "samples": runs,
            }
    return out


def engine_limits(table: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The limits taken from the engines: the fastest engine's rate, the cheapest engine's CPU.

    Each engine's figure is its median over the rounds; the limit is the best of those medians (its
    samples, for the record, are the best engine of each round).
    """
    out: dict[str, dict[str, Any]] = {}
    for target, key in ENGINE_TARGETS.items():
        per = table.get(target, {})
        field = "requests_s" if target == "small" else "mib_s"
        name, value = analysis.best_engine({n: e[field] for n, e in per.items()})
        by_round: dict[int, list[float]] = {}
        for e in per.values():
            for r in e["samples"]:
                by_round.setdefault(r["round"], []).append(r[field])
        out[key] = {"median": value, "engine": name, "title": LIMITS[key],
                    "engines": {n: e[field] for n, e in per.items()},
                    "samples": [max(v) for _r, v in sorted(by_round.items())]}
    big = table.get("big", {})
    name, value = analysis.best_engine({n: e["cpu_s_per_gib"] for n, e in big.items()}, higher_is_better=False)
    out["raw_get_cpu"] = {"median": value, "engine": name, "title": LIMITS["raw_get_cpu"]}
    name, value = analysis.best_engine({n: e["busiest_thread_s_per_gib"] for n, e in big.items()}, higher_is_better=False)
    out["raw_get_thread"] = {"median": value, "engine": name, "title": LIMITS["raw_get_thread"]}
    small = table.get("small", {})
    name, value = analysis.best_engine({n: e["cpu_ms_per_request"] for n, e in small.items()}, higher_is_better=False)
    out["raw_small_get_cpu"] = {"median": value, "engine": name, "title": LIMITS["raw_small_get_cpu"]}
    return out


def summarise(bench: Bench, tools: list[Tool], args: argparse.Namespace, started: str) -> dict[str, Any]:
    table = engine_table(bench)
    limits: dict[str, dict[str, Any]] = engine_limits(table)
    for key, values in bench.limits.items():
        limits[key] = {"median": analysis.median(values), "samples": values, "title": LIMITS[key]}
    names = [t.name for t in tools]
    figures: dict[str, Any] = {}
    beaten: list[dict[str, Any]] = []
    for fig in FIGURES:
        if fig.full_only and not bench.full:
            continue
        title = fig.title.replace("N readers", f"{args.epoch_readers} readers")
        limit = limits.get(fig.limit, {}).get("median")
        entry: dict[str, Any] = {"title": title, "unit": fig.unit, "only": list(fig.only or names), "limit": fig.limit,
                                 "limit_median": limit, "limit_engine": limits.get(fig.limit, {}).get("engine"),
                                 "higher_is_better": fig.higher_is_better,
                                 "cost_unit": {"GiB": "CPU-s/GiB", "file": "CPU-ms/file"}.get(fig.cost or ""),
                                 "tools": {}}
        medians = {}
        for name in names:
            samples = bench.samples.get(name, {}).get(fig.key, [])
            value = analysis.median(s["value"] for s in samples)
            medians[name] = value
            entry["tools"][name] = {
                "median": value,
                "cpu": analysis.median(s["cpu"] for s in samples),
                "busiest_thread": analysis.median(s["thread"] for s in samples),
                "samples": samples,
                "ratio_to_limit": ratio(value, limit),
            }
        for name in names:
            entry["tools"][name]["ratio_to_peers"] = {p: ratio(medians[name], medians[p]) for p in names if p != name}
        entry["limit_beaten"] = analysis.limit_beaten(limit, medians, higher_is_better=fig.higher_is_better)
        for name, r in entry["limit_beaten"].items():
            beaten.append({"figure": fig.key, "tool": name, "ratio": r, "limit": fig.limit})
        figures[fig.key] = entry
    warnings = list(bench.warnings)
    for b in beaten:
        warnings.append(f"LIMIT BEATEN (a benchmark bug): {b['tool']} reached {b['ratio']:.2f}x the "
                        f"{b['limit']} limit on {b['figure']}: that limit is not an upper bound")
    return {
        "started": started,
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "set": args.set,
        "parameters": {"size": args.size, "files": args.files, "file_size": args.file_size, "rounds": args.rounds,
                       "tools": names, "engines": args.engine_names, "threads": args.threads,
                       "small_get_threads": SMALL_GET_THREADS, "part_size": DEFAULT_BLOCK_SIZE,
                       "ram_cache": args.ram_cache, "file_workers": args.file_workers,
                       "epoch_readers": args.epoch_readers, "epochs": args.epochs,
                       "hit_ratio_disk": bench.hit_disk_bytes(), "hit_ratio_ram": epochs.SMALL_RAM},
        "hit_ratio_runs": bench.hit_rows,
        "machine": machine_info(),
        "rounds": bench.rounds,
        "quiet": all(r["quiet"] for r in bench.rounds),
        "quiet_thresholds": {"loadavg_per_cpu": analysis.QUIET_LOADAVG_PER_CPU,
                             "foreign_busy": analysis.QUIET_FOREIGN_BUSY, "window_s": QUIET_WINDOW_S},
        "page_cache_evicted": bench.evicting,
        "versions": {t.name: (None if t.name in bench.unavailable else safe_version(t)) for t in tools},
        "unavailable": bench.unavailable,
        "engine_unavailable": bench.engine_unavailable,
        "cluster_unavailable": bench.cluster_unavailable,
        "cluster_seed_write_behind": bench.cluster_seed,
        "cluster_store_bytes": sum(size for _key, size in bench.cluster_keys),
        "errors": bench.errors,
        "engines": table,
        "limits": limits,
        "limit_beaten": beaten,
        "warnings": warnings,
        "figures": figures,
        "targets": targets(figures),
    }


def safe_version(tool: Tool) -> str:
    try:
        return tool.version()
    except Exception as exc:  # a version string is decoration: never fail a finished run over it
        return f"? ({type(exc).__name__})"


def targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 25's targets for cachefs (and those of the full set's figures), each PASS, MISS or n/a."""
    def tool(fig: str) -> dict[str, Any]:
        return figures.get(fig, {}).get("tools", {}).get("cachefs", {})

    def value(fig: str) -> float | None:
        return tool(fig).get("median")

    def limit(fig: str) -> float | None:
        return figures.get(fig, {}).get("limit_median")

    out = []

    def check(name: str, measured: float | None, wanted: float, against: str, *, at_most: bool = False,
              strict: bool = False) -> None:
        if measured is None:
            status = "n/a"
        elif at_most:
            status = "PASS" if measured <= wanted else "MISS"
        else:
            status = "PASS" if (measured > wanted if strict else measured >= wanted) else "MISS"
        out.append({"target": name, "measured": measured, "wanted": wanted, "against": against,
                    "at_most": at_most, "status": status})

    check("cold read >= 0.8x the fastest raw GET engine", ratio(value("cold_read"), limit("cold_read")), 0.8, "raw_get")
    check("daemon CPU, cold read <= 1.0 CPU-s/GiB", tool("cold_read").get("cpu"), 1.0, "CPU-s/GiB", at_most=True)
    check("busiest daemon thread, cold read <= 0.25 CPU-s/GiB", tool("cold_read").get("busiest_thread"), 0.25,
          "CPU-s/GiB", at_most=True)
    check("disk-tier read >= 0.8x local-disk read", ratio(value("disk_tier_read"), limit("disk_tier_read")), 0.8,
          "local_disk_read")
    check("announced epoch, 1 reader >= 0.8x raw small GET",
          ratio(value("epoch_1r_announced"), limit("epoch_1r_announced")), 0.8, "raw_small_get")
    check("announced epoch, 1 reader >= 3x not announced", ratio(value("epoch_1r_announced"), value("epoch_1r")), 3.0,
          "cachefs epoch_1r")
    check("daemon CPU per cold file (announced epoch) <= 0.5 ms", tool("epoch_1r_announced").get("cpu"), 0.5,
          "CPU-ms/file", at_most=True)
    check("cluster-tier node >= 0.8x the cluster store's raw GET", ratio(value("cluster_read"), limit("cluster_read")),
          0.8, "cluster_raw_get")
    rss, budget = value("peak_rss"), limit("peak_rss")
    check(f"daemon RSS <= RAM tier + {RSS_HEADROOM_MIB} MiB", rss, budget or 0.0, "rss_budget", at_most=True)
    if "small_warm" in figures:
        check("warm small file: daemon CPU <= 0.1 ms", tool("small_warm").get("cpu"), 0.1, "CPU-ms/file", at_most=True)
        check("announced epoch, N readers >= 0.8x raw small GET",
              ratio(value("epoch_nr_announced"), limit("epoch_nr_announced")), 0.8, "raw_small_get")
        check("hit ratio, announced > LRU", ratio(value("hit_order"), value("hit_lru")), 1.0, "cachefs hit_lru",
              strict=True)
        check("drain >= 0.8x raw multipart", ratio(value("drain"), limit("drain")), 0.8, "raw_multipart")
    return out


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if abs(value) < 100_000 else f"{value:,.0f}"


def markdown(result: dict[str, Any]) -> str:
    names = result["parameters"]["tools"]
    p = result["parameters"]
    lines = [
        f"# cachefs side-by-side benchmark ({result['set']} set)",
        "",
        (f"{result['started']} · {p['rounds']} round(s), medians · large file {format_size(p['size'])} · "
         f"{p['files']} files of {format_size(p['file_size'])} · RAM tier {format_size(p['ram_cache'])} · "
         f"{p['threads']} threads x {format_size(p['part_size'])} parts · "
         f"{result['machine']['cpus']} CPUs, {result['machine']['mem_total_mib']} MiB · kernel {result['machine']['kernel']}"),
        "",
    ]
    if not result["quiet"]:
        lines += ["**WARNING: the machine was not quiet** (see Rounds): every rate below is a lower bound, "
                  "and ratios measured in one round are the figures to trust.", ""]
    for w in result["warnings"]:
        lines.append(f"- **{w}**")
    for name, reason in result["unavailable"].items():
        lines.append(f"- **{name}: unavailable: {reason}**")
    if not result["page_cache_evicted"]:
        lines.append("- pages were not dropped (--keep-page-cache): disk-tier and local-disk figures are warm")
    lines.append("")
    header = ["figure", "unit", "limit"] + [f"{n}: value (x limit) · CPU · busiest thread" for n in names]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for fig in result["figures"].values():
        engine = f" ({fig['limit_engine']})" if fig.get("limit_engine") else ""
        flag = " **LIMIT BEATEN**" if fig["limit_beaten"] else ""
        unit = fig["unit"] + (f"; {fig['cost_unit']}" if fig["cost_unit"] else "")
        row = [fig["title"] + ("" if fig["higher_is_better"] else " (lower is better)") + flag, unit,
               fmt(fig["limit_median"]) + engine]
        for n in names:
            t = fig["tools"][n]
            if t["median"] is None:
                row.append("—")
                continue
            cell = f"{fmt(t['median'])} ({fmt(t['ratio_to_limit'], 2)}x)"
            if fig["cost_unit"]:
                cell += f" · {fmt(t['cpu'], 2)} · {fmt(t['busiest_thread'], 2)}"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "CPU: user + system of the tool's processes over the timed span (cachefs: the daemon and its "
              "children; rclone, s3fs: their process), per GiB or in ms per file; busiest thread: the same for "
              "its busiest thread alone (/proc/PID/task/*/stat).", ""]
    lines += ["## Raw GET engines (same server, same objects, same run)", "",
              "| objects | engine | threads x part | MiB/s | files/s | CPU-s/GiB | busiest thread CPU-s/GiB | CPU ms/request |",
              "|---|---|---|---|---|---|---|---|"]
    for target, per in result["engines"].items():
        for name, e in per.items():
            lines.append(f"| {target} | {name} | {e['threads']} x {format_size(e['part_size'])} | {fmt(e['mib_s'])} | "
                         f"{fmt(e['requests_s'])} | {fmt(e['cpu_s_per_gib'], 2)} | {fmt(e['busiest_thread_s_per_gib'], 2)} | "
                         f"{fmt(e['cpu_ms_per_request'], 2)} |")
    for name, reason in result["engine_unavailable"].items():
        lines.append(f"| — | {name} | unavailable: {reason} | | | | | |")
    lines += ["", "## Limits", "", "| limit | median | from | samples |", "|---|---|---|---|"]
    for key, lim in result["limits"].items():
        source = lim.get("engine") or ""
        samples = ", ".join(fmt(s) for s in lim.get("samples", []))
        lines.append(f"| {lim['title']} | {fmt(lim['median'], 2)} | {source} | {samples} |")
    lines += ["", "## Rounds", "",
              (f"Quiet means a 1-minute load average <= {result['quiet_thresholds']['loadavg_per_cpu']:g} per CPU and "
               f"<= {result['quiet_thresholds']['foreign_busy']:.0%} of the CPUs used by others during "
               f"{result['quiet_thresholds']['window_s']:g} s of idling before the round."), "",
              "| round | tool order | load average (1, 5, 15 min) | others' CPU | quiet |", "|---|---|---|---|---|"]
    for r in result["rounds"]:
        lines.append(f"| {r['round']} | {', '.join(r.get('order', []))} | {', '.join(f'{x:.2f}' for x in r['loadavg'])} | "
                     f"{r['foreign_busy']:.0%} | {'yes' if r['quiet'] else '**no**'} |")
    lines += ["", "## Targets (cachefs, issue 25)", "", "| target | measured | wanted | against | result |",
              "|---|---|---|---|---|"]
    for t in result["targets"]:
        x = "" if t["at_most"] or t["against"] == "rss_budget" else "x"
        measured = "—" if t["measured"] is None else f"{fmt(t['measured'], 2)}{x}"
        wanted = ("<= " if t["at_most"] else ">= ") + f"{fmt(t['wanted'], 2)}{x}"
        lines.append(f"| {t['target']} | {measured} | {wanted} | {t['against']} | **{t['status']}** |")
    lines += hit_ratio_markdown(result)
    lines += ["", f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}.", ""]
    return "\n".join(lines)


def hit_ratio_markdown(result: dict[str, Any]) -> list[str]:
    p = result["parameters"]
    rows = result.get("hit_ratio_runs") or []
    if not rows:
        return []
    lines = ["", (f"## Epochs over a dataset twice the disk tier (cachefs; disk tier {format_size(p['hit_ratio_disk'])}, "
                  f"RAM tier {format_size(p['hit_ratio_ram'])}, {p['epoch_readers']} readers)"), "",
             "Hit ratio: the share of an epoch's files served without a GET. Epoch 1 is cold for both policies.", "",
             "| run | policy | epoch | files/s | GETs | hit ratio | stalls |", "|---|---|---|---|---|---|---|"]
    for block in rows:
        for e in block["epochs"]:
            lines.append(f"| {block['run']} | {block['policy']} | {e['epoch']} | {fmt(e['files_per_s'])} | {e['gets']} | "
                         f"{fmt(e['hit_ratio'], 3)} | {e.get('stalls', '—')} |")
    return lines


def chart(result: dict[str, Any], path: Path) -> None:
    """Left: each rate divided by its limit, one bar per tool. Right: CPU-s/GiB of the cold read,
    all of the process and its busiest thread, for the tools and the raw GET engines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result["parameters"]["tools"]
    figs = [f for f in result["figures"].values()]
    fig, (ax, cost) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ys = []
        for f in figs:
            r = f["tools"][name]["ratio_to_limit"]
            if not r:
                ys.append(float("nan"))  # not measured for this tool (an announced order: cachefs only)
                continue
            ys.append(1 / r if not f["higher_is_better"] else r)
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(figs))]
        ax.bar(xs, [min(y, CHART_CLIP) for y in ys], width, label=name)
        for x, y in zip(xs, ys):
            if y > CHART_CLIP:
                ax.annotate(f"{y:,.0f}x", (x, CHART_CLIP), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(figs)))
    ax.set_xticklabels([f["title"] + ("\n(limit/value)" if not f["higher_is_better"] else "") for f in figs],
                       rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("figure / its limit (log; 1 = the limit)")
    quiet = "" if result["quiet"] else " — machine NOT quiet"
    ax.set_title(f"normalised to each figure's limit ({result['parameters']['rounds']} round(s), medians){quiet}",
                 fontsize=10)
    ax.legend()

    cold = result["figures"].get("cold_read", {}).get("tools", {})
    labels, total, busiest = [], [], []
    for name in names:
        if cold.get(name, {}).get("cpu") is not None:
            labels.append(name)
            total.append(cold[name]["cpu"])
            busiest.append(cold[name]["busiest_thread"] or 0.0)
    for name, e in result["engines"].get("big", {}).items():
        labels.append(f"engine:\n{name}")
        total.append(e["cpu_s_per_gib"] or 0.0)
        busiest.append(e["busiest_thread_s_per_gib"] or 0.0)
    xs = list(range(len(labels)))
    cost.bar([x - 0.2 for x in xs], total, 0.4, label="all threads")
    cost.bar([x + 0.2 for x in xs], busiest, 0.4, label="busiest thread")
    cost.set_xticks(xs)
    cost.set_xticklabels(labels, fontsize=8)
    cost.set_ylabel("CPU-s per GiB, cold read (lower is better)")
    cost.set_title("what a GiB costs: tools (cold read) and raw GET engines", fontsize=10)
    cost.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result))
    chart(result, out / "results.png")


# -- entry point ------------------------------------------------------------------------------------

# --set full: the hour-long defaults (issue 25 moved them out of `make bench`).
FULL_DEFAULTS = {"files": 10_000}
QUICK_DEFAULTS = {"files": 1_000}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--set", choices=("quick", "full"), default="quick",
                        help="quick: make bench's scenarios (<= 15 min on 2 cores); full: every figure (an hour)")
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="the large file (e.g. 1GiB, 8MiB)")
    parser.add_argument("--files", type=int, default=None,
                        help=f"small files (default {QUICK_DEFAULTS['files']}; --set full: {FULL_DEFAULTS['files']})")
    parser.add_argument("--file-size", type=parse_size, default=parse_size("100KiB"), help="size of each small file")
    parser.add_argument("--rounds", "--runs", dest="rounds", type=int, default=3, help="rounds; each figure is the median")
    parser.add_argument("--tools", default="cachefs,rclone,s3fs", help="comma-separated, from: " + ",".join(TOOLS))
    parser.add_argument("--engines", default=",".join(engines.ENGINES),
                        help="raw GET engines for the limits, from: " + ",".join(engines.ENGINES))
    parser.add_argument("--threads", type=int, default=engines.DEFAULT_THREADS,
                        help="requests in flight of the threaded engines on the large object and the cluster blocks")
    parser.add_argument("--no-cluster", action="store_true", help="skip the cluster-tier node (no second server)")
    parser.add_argument("--ram-cache", type=parse_size, default=parse_size("1GiB"), help="cachefs RAM tier")
    parser.add_argument("--file-workers", type=int, default=1, help="threads reading small files by name (full set)")
    parser.add_argument("--epoch-readers", type=int, default=8,
                        help="threads of the N-reader epochs and the hit-ratio run (full set)")
    parser.add_argument("--epochs", type=int, default=3, help="shuffled epochs of the hit-ratio run (full set, >= 2)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="drop no pages at all (disk-tier and local-disk figures are then warm)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="full set: drop the system's page cache and dentries before the cold listings (root; "
                             "system-wide, so not beside other work)")
    parser.add_argument("--workdir", type=Path, default=None, help="mounts, caches and local copies (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.files is None:
        args.files = (FULL_DEFAULTS if args.set == "full" else QUICK_DEFAULTS)["files"]
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        parser.error(f"--tools: unknown {unknown}; choose from {','.join(TOOLS)}")
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in names if e not in engines.ENGINES]
    if bad or not names:
        parser.error(f"--engines: unknown {bad}; choose from {','.join(engines.ENGINES)}")
    if (args.size < MiB or args.files < 1 or args.file_size < 128 or args.rounds < 1 or args.file_workers < 1
            or args.epoch_readers < 1 or args.epochs < 2 or args.threads < 1):
        parser.error("--size >= 1MiB, --files >= 1, --file-size >= 128, --rounds >= 1, --file-workers >= 1, "
                     "--epoch-readers >= 1, --epochs >= 2, --threads >= 1")
    args.tool_names = tools
    args.engine_names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    begin = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachefs-bench-", dir=args.workdir)))
        server = stack.enter_context(SeaweedS3())
        cluster = None if args.no_cluster or "cachefs" not in args.tool_names else stack.enter_context(SeaweedS3())
        disk = DISK_SLACK * (args.size + args.files * args.file_size) + 256 * MiB
        tools = [TOOLS[name](server, BUCKET, work, ram_bytes=args.ram_cache, disk_bytes=disk) for name in args.tool_names]
        bench = Bench(args, server, cluster, work)
        bench.generate()
        bench.seed_cluster()
        bench.run(tools)
        result = summarise(bench, tools, args, started)
    result["wall_s"] = round(time.monotonic() - begin, 1)
    write_results(result, args.out)
    print(markdown(result))
    for w in result["warnings"]:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'results.png'} "
          f"({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
