"""The side-by-side benchmark: cachefs, rclone mount and s3fs-fuse on one SeaweedFS, next to true limits.

The tools: cachefs, cachefs with ``--direct-io`` (the large file's figures only), rclone mount and
s3fs-fuse (``benchmarks.peers``).

One run starts SeaweedFS on 127.0.0.1 (and a second one as the cluster tier's store), uploads the
datasets (one large object, ``--files`` small ones in one directory), then runs ``--rounds``
rounds. Each round:

1. samples how quiet the machine is (load average; the CPU others used while the harness idled
   for ``QUIET_WINDOW_S``) and warns loudly when it was not (``analysis.quiet_warnings``);
2. measures the limits, the raw GET engines in an order that turns each round
   (``benchmarks.engines``: the daemon's store path, aiohttp, boto3 threads, obstore, awscrt,
   each on the same objects with the same part size and requests in flight) and a page-cache
   read (the local-disk read is measured beside each tool's disk-tier read, below);
3. measures each scenario on every tool, the tools in an order that turns each round
   (``analysis.rotation``), scenario after scenario, so that the tools of one scenario run minutes
   apart, not a whole round apart.

Scenarios of ``--set quick`` (``make bench``, <= 15 minutes on 2 cores) and their limits:

  figure            what is timed                                 limit (same round, same bytes)
  cold_read         first read of the large object, fresh mount   the fastest raw GET engine, 8 MiB
                    and cache                                     ranges, --threads in flight
  warm_read         second read, same mount                       page cache: a local copy, 2nd read
  disk_tier_read    remount on the same cache dir, the cache      local-disk read of a local copy,
                    dir's pages dropped (fadvise DONTNEED)        its pages dropped the same way, right
                                                                  before and after each tool's read
  epoch_1r          the small files whole, one shuffled order,    the fastest raw small GET engine
                    1 reader, fresh mount                         (one GET per file, 16 in flight)
  epoch_1r_ann.     cachefs: the same with the order announced    the same
  epoch_1r_ann_full cachefs: announced, a RAM tier of a quarter   the same
                    of the epoch (full after its first quarter:
                    the steady state of an epoch larger than RAM)
  cluster_read      cachefs: a fresh node reads the large object  the fastest raw GET engine on the
                    from the cluster tier (filled once, before)   cluster store's block objects
  peak_rss          VmHWM of the tool's processes, per round      RAM tier + RSS_HEADROOM_MIB

After the rounds, cachefs alone on ``file://`` trees on the local disk: kernel passthrough of files
whole on the disk tier against the daemon and the same files read from the local disk
(``benchmarks.passthrough``, on this run's local copies, its pages dropped whatever
``--keep-page-cache`` says), the cluster tier's source check (``benchmarks.cluster_authorization``)
and the FUSE layer against a libfuse null server (``benchmarks.fuse_layer``).

For every figure and tool the CPU of the tool's processes (cachefs: the daemon and its children;
rclone, s3fs: their process) over the timed span is kept, per GiB (per file, in ms, for the small
files), and the CPU of its busiest thread (``benchmarks.procstat``). ``--set full`` (``make
bench-full``) adds the long figures: small files by name cold and warm, listing, write + drain,
N-reader epochs, and the hit ratio of epochs over a dataset twice the disk tier.

Every figure is the median of the rounds; every raw sample is kept. A limit that a tool beats by
more than ``analysis.LIMIT_NOISE`` is a bug of the benchmark and is reported as one. Results go to
``--out`` as results.json, results.md and results.png (``benchmarks.report``).

Run: make bench [BENCH_ARGS="--size 256MiB --files 500 --rounds 1"]
 or: .venv/bin/python -m benchmarks.bench --help
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import analysis, engines, epochs, procstat  # noqa: E402
from benchmarks.report import FIGURE_BY_KEY, RSS_HEADROOM_MIB, markdown, summarise, write_results  # noqa: E402
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
# The disk tier of every tool holds the large file and the small ones of one measurement, with room
# to spare so that no eviction happens: this measures the data path, not eviction.
DISK_SLACK = 2
# Bounds for the drain: a 1 GiB upload on loopback takes seconds; ten minutes means it is stuck.
DRAIN_TIMEOUT_S = 600.0
# How long the harness idles before each round to see what others use of the machine: long enough
# for a few hundred scheduler ticks per CPU, short next to a round.
QUIET_WINDOW_S = 2.0
# Small-file engines keep this many GETs in flight: cachefs's fetch slots (a loader's prefetch).
SMALL_GET_THREADS = 16
# The cluster tier's write-behind gets this long to reach the cluster store after the seed read.
CLUSTER_DRAIN_TIMEOUT_S = 300.0
# Seed reads before giving up on a full cluster store. One is enough since a full write-behind queue
# defers blocks to be read back from the disk tier (2026-11-28: 1.0 GiB in one pass); before, it
# dropped them, and one pass stored 30-90% of a 1 GiB object. Kept for a disk tier that evicts.
CLUSTER_SEED_PASSES = 3
POLL_S = 0.1




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
        # Measurement settings the report shows.
        self.small_get_threads = SMALL_GET_THREADS
        self.quiet_window_s = QUIET_WINDOW_S

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        self.log.append(line)
        print(line, flush=True)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        self.say("WARNING: " + text)

    def add(self, tool: str, figure: str, run: int, value: float, span: procstat.Span | None = None,
            amount: float | None = None, others: dict[str, float] | None = None) -> None:
        """One sample; ``amount`` is the GiB (cost per GiB) or files (cost per file, ms) of the span;
        ``others``: CPU seconds others spent over the same span (the S3 server's, the reader's), by name,
        kept per unit alike."""
        fig = FIGURE_BY_KEY[figure]
        cpu = thread = None
        paid: dict[str, float] = {}
        if span is not None and amount:
            scale = 1000.0 if fig.cost == "file" else 1.0
            cpu, thread = span.cpu_s * scale / amount, span.busiest_thread_s * scale / amount
            paid = {who: seconds * scale / amount for who, seconds in (others or {}).items()}
        self.samples.setdefault(tool, {}).setdefault(figure, []).append(
            {"round": run + 1, "value": value, "cpu": cpu, "thread": thread, **paid,
             "loadavg_1m": round(os.getloadavg()[0], 2)})
        cost = "" if cpu is None else (f" · CPU {cpu:.2f}, busiest thread {thread:.2f}"
                                       + "".join(f", {who} {x:.2f}" for who, x in paid.items())
                                       + f" {'CPU-ms/file' if fig.cost == 'file' else 'CPU-s/GiB'}")
        self.say(f"{tool} {figure}: {value:,.1f} {fig.unit}{cost}")

    def server_cpu_s(self) -> float | None:
        """CPU seconds of the source's S3 server (SeaweedFS, one process) so far; None if unknown."""
        pid = self.server.pid
        if pid is None:
            return None
        try:
            return procstat.tree_cpu_s(pid)
        except (ProcessLookupError, OSError):
            return None

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
                           extra_env={"AWS_SHARED_CREDENTIALS_FILE": str(creds),
                                      "CACHEFS_CLUSTER_KEY_FILE": str(self.cluster_key())})

    def cluster_key(self) -> Path:
        """The cluster key file of the cluster-tier rounds (random, owner-only)."""
        key = self.work / "cluster.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(32))
        return key

    def seed_cluster(self) -> None:
        """Fill the cluster store before the rounds: a node reads the large object and its write-behind
        drains (deferred blocks included: ``depth`` counts them); a block that could not be written
        (the cluster tier is best effort) is written by up to ``CLUSTER_SEED_PASSES`` - 1 more fresh
        nodes reading it again, each storing what the store still lacks."""
        if self.cluster is None:
            return
        try:
            self.cluster.make_bucket(CLUSTER_BUCKET)
            for attempt in range(CLUSTER_SEED_PASSES):
                base = self.work / f"cluster-seed-{attempt}"
                (base / "mnt").mkdir(parents=True)
                try:
                    with self.cluster_tool().mounted(base / "mnt", base / "cache") as m:
                        read_mib_s(m.path / BIG_KEY)
                        deadline = time.monotonic() + CLUSTER_DRAIN_TIMEOUT_S
                        while (section := call(m.path, "/stats")["cluster"])["write_behind"]["depth"] != 0:
                            if time.monotonic() >= deadline:
                                raise TimeoutError(f"the cluster write-behind did not drain in {CLUSTER_DRAIN_TIMEOUT_S:g} s")
                            time.sleep(POLL_S)
                        self.cluster_seed = section["write_behind"]
                finally:
                    shutil.rmtree(base, ignore_errors=True)
                self.cluster_keys = self.list_cluster()
                held = sum(s for _, s in self.cluster_keys)
                self.say(f"cluster store after seed pass {attempt + 1}: {len(self.cluster_keys)} block objects, "
                         f"{format_size(held)}")
                if held >= self.size:
                    break
            if not self.cluster_keys:
                raise RuntimeError("the seed reads left no block in the cluster store")
            if held < self.size:
                self.warn(f"the cluster store holds {format_size(held)} of the {format_size(self.size)} object after "
                          f"{CLUSTER_SEED_PASSES} seed reads (write-behind: {self.cluster_seed}); the cluster-tier "
                          "node reads the rest from the source")
        except (PeerError, OSError, RuntimeError, TimeoutError, KeyError, subprocess.SubprocessError) as exc:
            self.cluster_unavailable = f"{type(exc).__name__}: {exc}"
            self.cluster_keys = []
            self.warn(f"cluster tier: unavailable: {self.cluster_unavailable}")

    def list_cluster(self) -> list[tuple[str, int]]:
        assert self.cluster is not None
        keys: list[tuple[str, int]] = []
        client = self.cluster.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
            keys += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
        return keys

    # -- limits -----------------------------------------------------------------------------------

    def drop_all(self) -> None:
        """--drop-caches only (root; system-wide): for the full set's cold listing."""
        if self.args.drop_caches and not drop_page_cache():
            self.args.drop_caches = False
            self.warn("--drop-caches: not allowed here (root only); cold listings are measured warm")

    def measure_engines(self, run: int) -> None:
        """Every engine on every target (the large object, the small files, the cluster blocks), the
        engines in an order that turns each round; one child process per engine and round."""
        jobs: dict[str, engines.Job] = {
            "big": engines.Job(self.server.endpoint_url, BUCKET, [(BIG_KEY, self.size)], self.credentials(self.server),
                               self.args.threads, DEFAULT_BLOCK_SIZE),
            "small": engines.Job(self.server.endpoint_url, BUCKET,
                                 [(f"{SMALL_DIR}/{n}", self.args.file_size) for n in self.names],
                                 self.credentials(self.server), SMALL_GET_THREADS, DEFAULT_BLOCK_SIZE),
        }
        if self.cluster is not None and self.cluster_keys:
            jobs["cluster"] = engines.Job(self.cluster.endpoint_url, CLUSTER_BUCKET, self.cluster_keys,
                                          self.credentials(self.cluster), self.args.threads, DEFAULT_BLOCK_SIZE)
        for name in self.args.engine_names:
            reason = engines.unavailable_reason(name)
            if reason and name not in self.engine_unavailable:
                self.engine_unavailable[name] = reason
                self.warn(f"engine {name}: unavailable: {reason}")
        live = [n for n in self.args.engine_names if n not in self.engine_unavailable]
        for name in analysis.rotation(live, run):
            try:
                answers = engines.measure_jobs(name, list(jobs.values()))
            except (RuntimeError, OSError, ValueError) as exc:
                answers = [str(exc)] * len(jobs)
            for target, answer in zip(jobs, answers):
                if isinstance(answer, str):
                    self.errors.setdefault(f"engine {name}", []).append(f"round {run + 1}, {target}: {answer}")
                    self.say(f"engine {name} ({target}): failed: {answer}")
                    continue
                self.engine_runs.setdefault(target, {}).setdefault(name, []).append({"round": run + 1, **answer.to_json()})
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
        read_mib_s(local / "big.bin")  # (the local disk's read is measured beside each disk-tier read)
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
                self.local_disk_read()
                rate, span = timed_read(mnt / BIG_KEY, m.pid)
                self.local_disk_read()
                self.add(tool.name, "disk_tier_read", run, rate, span, gib)
                self.note_rss(tool.name, m.pid)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def local_disk_read(self) -> None:
        """A sample of the disk-tier read's limit: the local copy of the large object, its pages dropped,
        read right before and right after each tool's disk-tier read. This VM's disk moved by 2x
        between samples minutes apart (736-1,640 MiB/s in one run), so a sample taken once a round,
        before the engines, was beaten by the tool in one run and missed by 0.27 in the next."""
        local = self.work / "local" / "big.bin"
        if self.evicting:
            evict(local)
        self.limits.setdefault("local_disk_read", []).append(read_mib_s(local))

    def epoch_1r(self, tool: Tool, run: int) -> None:
        order = [f"{SMALL_DIR}/{name}" for name in epochs.shuffled(self.names, epochs.SEED)]
        modes: list[tuple[bool, str, Tool]] = [(False, "", tool)]
        if tool.name == "cachefs":
            modes.append((True, "_announced", tool))
        readers = [(1, "1r")] + ([(self.args.epoch_readers, "nr")] if self.full else [])
        for n, label in readers:
            # An epoch larger than the RAM tier (issue 35): every insert evicts once the tier is full,
            # which the figures above, with a RAM tier larger than the epoch, never reach.
            full = [(True, "_announced_full", self.small_ram_tool(tool))] if tool.name == "cachefs" and n == 1 else []
            for announce, suffix, mounter in modes + full:
                key = f"epoch_{label}{suffix}"
                base = self.work / f"{tool.name}-{run}-{key}"
                (base / "mnt").mkdir(parents=True)
                try:
                    with mounter.mounted(base / "mnt", base / "cache") as m:
                        # Who else pays for a cold file (issue 35): the S3 server, and this process (the
                        # readers, and the announce call where there is one).
                        store, reader = self.server_cpu_s(), time.process_time()
                        meter = procstat.SpanMeter(m.pid)
                        rate = epochs.epoch(base / "mnt", order, n, announce=announce, expected_bytes=self.small_bytes)
                        span = meter.stop()
                        others = {"reader": time.process_time() - reader}
                        if store is not None and (after := self.server_cpu_s()) is not None:
                            others["store"] = after - store
                        self.add(tool.name, key, run, rate, span, len(order), others)
                        self.note_rss(tool.name, m.pid)
                finally:
                    shutil.rmtree(base, ignore_errors=True)

    def small_ram_tool(self, tool: Tool) -> CachefsTool:
        """cachefs with a RAM tier of a quarter of the small files' bytes (the disk tier unchanged)."""
        return CachefsTool(self.server, BUCKET, self.work, ram_bytes=max(self.small_bytes // 4, 2 * DEFAULT_BLOCK_SIZE),
                           disk_bytes=tool.disk_bytes)

    def cluster_read(self, run: int) -> None:
        base = self.work / f"cluster-node-{run}"
        (base / "mnt").mkdir(parents=True)
        try:
            with self.cluster_tool().mounted(base / "mnt", base / "cache") as m:
                rate, span = timed_read(m.path / BIG_KEY, m.pid)
                stats = call(m.path, "/stats")
                self.add("cachefs", "cluster_read", run, rate, span, self.size / GiB)
                self.note_rss("cachefs", m.pid)
            # One byte per object version is the proof that this volume may read it (issue 34,
            # tiering.engine.authorize): one object here, so a single byte is no block from the source.
            source = stats["object_store"]["bytes_read"] - stats["cluster"]["authorization_requests"]
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
        settled = analysis.settle(lambda: os.getloadavg()[0], time.sleep, os.cpu_count() or 1,
                                  max_s=self.args.settle_max)
        sample = procstat.quiet_sample(QUIET_WINDOW_S, own)
        reasons = analysis.quiet_warnings(sample.loadavg[0], sample.foreign_busy, sample.cpus)
        self.rounds.append({"round": run + 1, "loadavg": list(sample.loadavg), "foreign_busy": sample.foreign_busy,
                            "settled_s": settled, "quiet": not reasons, "warnings": reasons})
        self.say(f"round {run + 1}: load average {sample.loadavg} (after {settled:g} s waiting for it to settle), "
                 f"others used {sample.foreign_busy:.0%} of the CPUs")
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
            every = [t for t in order if not t.big_file_only]
            scenarios: list[tuple[str, Any, list[Tool]]] = [("big file", self.big_file, order),
                                                            ("epoch", self.epoch_1r, every)]
            if cachefs is not None and self.cluster_keys:
                scenarios.append(("cluster node", lambda _t, r: self.cluster_read(r), [cachefs]))
            if self.full:
                scenarios += [("small files by name", self.small_by_name, every), ("write", self.write, every)]
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


# -- entry point ------------------------------------------------------------------------------------

# --set full: the hour-long defaults (issue 25 moved them out of `make bench`).
FULL_DEFAULTS = {"files": 10_000}
QUICK_DEFAULTS = {"files": 2_000}


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
    parser.add_argument("--tools", default="cachefs,cachefs-direct-io,rclone,s3fs", help="comma-separated, from: " + ",".join(TOOLS))
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
    parser.add_argument("--settle-max", type=float, default=analysis.SETTLE_MAX_S,
                        help="seconds to wait at most before each round for the 1-minute load average to fall to "
                             "one per CPU (0: no wait)")
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


# The FUSE layer's figures: at most this many of the small files' size, this many getxattr calls a round.
FUSE_LAYER_FILES = 2000
FUSE_LAYER_CALLS = 20000

# The passthrough section: at most this many of the small files (what the target names).
PASSTHROUGH_FILES = 2000
# Its epochs of each mount, each with its own local read of the same files (passthrough's interleaved
# with it: this VM's disk is throttled after a burst, see benchmarks/passthrough.py); ratios are medians.
PASSTHROUGH_ROUNDS = 3

# The cluster-tier authorization figure: this many of the small files, over this many epochs.
AUTHORIZATION_FILES = 1000
AUTHORIZATION_EPOCHS = 3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    begin = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachefs-bench-", dir=args.workdir)))
        server = SeaweedS3()
        stack.enter_context(server)
        cluster = None if args.no_cluster or "cachefs" not in args.tool_names else SeaweedS3()
        if cluster is not None:
            stack.enter_context(cluster)
        disk = DISK_SLACK * (args.size + args.files * args.file_size) + 256 * MiB
        tools = [TOOLS[name](server, BUCKET, work, ram_bytes=args.ram_cache, disk_bytes=disk) for name in args.tool_names]
        bench = Bench(args, server, cluster, work)
        bench.generate()
        bench.seed_cluster()
        bench.run(tools)
        result = summarise(bench, tools, args, started)
        if "cachefs" in args.tool_names:
            # Files whole on the disk tier read through kernel passthrough, against the daemon and the
            # local disk (issue 39), on the local copies of the datasets (file:// source).
            from benchmarks.passthrough import run as passthrough_run

            result["passthrough"] = passthrough_run(work / "local", "big.bin",
                                                    [f"{SMALL_DIR}/{n}" for n in bench.names[:PASSTHROUGH_FILES]],
                                                    work, rounds=PASSTHROUGH_ROUNDS)
    if "cachefs" in args.tool_names and not args.no_cluster:
        # The cluster tier's source check (issue 34): extra source requests on shuffled small-file
        # epochs, counted exactly on in-memory stores (benchmarks/cluster_authorization.py).
        from benchmarks.cluster_authorization import run as authorization_run

        result["cluster_authorization"] = asyncio.run(authorization_run(
            min(args.files, AUTHORIZATION_FILES), args.file_size, AUTHORIZATION_EPOCHS, quiet=True))
    if "cachefs" in args.tool_names:
        # The FUSE layer against a libfuse null server and the page cache (issue 39), on file:// trees.
        from benchmarks.fuse_layer import run as fuse_layer_run

        result["fuse_layer"] = fuse_layer_run(files=min(args.files, FUSE_LAYER_FILES), file_size=args.file_size,
                                              calls=FUSE_LAYER_CALLS,
                                              rounds=args.rounds, workdir=args.workdir)
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
