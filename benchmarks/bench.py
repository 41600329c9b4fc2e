"""The side-by-side benchmark: cachefs, rclone mount and s3fs-fuse on one SeaweedFS, next to their limits.

One run starts SeaweedFS on 127.0.0.1, uploads the datasets (one large object, ``--files`` small ones
in one directory), and then, ``--runs`` times, measures the limits and every tool:

  figure           what is timed                                         limit (same run, same bytes)
  cold_read        first read of the large object, fresh cache, page      raw parallel ranged GET
                   cache dropped                                          (common.raw_parallel_get)
  warm_read        second read, same mount                                page cache (local file, 2nd read)
  disk_tier_read   remount on the same cache dir, page cache dropped      local-disk read, cache dropped
  small_cold/warm  open + read + close every small file, fresh mount;     the same files on local disk
                   then again                                             (cold: cache dropped; warm)
  list_cold/warm   os.scandir + stat of the small-file directory, fresh   the same on a local directory
                   mount; then again
  write_close      write the large file through the mount, close          local write + fsync + close
  drain            from close until the object is in the store (HEAD      raw boto3 multipart upload
                   poll; cachefs: `cachefs flush` first)
  write_to_store   write_close + drain: when the bytes are in the bucket  raw boto3 multipart upload
  peak_rss         VmHWM of the daemon, max over its mounts in a run      RAM tier + RSS_HEADROOM_MIB
  cold_read_cpu    daemon CPU (user + system, /proc/PID/stat) over the    the raw parallel GET's own CPU
                   cold read, seconds per GiB (lower is better)           (same fetch code, no FUSE)
  epoch_1r/_nr     the small files in one shuffled order, whole, fresh    raw parallel small GET
                   mount, 1 and --epoch-readers threads (DataLoader        (16 in flight, files/s)
                   workers); cachefs also with the order announced
                   (``cachefs.loader``, issue 15; peers cannot be told)
  epoch_1r_cpu     daemon CPU per file of the 1-reader epochs (ms)        the raw small GET's own CPU
  hit_lru/_order   cachefs only: a disk tier half the small-file          the share of the dataset the
                   dataset, --epochs shuffled epochs on one mount, not    disk tier holds
                   told (LRU) vs each epoch announced: the share of the
                   files of epochs 2.. served without a GET
                   (benchmarks/epochs.py)

Every figure is a median over the runs; all raw samples are kept. Tool order rotates between runs
so that no tool always runs on a machine warmed by another. A tool that cannot be started is
reported as "unavailable: reason", not a crash. Results go to ``--out`` as results.json,
results.md and results.png (each figure normalised to its limit, one bar per tool).

Run: make bench [BENCH_ARGS="--size 256MiB --files 1000 --runs 1"]
 or: .venv/bin/python -m benchmarks.bench --help
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import statistics
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

from benchmarks import epochs  # noqa: E402
from benchmarks.common import (  # noqa: E402
    MiB, drop_page_cache, peak_rss_mib, raw_multipart_upload, raw_parallel_get_cost, read_mib_s, read_seconds,
    wait_stored, write_seconds,
)
from benchmarks.peers import PART_SIZE, PARTS_IN_FLIGHT, TOOLS, CachefsTool, PeerError, Tool  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402
from tiering.units import format_size, parse_size  # noqa: E402

GiB = 1024 * 1024 * 1024
BUCKET = "bench"
BIG_KEY = "big/big.bin"
SMALL_DIR = "small"
# The RSS target: the RAM tier may be full, plus this much for the interpreter, the engine's tables
# and in-flight buffers (16 fetches of 8 MiB alone are 128 MiB at worst).
RSS_HEADROOM_MIB = 150
# The disk tier of every tool holds the large file and the small ones of one measurement, with room
# to spare so that no eviction happens: this measures the data path, not eviction.
DISK_SLACK = 2
# The chart's y axis stops here; a bar above it is cut and labelled with its value (one meaningless
# outlier, like a drain that happened inside close(), would otherwise squash every other bar).
CHART_CLIP = 20.0
# Bounds for the drain: a 1 GiB upload on loopback takes seconds; ten minutes means it is stuck.
DRAIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Figure:
    key: str
    title: str
    unit: str
    limit: str
    higher_is_better: bool = True
    only: tuple[str, ...] | None = None  # the tools it is measured for (None: all)


CACHEFS = ("cachefs",)
FIGURES = [
    Figure("cold_read", "cold sequential read", "MiB/s", "raw_get"),
    Figure("warm_read", "warm re-read", "MiB/s", "page_cache"),
    Figure("disk_tier_read", "disk-tier read (remount)", "MiB/s", "local_disk_read"),
    Figure("small_cold", "small files, cold", "files/s", "local_small_cold"),
    Figure("small_warm", "small files, warm", "files/s", "local_small_warm"),
    Figure("list_cold", "listing, cold", "entries/s", "local_list_cold"),
    Figure("list_warm", "listing, warm", "entries/s", "local_list_warm"),
    Figure("write_close", "write + close", "MiB/s", "local_disk_write"),
    Figure("drain", "drain (close -> in store)", "MiB/s", "raw_multipart"),
    Figure("write_to_store", "write -> in store", "MiB/s", "raw_multipart"),
    Figure("peak_rss", "daemon peak RSS", "MiB", "rss_budget", higher_is_better=False),
    Figure("cold_read_cpu", "daemon CPU, cold sequential read", "CPU-s/GiB", "raw_get_cpu", higher_is_better=False),
    Figure("epoch_1r", "shuffled epoch, cold, 1 reader", "files/s", "raw_small_get"),
    Figure("epoch_1r_announced", "shuffled epoch, cold, 1 reader, order announced", "files/s", "raw_small_get",
           only=CACHEFS),
    Figure("epoch_nr", "shuffled epoch, cold, N readers", "files/s", "raw_small_get"),
    Figure("epoch_nr_announced", "shuffled epoch, cold, N readers, order announced", "files/s", "raw_small_get",
           only=CACHEFS),
    Figure("epoch_1r_cpu", "daemon CPU, shuffled epoch, 1 reader", "ms/file", "raw_small_get_cpu",
           higher_is_better=False),
    Figure("epoch_1r_announced_cpu", "daemon CPU, shuffled epoch, 1 reader, announced", "ms/file",
           "raw_small_get_cpu", higher_is_better=False, only=CACHEFS),
    Figure("hit_lru", "epochs 2x the disk tier: hit ratio, LRU", "share", "disk_fits", only=CACHEFS),
    Figure("hit_order", "epochs 2x the disk tier: hit ratio, announced", "share", "disk_fits", only=CACHEFS),
]
LIMITS = {
    "raw_get": "raw parallel ranged GET (MiB/s)",
    "page_cache": "page-cache read of a local file (MiB/s)",
    "local_disk_read": "local-disk read, page cache dropped (MiB/s)",
    "local_small_cold": "local small files, page cache dropped (files/s)",
    "local_small_warm": "local small files, page cache warm (files/s)",
    "local_list_cold": "local scandir + stat, caches dropped (entries/s)",
    "local_list_warm": "local scandir + stat, warm (entries/s)",
    "local_disk_write": "local-disk write + fsync + close (MiB/s)",
    "raw_multipart": "raw boto3 multipart upload (MiB/s)",
    "rss_budget": f"RAM tier + {RSS_HEADROOM_MIB} MiB (MiB)",
    "raw_get_cpu": "CPU of the raw parallel ranged GET (CPU-s/GiB)",
    "raw_small_get": "raw parallel small GET, 16 in flight (files/s)",
    "raw_small_get_cpu": "CPU of the raw parallel small GET (ms/file)",
    "disk_fits": "share of the small-file dataset the hit-ratio run's disk tier holds",
}


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


class Bench:
    def __init__(self, args: argparse.Namespace, server: SeaweedS3, work: Path) -> None:
        self.args = args
        self.server = server
        self.work = work
        self.size = args.size
        self.data = b""
        self.names = [f"f{i:05d}.bin" for i in range(args.files)]
        self.small_bytes = args.files * args.file_size
        self.hit_rows: list[dict[str, Any]] = []
        self.samples: dict[str, dict[str, list[float]]] = {}
        self.limits: dict[str, list[float]] = {}
        self.errors: dict[str, list[str]] = {}
        self.unavailable: dict[str, str] = {}
        # --keep-page-cache: drop_caches is system-wide, so a run beside other work (the test suite's
        # smoke test) must not take every other process's cached pages away.
        self.can_drop = not args.keep_page_cache
        self.log: list[str] = []

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        self.log.append(line)
        print(line, flush=True)

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
        self.say(f"datasets: {format_size(self.size)} object + {args.files} x {format_size(args.file_size)}, "
                 f"uploaded in {time.perf_counter() - begin:.1f} s")

    # -- limits -----------------------------------------------------------------------------------

    def drop(self) -> None:
        if not self.can_drop:
            return
        if not drop_page_cache():
            self.can_drop = False

    @staticmethod
    def settle() -> None:
        """Write back what earlier phases left dirty, so a timed phase does not pay for their disk I/O.

        Every tool gets it at the same points (before the warm re-read and before the write); the
        limits are measured on a system just as quiet (after a drop, which syncs too).
        """
        os.sync()

    def measure_limits(self, run: int) -> None:
        local = self.work / "local"
        add = lambda key, value: self.limits.setdefault(key, []).append(value)  # noqa: E731
        self.drop()
        add("local_disk_read", read_mib_s(local / "big.bin"))
        read_mib_s(local / "big.bin")
        add("page_cache", read_mib_s(local / "big.bin"))
        scratch = self.work / "local-write.bin"
        add("local_disk_write", self.size / write_seconds(scratch, self.data, fsync=True) / MiB)
        scratch.unlink()
        rate, cpu, total = asyncio.run(raw_parallel_get_cost(self.server, BUCKET, "", [BIG_KEY], DEFAULT_BLOCK_SIZE))
        add("raw_get", rate)
        add("raw_get_cpu", cpu / (total / GiB))
        rate, cpu, total = asyncio.run(raw_parallel_get_cost(self.server, BUCKET, SMALL_DIR + "/", self.names,
                                                             DEFAULT_BLOCK_SIZE))
        add("raw_small_get", rate * MiB / self.args.file_size)
        add("raw_small_get_cpu", cpu * 1000 / len(self.names))
        add("disk_fits", min(1.0, self.hit_disk_bytes() / self.small_bytes))
        key = f"raw/multipart-{run}.bin"
        seconds = raw_multipart_upload(self.server, BUCKET, key, self.data, part_size=PART_SIZE, parallel=PARTS_IN_FLIGHT)
        add("raw_multipart", self.size / seconds / MiB)
        self.server.delete(BUCKET, key)
        paths = [local / SMALL_DIR / name for name in self.names]
        self.drop()
        add("local_list_cold", list_pass(local / SMALL_DIR, len(self.names)))
        add("local_list_warm", list_pass(local / SMALL_DIR, len(self.names)))
        self.drop()
        add("local_small_cold", small_pass(paths, self.args.file_workers))
        add("local_small_warm", small_pass(paths, self.args.file_workers))
        add("rss_budget", self.args.ram_cache / MiB + RSS_HEADROOM_MIB)
        self.say("limits: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in self.limits.items()))

    # -- one tool, one run ------------------------------------------------------------------------

    def measure_tool(self, tool: Tool, run: int) -> None:
        got: dict[str, float] = {}
        rss: list[float] = []
        base = self.work / f"{tool.name}-{run}"
        mnt = base / "mnt"
        mnt.mkdir(parents=True)

        def note_rss(pid: int) -> None:
            rss.append(peak_rss_mib(pid))

        # 1-3: the large object: cold, warm, then from the disk tier after a remount.
        cache = base / "cache-read"
        self.drop()
        with tool.mounted(mnt, cache) as m:
            cpu = epochs.process_cpu_s(m.pid)
            got["cold_read"] = read_mib_s(mnt / BIG_KEY)
            got["cold_read_cpu"] = (epochs.process_cpu_s(m.pid) - cpu) / (self.size / GiB)
            self.settle()
            got["warm_read"] = read_mib_s(mnt / BIG_KEY)
            note_rss(m.pid)
        self.drop()
        with tool.mounted(mnt, cache) as m:
            got["disk_tier_read"] = read_mib_s(mnt / BIG_KEY)
            note_rss(m.pid)
        shutil.rmtree(cache, ignore_errors=True)

        # 5: listing (before the small-file pass, which would warm the metadata).
        cache = base / "cache-list"
        self.drop()
        with tool.mounted(mnt, cache) as m:
            got["list_cold"] = list_pass(mnt / SMALL_DIR, len(self.names))
            got["list_warm"] = list_pass(mnt / SMALL_DIR, len(self.names))
            note_rss(m.pid)
        shutil.rmtree(cache, ignore_errors=True)

        # 4: small files, by name (as a data loader with a file list does).
        cache = base / "cache-small"
        self.drop()
        with tool.mounted(mnt, cache) as m:
            paths = [mnt / SMALL_DIR / name for name in self.names]
            got["small_cold"] = small_pass(paths, self.args.file_workers)
            got["small_warm"] = small_pass(paths, self.args.file_workers)
            note_rss(m.pid)
        shutil.rmtree(cache, ignore_errors=True)

        # 4b: shuffled epochs (issue 15), each on a fresh mount.
        got.update(self.measure_epochs(tool, base, mnt))
        if tool.name == "cachefs":
            got.update(self.measure_hit_ratio(tool, run))

        # 6: write the large file and wait for it to be in the store.
        cache = base / "cache-write"
        key = f"written-{tool.name}-{run}.bin"
        client = self.server.client()
        self.settle()
        with tool.mounted(mnt, cache) as m:
            wrote = write_seconds(mnt / key, self.data, fsync=False)
            start = time.perf_counter()
            tool.settle(m, DRAIN_TIMEOUT_S)
            wait_stored(client, BUCKET, key, self.size, DRAIN_TIMEOUT_S)
            drained = time.perf_counter() - start
            note_rss(m.pid)
        self.server.delete(BUCKET, key)
        shutil.rmtree(cache, ignore_errors=True)
        got["write_close"] = self.size / wrote / MiB
        got["drain"] = self.size / drained / MiB
        got["write_to_store"] = self.size / (wrote + drained) / MiB

        # 7: the highest VmHWM of the daemons of this run.
        got["peak_rss"] = max(rss)
        shutil.rmtree(base, ignore_errors=True)
        for key_, value in got.items():
            self.samples.setdefault(tool.name, {}).setdefault(key_, []).append(value)
        self.say(f"{tool.name} run {run + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()))

    def measure_epochs(self, tool: Tool, base: Path, mnt: Path) -> dict[str, float]:
        got: dict[str, float] = {}
        order = [f"{SMALL_DIR}/{name}" for name in epochs.shuffled(self.names, epochs.SEED)]
        modes = [False, True] if tool.name == "cachefs" else [False]
        for readers, label in ((1, "1r"), (self.args.epoch_readers, "nr")):
            for announce in modes:
                key = f"epoch_{label}" + ("_announced" if announce else "")
                cache = base / f"cache-{key}"
                with tool.mounted(mnt, cache) as m:
                    rate, cpu_ms = epochs.timed_epoch(mnt, m.pid, order, readers, announce=announce,
                                                      expected_bytes=self.small_bytes)
                shutil.rmtree(cache, ignore_errors=True)
                got[key] = rate
                if readers == 1:
                    got[key + "_cpu"] = cpu_ms
        return got

    def hit_disk_bytes(self) -> int:
        """The hit-ratio run's disk tier: half the small-file dataset (at least two blocks)."""
        return max(self.small_bytes // 2, 2 * DEFAULT_BLOCK_SIZE)

    def measure_hit_ratio(self, tool: Tool, run: int) -> dict[str, float]:
        """cachefs only: --epochs shuffled epochs over a dataset twice the disk tier, LRU vs announced."""
        narrow = CachefsTool(self.server, BUCKET, self.work, ram_bytes=epochs.SMALL_RAM, disk_bytes=self.hit_disk_bytes())
        relative = [f"{SMALL_DIR}/{name}" for name in self.names]
        got: dict[str, float] = {}
        for announce, key in ((False, "hit_lru"), (True, "hit_order")):
            base = self.work / f"hit-{key}-{run}"
            mnt = base / "mnt"
            mnt.mkdir(parents=True)
            with narrow.mounted(mnt, base / "cache"):
                rows = epochs.hit_ratio_run(mnt, relative, self.args.epochs, self.args.epoch_readers,
                                            announce=announce, expected_bytes=self.small_bytes)
            shutil.rmtree(base, ignore_errors=True)
            self.hit_rows.append({"run": run + 1, "policy": "announced" if announce else "lru", "epochs": rows})
            ratio_ = epochs.later_epochs_hit_ratio(rows)
            if ratio_ is not None:
                got[key] = ratio_
        return got

    def run(self, tools: list[Tool]) -> None:
        for tool in tools:
            reason = tool.unavailable_reason()
            if reason:
                self.unavailable[tool.name] = reason
                self.say(f"{tool.name}: unavailable: {reason}")
        live = [t for t in tools if t.name not in self.unavailable]
        for run in range(self.args.runs):
            self.measure_limits(run)
            order = live[run % len(live):] + live[:run % len(live)] if live else []
            for tool in order:
                if tool.name in self.unavailable:
                    continue
                try:
                    self.measure_tool(tool, run)
                except (PeerError, OSError, RuntimeError, TimeoutError, ValueError, subprocess.SubprocessError) as exc:
                    text = f"run {run + 1}: {type(exc).__name__}: {exc}"
                    self.errors.setdefault(tool.name, []).append(text + "\n" + traceback.format_exc())
                    self.say(f"{tool.name} {text}")
                    if tool.name not in self.samples:
                        self.unavailable[tool.name] = f"failed in run {run + 1}: {type(exc).__name__}: {exc}"


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


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(bench: Bench, tools: list[Tool], args: argparse.Namespace, started: str) -> dict[str, Any]:
    med = lambda values: statistics.median(values) if values else None  # noqa: E731
    limits = {k: med(v) for k, v in bench.limits.items()}
    medians = {t: {k: med(v) for k, v in figs.items()} for t, figs in bench.samples.items()}
    names = [t.name for t in tools]
    figures: dict[str, Any] = {}
    for fig in FIGURES:
        title = fig.title.replace("N readers", f"{args.epoch_readers} readers")
        entry: dict[str, Any] = {"title": title, "unit": fig.unit, "only": list(fig.only or names), "limit": fig.limit, "limit_median": limits.get(fig.limit),
                                 "higher_is_better": fig.higher_is_better, "tools": {}}
        for name in names:
            value = medians.get(name, {}).get(fig.key)
            entry["tools"][name] = {
                "median": value,
                "samples": bench.samples.get(name, {}).get(fig.key, []),
                "ratio_to_limit": ratio(value, limits.get(fig.limit)),
                "ratio_to_peers": {peer: ratio(value, medians.get(peer, {}).get(fig.key)) for peer in names if peer != name},
            }
        figures[fig.key] = entry
    return {
        "started": started,
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "parameters": {"size": args.size, "files": args.files, "file_size": args.file_size, "runs": args.runs,
                       "tools": names, "ram_cache": args.ram_cache, "file_workers": args.file_workers,
                       "epoch_readers": args.epoch_readers, "epochs": args.epochs,
                       "hit_ratio_disk": bench.hit_disk_bytes(), "hit_ratio_ram": epochs.SMALL_RAM},
        "hit_ratio_runs": bench.hit_rows,
        "machine": machine_info(),
        "page_cache_dropped": bench.can_drop,
        "versions": {t.name: (None if t.name in bench.unavailable else safe_version(t)) for t in tools},
        "unavailable": bench.unavailable,
        "errors": bench.errors,
        "limits": {k: {"median": limits[k], "samples": v, "title": LIMITS[k]} for k, v in bench.limits.items()},
        "figures": figures,
        "targets": targets(figures, names),
    }


def safe_version(tool: Tool) -> str:
    try:
        return tool.version()
    except Exception as exc:  # a version string is decoration: never fail a finished run over it
        return f"? ({type(exc).__name__})"


def targets(figures: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """The targets of issue 6, each PASS, MISS or n/a (a figure or a peer is missing)."""
    def value(fig: str, tool: str = "cachefs") -> float | None:
        return figures[fig]["tools"].get(tool, {}).get("median")

    def limit(fig: str) -> float | None:
        return figures[fig]["limit_median"]

    peers = [n for n in names if n != "cachefs"]

    def best_peer(fig: str) -> tuple[str | None, float | None]:
        found = [(p, value(fig, p)) for p in peers if value(fig, p)]
        return max(found, key=lambda pv: pv[1]) if found else (None, None)

    out = []

    def check(name: str, measured: float | None, wanted: float, against: str, strict: bool = False) -> None:
        passed = measured is not None and (measured > wanted if strict else measured >= wanted)
        status = "n/a" if measured is None else ("PASS" if passed else "MISS")
        out.append({"target": name, "measured": measured, "wanted": wanted, "against": against, "status": status})

    check("warm re-read >= 0.80x page cache", ratio(value("warm_read"), limit("warm_read")), 0.80, "page_cache")
    check("cold read >= 0.90x raw GET", ratio(value("cold_read"), limit("cold_read")), 0.90, "raw_get")
    peer, peer_value = best_peer("cold_read")
    check("cold read >= 1.5x the faster peer", ratio(value("cold_read"), peer_value), 1.5, peer or "no peer")
    check("disk-tier read >= 0.80x local-disk read", ratio(value("disk_tier_read"), limit("disk_tier_read")), 0.80,
          "local_disk_read")
    peer, peer_value = best_peer("small_warm")
    check("small files warm >= 2x the faster peer", ratio(value("small_warm"), peer_value), 2.0, peer or "no peer")
    check("listing warm >= 10x listing cold", ratio(value("list_warm"), value("list_cold")), 10.0, "cachefs list_cold")
    check("write + close >= 0.5x local-disk write", ratio(value("write_close"), limit("write_close")), 0.5,
          "local_disk_write")
    check("drain >= 0.8x raw multipart", ratio(value("drain"), limit("drain")), 0.8, "raw_multipart")
    rss, budget = value("peak_rss"), limit("peak_rss")
    # Expressed as budget / RSS so that, like the others, >= 1.0 passes.
    check(f"daemon RSS <= RAM tier + {RSS_HEADROOM_MIB} MiB", ratio(budget, rss), 1.0, "rss_budget")
    # Issue 15. "Today's cold rate" is cachefs's own in-order small-file cold read of the same run.
    check("announced epoch, 1 reader >= 5x the cold small-file rate",
          ratio(value("epoch_1r_announced"), value("small_cold")), 5.0, "cachefs small_cold")
    check("announced epoch, 1 reader >= 0.8x raw small GET",
          ratio(value("epoch_1r_announced"), limit("epoch_1r_announced")), 0.8, "raw_small_get")
    check("announced epoch, N readers >= 0.8x raw small GET",
          ratio(value("epoch_nr_announced"), limit("epoch_nr_announced")), 0.8, "raw_small_get")
    check("announced epoch, 1 reader > not announced", ratio(value("epoch_1r_announced"), value("epoch_1r")), 1.0,
          "cachefs epoch_1r", strict=True)
    check("hit ratio, announced > LRU", ratio(value("hit_order"), value("hit_lru")), 1.0, "cachefs hit_lru",
          strict=True)
    check("hit ratio, announced >= 0.9x the share that fits", ratio(value("hit_order"), limit("hit_order")), 0.9,
          "disk_fits")
    return out


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if abs(value) < 100_000 else f"{value:,.0f}"


def markdown(result: dict[str, Any]) -> str:
    names = result["parameters"]["tools"]
    p = result["parameters"]
    lines = [
        "# cachefs side-by-side benchmark",
        "",
        (f"{result['started']} · {p['runs']} run(s), medians · large file {format_size(p['size'])} · "
         f"{p['files']} files of {format_size(p['file_size'])} · RAM tier {format_size(p['ram_cache'])} · "
         f"{result['machine']['cpus']} CPUs, {result['machine']['mem_total_mib']} MiB · kernel {result['machine']['kernel']}"),
        "",
    ]
    for name, reason in result["unavailable"].items():
        lines.append(f"- **{name}: unavailable: {reason}**")
    if not result["page_cache_dropped"]:
        lines.append("- the page cache was not dropped (not root, or --keep-page-cache): cold and disk-tier figures are warm")
    lines.append("")
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    header = ["figure", "unit", "limit"] + [f"{n} (x limit)" for n in names] + [f"{a} / {b}" for a, b in pairs]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for fig in result["figures"].values():
        row = [fig["title"] + ("" if fig["higher_is_better"] else " (lower is better)"), fig["unit"], fmt(fig["limit_median"])]
        for n in names:
            t = fig["tools"][n]
            row.append("—" if t["median"] is None else f"{fmt(t['median'])} ({fmt(t['ratio_to_limit'], 2)}x)")
        for a, b in pairs:
            r = fig["tools"][a]["ratio_to_peers"].get(b)
            row.append("—" if r is None else fmt(r, 2) + "x")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Limits", "", "| limit | median | samples |", "|---|---|---|"]
    for lim in result["limits"].values():
        lines.append(f"| {lim['title']} | {fmt(lim['median'])} | {', '.join(fmt(s) for s in lim['samples'])} |")
    lines += ["", "## Targets (cachefs)", "", "| target | measured | wanted | against | result |", "|---|---|---|---|---|"]
    for t in result["targets"]:
        measured = "—" if t["measured"] is None else f"{fmt(t['measured'], 2)}x"
        lines.append(f"| {t['target']} | {measured} | {t['wanted']}x | {t['against']} | **{t['status']}** |")
    lines += hit_ratio_markdown(result)
    lines += ["", ("Notes: drain is the time from close() until the object is in the store; s3fs uploads inside "
                   "close(), so its drain is only the HEAD check and its upload shows in write + close. "
                   "Peak RSS is compared with the cachefs budget for every tool (the peers have no RAM tier). "
                   "CPU figures are the daemon process's user + system time (/proc/PID/stat) over the timed span; "
                   "their limit is the CPU the harness itself spent on the raw parallel GETs (the engine's fetch "
                   "code, no FUSE). On a shared machine, ratios measured in one run and CPU per unit of work "
                   "vary less than the rates."),
              f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}.", ""]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result["parameters"]["tools"]
    figs = list(result["figures"].values())
    fig, ax = plt.subplots(figsize=(14, 6))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ys = []
        for f in figs:
            r = f["tools"][name]["ratio_to_limit"]
            if not r:
                ys.append(float("nan"))  # not measured for this tool (e.g. an announced order: cachefs only)
                continue
            ys.append(1 / r if not f["higher_is_better"] else r)
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(figs))]
        ax.bar(xs, [min(y, CHART_CLIP) for y in ys], width, label=name)
        for x, y in zip(xs, ys):
            if y > CHART_CLIP:  # e.g. s3fs's drain, which happens inside close(): label, do not scale
                ax.annotate(f"{y:,.0f}x", (x, CHART_CLIP), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(figs)))
    ax.set_xticklabels([f["title"] + ("\n(limit/value)" if not f["higher_is_better"] else "") for f in figs],
                       rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("figure / its limit (log; 1 = the limit)")
    ax.set_title(f"cachefs vs peers, normalised to each figure's limit ({result['parameters']['runs']} run(s), medians)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result))
    chart(result, out / "results.png")


# -- entry point ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="the large file (e.g. 1GiB, 8MiB)")
    parser.add_argument("--files", type=int, default=10_000, help="small files (and listing entries)")
    parser.add_argument("--file-size", type=parse_size, default=parse_size("100KiB"), help="size of each small file")
    parser.add_argument("--runs", type=int, default=3, help="runs; each figure is the median")
    parser.add_argument("--tools", default="cachefs,rclone,s3fs", help="comma-separated, from: " + ",".join(TOOLS))
    parser.add_argument("--ram-cache", type=parse_size, default=parse_size("1GiB"), help="cachefs RAM tier")
    parser.add_argument("--file-workers", type=int, default=1, help="threads reading small files")
    parser.add_argument("--epoch-readers", type=int, default=8,
                        help="threads reading the shuffled epochs besides the 1-reader one (DataLoader workers)")
    parser.add_argument("--epochs", type=int, default=3, help="shuffled epochs of the hit-ratio run (>= 2)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="never drop the system's page cache (for runs beside other work; cold figures are then warm)")
    parser.add_argument("--workdir", type=Path, default=None, help="mounts, caches and local copies (default: a temp dir)")
    args = parser.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        parser.error(f"--tools: unknown {unknown}; choose from {','.join(TOOLS)}")
    if (args.size < MiB or args.files < 1 or args.file_size < 128 or args.runs < 1 or args.file_workers < 1
            or args.epoch_readers < 1 or args.epochs < 2):
        parser.error("--size >= 1MiB, --files >= 1, --file-size >= 128, --runs >= 1, --file-workers >= 1, "
                     "--epoch-readers >= 1, --epochs >= 2")
    args.tool_names = tools
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="cachefs-bench-", dir=args.workdir) as tmp, SeaweedS3() as server:
        work = Path(tmp)
        disk = DISK_SLACK * (args.size + args.files * args.file_size) + 256 * MiB
        tools = [TOOLS[name](server, BUCKET, work, ram_bytes=args.ram_cache, disk_bytes=disk) for name in args.tool_names]
        bench = Bench(args, server, work)
        bench.generate()
        bench.run(tools)
        result = summarise(bench, tools, args, started)
    write_results(result, args.out)
    print(markdown(result))
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'results.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
