"""``cachefs stats``: the daemon's ``/stats`` document as a table, as JSON, or sampled live.

``--watch S`` samples every S seconds and shows per-second rates between two samples: bytes read
through the mount, block hits (RAM or disk) and misses (blocks fetched from the store), and bytes
fetched from the store (``rates``, a pure function of two documents). On a terminal the table is
redrawn in place (rich); anywhere else (a pipe, a file, ``watch``-less logging) each sample is one
plain line, flushed at once, with no terminal control codes, so ``cachefs stats --watch 1 | tee``
works. ``--json --watch`` prints one compact JSON document per line, with the rates under
``"rates"``.

Every view ends with what the cache saved: the bytes and requests of reads that did not reach the
source (served by RAM, disk or the cluster tier, from the daemon's ``traffic`` section; the first
read of a block that read-ahead or a warm brought from the source counts as the source's) and the
shares of the bytes read served locally (RAM + disk), by the cluster tier and by the source. The
one hit ratio shown (``hit_ratio``, docs/statistics.md) is the share not served by the source.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from cachefs.cli.argtypes import seconds
from cachefs.client import call, mount_holding
from tiering.units import format_size

# Shortest sampling interval: each sample is one control request answered from memory; five a second
# is plenty for a human and costs the daemon nothing measurable.
MIN_WATCH_INTERVAL_S = 0.2


def register(sub: Any) -> None:
    s = sub.add_parser("stats", help="show cache statistics of a mount")
    s.add_argument("mountpoint", type=Path, metavar="PATH", help="the mountpoint, or any path inside the mount")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--watch", type=seconds, default=None, metavar="S",
                   help="sample every S seconds and show per-second rates (plain lines when not on a terminal)")


def fetch_stats(mountpoint: Path) -> dict[str, Any]:
    return call(mountpoint, "/stats")


def _counters(stats: dict[str, Any]) -> dict[str, float]:
    blocks = stats.get("blocks", {})
    return {
        "read_bytes": stats.get("filesystem", {}).get("read_bytes", 0),
        "hits": blocks.get("ram_served", 0) + blocks.get("disk_served", 0) + blocks.get("cluster_served", 0),
        "misses": blocks.get("fetched", 0),
        "fetched_bytes": stats.get("object_store", {}).get("bytes_read", 0),
    }


def rates(previous: dict[str, Any], current: dict[str, Any], elapsed_s: float) -> dict[str, float]:
    """Per-second rates between two ``/stats`` documents taken ``elapsed_s`` apart (0 when no time
    passed; a counter that went back, after a daemon restart, counts from zero)."""
    before, after = _counters(previous), _counters(current)
    if elapsed_s <= 0:
        return {f"{name}_per_s": 0.0 for name in after}
    return {f"{name}_per_s": max(after[name] - before[name], 0) / elapsed_s for name in after}


def rate_line(r: dict[str, float]) -> str:
    return (f"read {format_size(int(r['read_bytes_per_s']))}/s, hits {r['hits_per_s']:.1f}/s, "
            f"misses {r['misses_per_s']:.1f}/s, fetched {format_size(int(r['fetched_bytes_per_s']))}/s")


def plain_line(stats: dict[str, Any], r: dict[str, float] | None) -> str:
    """One sample as one line: the time, the rates, then tier usage and the hit ratio."""
    tiers = ", ".join(f"{name} {format_size(t['used_bytes'])}/{format_size(t['capacity_bytes'])}"
                      for name, t in sorted(stats.get("tiers", {}).items()))
    head = time.strftime("%H:%M:%S")
    body = rate_line(r) if r is not None else "first sample"
    line = f"{head} {body}; {tiers}; hit ratio {stats.get('hit_ratio', 0.0):.1%}"
    saved = savings_line(stats)
    return line if saved is None else f"{line}; {saved}"


def savings_line(stats: dict[str, Any]) -> str | None:
    """What the cache saved this mount: bytes and requests of reads that never reached the source
    (answered by RAM, disk or the cluster tier) and the hit ratios by bytes; None from a daemon
    without the ``traffic`` section (an older version)."""
    traffic = stats.get("traffic")
    if not isinstance(traffic, dict):
        return None
    served = traffic.get("served_bytes", {})
    ratios = traffic.get("hit_ratios", {})
    by_tier = ", ".join(f"{tier} {format_size(served.get(tier, 0))}" for tier in ("ram", "disk", "cluster", "source"))
    return (f"saved: {format_size(traffic.get('avoided_source_bytes', 0))} and "
            f"{traffic.get('avoided_source_requests', 0)} requests did not reach the source "
            f"(reads served: {by_tier}); of the bytes read, local {ratios.get('local', 0.0):.1%}, "
            f"cluster {ratios.get('cluster', 0.0):.1%}, source {ratios.get('source', 0.0):.1%}")


def render_stats(stats: dict[str, Any], r: dict[str, float] | None = None) -> Any:
    from rich.table import Table

    table = Table(title="cachefs", show_edge=False)
    for column in ("tier", "used", "capacity", "entries", "hits", "misses", "evictions", "errors"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    order = {"ram": 0, "disk": 1}
    for name, tier in sorted(stats["tiers"].items(), key=lambda item: order.get(item[0], 2)):
        label = name + (f" ({tier['state']})" if tier.get("state", "healthy") != "healthy" else "")
        table.add_row(label, format_size(tier["used_bytes"]), format_size(tier["capacity_bytes"]),
                      str(tier["entries"]), str(tier["hits"]), str(tier["misses"]), str(tier["evictions"]),
                      str(tier["errors"]))
    cluster = stats.get("cluster")
    if cluster is not None:  # shared, remote: no local size to show
        label = "cluster" + (f" ({cluster['state']})" if cluster.get("state", "healthy") != "healthy" else "")
        table.add_row(label, "-", "-", "-", str(cluster["hits"]), str(cluster["misses"]), "-", str(cluster["errors"]))
    store = stats["object_store"]
    table.caption = (f"object store: {store['requests']} requests, {format_size(store['bytes_read'])} read, "
                     f"{store['errors']} errors  |  hit ratio {stats['hit_ratio']:.1%}")
    saved = savings_line(stats)
    if saved is not None:
        table.caption += "\n" + saved
    health = stats.get("store_health")
    if health is not None and health.get("state") != "reachable":
        table.caption += f"\nobject store UNREACHABLE for {health.get('unreachable_for_s', 0):.0f} s"
    wb = stats.get("writeback")
    if wb is not None:
        table.caption += (f"\nwrite-back: {wb['dirty_files']} dirty files ({format_size(wb['dirty_bytes'])}), "
                          f"{wb['uploads_in_flight']} uploading, {format_size(wb['bytes_uploaded'])} uploaded, "
                          f"{wb['failed_attempts']} failed attempts, store {wb['store_state']}")
        if wb.get("oldest_unuploaded_age_s"):
            table.caption += f", oldest version not in the store {wb['oldest_unuploaded_age_s']:.0f} s old"
    if cluster is not None:
        wb = cluster.get("write_behind", {})
        table.caption += (f"\ncluster tier {cluster.get('url', '')}: {cluster['corrupt_blocks']} corrupt blocks, "
                          f"{cluster['inserts']} written; write-behind {wb.get('depth', 0)} queued "
                          f"({format_size(wb.get('queued_bytes', 0))}, {wb.get('deferred_now', 0)} of them to be "
                          f"read back from disk), {wb.get('dropped', 0)} dropped")
    if r is not None:
        table.caption += f"\nnow: {rate_line(r)}"
    return table


def watch_plain(sample: Callable[[], dict[str, Any]], interval_s: float, out: TextIO, *, as_json: bool,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                samples: int | None = None) -> None:
    """Print one line per sample to ``out``, flushed; ``samples`` bounds the loop (tests), None: forever."""
    previous: tuple[float, dict[str, Any]] | None = None
    taken = 0
    while samples is None or taken < samples:
        if taken:
            sleep(interval_s)
        now, stats = clock(), sample()
        r = rates(previous[1], stats, now - previous[0]) if previous is not None else None
        if as_json:
            out.write(json.dumps({**stats, "rates": r}, sort_keys=True) + "\n")
        else:
            out.write(plain_line(stats, r) + "\n")
        out.flush()
        previous = (now, stats)
        taken += 1


def cmd_stats(args: argparse.Namespace) -> int:
    args.mountpoint = mount_holding(args.mountpoint)  # any path inside the mount names it
    if args.watch is None:
        if args.json:
            print(json.dumps(fetch_stats(args.mountpoint), indent=2, sort_keys=True))
            return 0
        from rich.console import Console

        Console().print(render_stats(fetch_stats(args.mountpoint)))
        return 0
    interval = max(args.watch, MIN_WATCH_INTERVAL_S)
    try:
        if args.json or not sys.stdout.isatty():
            watch_plain(lambda: fetch_stats(args.mountpoint), interval, sys.stdout, as_json=args.json)
            return 0
        from rich.console import Console
        from rich.live import Live

        stats, taken = fetch_stats(args.mountpoint), time.monotonic()
        with Live(render_stats(stats), console=Console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                current, now = fetch_stats(args.mountpoint), time.monotonic()
                live.update(render_stats(current, rates(stats, current, now - taken)), refresh=True)
                stats, taken = current, now
    except KeyboardInterrupt:
        return 0
