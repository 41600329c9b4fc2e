"""``cachefs stats``: the daemon's ``/stats`` document as a table, as JSON, or refreshed live."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from cachefs.cli.argtypes import seconds
from cachefs.client import call
from tiering.units import format_size


def register(sub: Any) -> None:
    s = sub.add_parser("stats", help="show cache statistics of a mount")
    s.add_argument("mountpoint", type=Path)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--watch", type=seconds, default=None, metavar="S", help="refresh every S seconds")


def fetch_stats(mountpoint: Path) -> dict[str, Any]:
    return call(mountpoint, "/stats")


def render_stats(stats: dict[str, Any]) -> Any:
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
    store = stats["object_store"]
    table.caption = (f"object store: {store['requests']} requests, {format_size(store['bytes_read'])} read, "
                     f"{store['errors']} errors  |  hit ratio {stats['hit_ratio']:.1%}")
    health = stats.get("store_health")
    if health is not None and health.get("state") != "reachable":
        table.caption += f"\nobject store UNREACHABLE for {health.get('unreachable_for_s', 0):.0f} s"
    wb = stats.get("writeback")
    if wb is not None:
        table.caption += (f"\nwrite-back: {wb['dirty_files']} dirty files ({format_size(wb['dirty_bytes'])}), "
                          f"{wb['uploads_in_flight']} uploading, {format_size(wb['bytes_uploaded'])} uploaded, "
                          f"{wb['failed_attempts']} failed attempts, store {wb['store_state']}")
    return table


def cmd_stats(args: argparse.Namespace) -> int:
    if args.json and args.watch is None:
        print(json.dumps(fetch_stats(args.mountpoint), indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if args.watch is None:
        console.print(render_stats(fetch_stats(args.mountpoint)))
        return 0
    interval = max(args.watch, 0.2)
    try:
        with Live(render_stats(fetch_stats(args.mountpoint)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                stats = fetch_stats(args.mountpoint)
                if args.json:
                    console.print_json(data=stats)
                else:
                    live.update(render_stats(stats), refresh=True)
    except KeyboardInterrupt:
        return 0
