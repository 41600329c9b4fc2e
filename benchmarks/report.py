"""The benchmark's results: what each figure is, the summary (JSON), the tables (Markdown) and the chart.

``summarise`` turns a finished ``benchmarks.bench.Bench`` into one JSON-able dict: per figure the
median of each tool over the rounds, its ratio to the limit and to each peer, the median CPU and
busiest-thread CPU; the engines table (each engine's medians) and the limits taken from it (the
fastest engine's rate, the cheapest engine's CPU: ``analysis.best_engine``); the rounds with their
load; the "limit beaten" list (``analysis.limit_beaten``) and every warning; the targets of issue 25.
``markdown`` and ``chart`` render that dict, and only that dict, so that a results.json from any
run can be rendered again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import analysis, epochs, fuse_layer, passthrough
from tiering.blocks import DEFAULT_BLOCK_SIZE
from tiering.units import format_size

if TYPE_CHECKING:
    from benchmarks.bench import Bench

# The RSS target: the RAM tier may be full, plus this much for the interpreter, the engine's tables
# and in-flight buffers (16 fetches of 8 MiB alone are 128 MiB at worst).
RSS_HEADROOM_MIB = 150
# The chart's y axis stops here; a bar above it is cut and labelled with its value.
CHART_CLIP = 20.0


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
    Figure("epoch_1r_announced_full", "shuffled epoch, cold, 1 reader, order announced, RAM tier a quarter of it",
           "files/s", "raw_small_get", only=CACHEFS, cost="file"),
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
# Who else spends CPU over a figure's span, kept beside the tool's own (``Bench.add``'s ``others``).
PAYERS = ("store", "reader")



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


def summarise(bench: Bench, tools: Sequence[Any], args: argparse.Namespace, started: str) -> dict[str, Any]:
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
                # What others spent over the same spans, per unit (the epochs: issue 35).
                **{who: analysis.median(s.get(who) for s in samples) for who in PAYERS
                   if any(s.get(who) is not None for s in samples)},
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
                       "small_get_threads": bench.small_get_threads, "part_size": DEFAULT_BLOCK_SIZE,
                       "ram_cache": args.ram_cache, "file_workers": args.file_workers,
                       "epoch_readers": args.epoch_readers, "epochs": args.epochs,
                       "hit_ratio_disk": bench.hit_disk_bytes(), "hit_ratio_ram": epochs.SMALL_RAM},
        "hit_ratio_runs": bench.hit_rows,
        "machine": machine_info(),
        "rounds": bench.rounds,
        "quiet": all(r["quiet"] for r in bench.rounds),
        "quiet_thresholds": {"loadavg_per_cpu": analysis.QUIET_LOADAVG_PER_CPU,
                             "foreign_busy": analysis.QUIET_FOREIGN_BUSY, "window_s": bench.quiet_window_s},
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


def safe_version(tool: Any) -> str:
    try:
        return tool.version()
    except Exception as exc:  # a version string is decoration: never fail a finished run over it
        return f"? ({type(exc).__name__})"


def targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 25's targets for cachefs (and those of the full set's figures), each PASS, MISS or n/a."""
    def tool(fig: str, name: str = "cachefs") -> dict[str, Any]:
        return figures.get(fig, {}).get("tools", {}).get(name, {})

    def value(fig: str, name: str = "cachefs") -> float | None:
        return tool(fig, name).get("median")

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

    # The large-file targets, for cachefs and (when it ran) for a mount with --direct-io.
    for name, label in (("cachefs", ""), ("cachefs-direct-io", "--direct-io: ")):
        if name != "cachefs" and not tool("cold_read", name):
            continue
        cold = tool("cold_read", name)
        check(f"{label}cold read >= 0.8x the fastest raw GET engine",
              ratio(value("cold_read", name), limit("cold_read")), 0.8, "raw_get")
        check(f"{label}daemon CPU, cold read <= 1.0 CPU-s/GiB", cold.get("cpu"), 1.0, "CPU-s/GiB", at_most=True)
        check(f"{label}busiest daemon thread, cold read <= 0.25 CPU-s/GiB", cold.get("busiest_thread"), 0.25,
              "CPU-s/GiB", at_most=True)
        check(f"{label}disk-tier read >= 0.8x local-disk read",
              ratio(value("disk_tier_read", name), limit("disk_tier_read")), 0.8, "local_disk_read")
    check("announced epoch, 1 reader >= 0.8x raw small GET",
          ratio(value("epoch_1r_announced"), limit("epoch_1r_announced")), 0.8, "raw_small_get")
    check("announced epoch, 1 reader >= 3x not announced", ratio(value("epoch_1r_announced"), value("epoch_1r")), 3.0,
          "cachefs epoch_1r")
    check("daemon CPU per cold file (announced epoch) <= 0.5 ms", tool("epoch_1r_announced").get("cpu"), 0.5,
          "CPU-ms/file", at_most=True)
    # The part of a cold file that one thread carries (the loop, which holds the GIL for it): what one
    # mount can never pass on any number of cores (issue 35).
    check("busiest daemon thread per cold file (announced epoch) <= 0.15 ms",
          tool("epoch_1r_announced").get("busiest_thread"), 0.15, "CPU-ms/file", at_most=True)
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
               f"{result['quiet_thresholds']['window_s']:g} s of idling before the round, after waiting up to "
               f"{analysis.SETTLE_MAX_S:g} s for the load average to settle (the harness's own previous round "
               "is still in it)."), "",
              "| round | tool order | waited for the load (s) | load average (1, 5, 15 min) | others' CPU | quiet |",
              "|---|---|---|---|---|---|"]
    for r in result["rounds"]:
        settled = r.get("settled_s")
        lines.append(f"| {r['round']} | {', '.join(r.get('order', []))} | {'' if settled is None else f'{settled:g}'} | "
                     f"{', '.join(f'{x:.2f}' for x in r['loadavg'])} | "
                     f"{r['foreign_busy']:.0%} | {'yes' if r['quiet'] else '**no**'} |")
    lines += ["", "## Targets (cachefs, issue 25)", "", "| target | measured | wanted | against | result |",
              "|---|---|---|---|---|"]
    for t in result["targets"]:
        x = "" if t["at_most"] or t["against"] == "rss_budget" else "x"
        measured = "—" if t["measured"] is None else f"{fmt(t['measured'], 2)}{x}"
        wanted = ("<= " if t["at_most"] else ">= ") + f"{fmt(t['wanted'], 2)}{x}"
        lines.append(f"| {t['target']} | {measured} | {wanted} | {t['against']} | **{t['status']}** |")
    lines += payers_markdown(result)
    lines += hit_ratio_markdown(result)
    lines += authorization_markdown(result)
    lines += fuse_layer.markdown(result.get("fuse_layer"))
    lines += passthrough.markdown(result.get("passthrough"))
    lines += ["", f"Versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items() if v)}.", ""]
    return "\n".join(lines)


def payers_markdown(result: dict[str, Any]) -> list[str]:
    """Who pays for a cold small file: the daemon, the S3 server and the reader, per file, and how many
    of the machine's CPUs their sum kept busy at the rate reached (issue 35: where the store's CPU
    binds on a small machine, this shows it)."""
    cpus = result["machine"].get("cpus") or 0
    rows = []
    for key in ("epoch_1r", "epoch_1r_announced", "epoch_1r_announced_full", "epoch_nr", "epoch_nr_announced"):
        fig = result["figures"].get(key)
        t = (fig or {}).get("tools", {}).get("cachefs") or {}
        if t.get("median") is None or t.get("cpu") is None or t.get("store") is None:
            continue
        total = t["cpu"] + t["store"] + (t.get("reader") or 0.0)
        busy = total * t["median"] / 1000.0
        rows.append(f"| {fig['title']} | {fmt(t['median'])} | {fmt(t['cpu'], 2)} | {fmt(t['busiest_thread'], 2)} | "
                    f"{fmt(t['store'], 2)} | {fmt(t.get('reader'), 2)} | {fmt(total, 2)} | "
                    f"{fmt(busy, 2)} of {cpus} |")
    if not rows:
        return []
    small = result["engines"].get("small", {})
    cheapest = min((e["cpu_ms_per_request"] for e in small.values() if e.get("cpu_ms_per_request")), default=None)
    return ["", "## Who pays for a cold small file (cachefs, issue 35)", "",
            "| epoch | files/s | daemon CPU-ms/file | its busiest thread | S3 server (SeaweedFS) | reader | all three "
            "| CPUs kept busy |", "|---|---|---|---|---|---|---|---|", *rows, "",
            ("Medians over the rounds, each over the epoch's span; the reader is the benchmark's own process "
             "(its reading threads and, announced, the announce call). CPUs kept busy: all three per file times "
             f"files/s. The raw small GET engines' own CPU per request is in the engine table (cheapest: "
             f"{fmt(cheapest, 2)} ms); the S3 server's CPU for those GETs is not measured there.")]


def authorization_markdown(result: dict[str, Any]) -> list[str]:
    """The cluster tier's source check: what it adds to the source's requests, epoch by epoch."""
    rows = result.get("cluster_authorization") or []
    if not rows:
        return []
    lines = ["", "## Cluster tier: the source check's extra requests (issue 34)", "",
             (f"{rows[0]['files']} of the small files, shuffled, read whole by a fresh node through the cluster "
              "tier (a first node filled it); each cluster hit is served only once the node's own source "
              "credentials have answered a one-byte GET of that object version. Exact counts, in-memory stores."), "",
             "| epoch | source HEADs | source GETs (the extra requests: one byte each) | proofs | blocks from the cluster tier |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['epoch']} | {r['source_heads']} | {r['source_gets']} | {r['proofs']} | {r['cluster_blocks']} |")
    return lines


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
