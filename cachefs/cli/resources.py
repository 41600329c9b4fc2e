"""Will the caches fit? The start-up guard against a ``--disk-cache`` or ``--ram-cache`` that cannot.

A disk cache larger than its filesystem would fill the disk and then fail writes in ways far from
their cause, and a RAM cache larger than the machine's memory ends with the OOM killer; both are
refused at ``cachefs mount`` with one line giving both figures, never capped silently (a cap would
hide a typo such as ``100TiB`` for ``100GiB``; STYLE.md point 7).

What counts as room on disk: the filesystem's free space (``f_bavail``: what an unprivileged writer
may use, so the root-reserved blocks stay for the system) plus what this source's cache directory
already holds there (its blocks and staged writes are part of the capacity, not in addition to it),
minus ``--min-free-space``, which the disk tier keeps free. The cache's own usage is measured only
when the free space alone is not enough, since walking a large cache directory takes a while.

RAM: more than ``MemTotal`` of ``/proc/meminfo`` is refused. Inside a container that is the host's
memory, not the cgroup limit, so the guard catches typos, not every over-commit.

The probes (free space, directory usage, total memory) are parameters, so the checks are tested with
fakes (STYLE.md point 8); ``check_resources`` with the defaults is what ``cachefs mount`` runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from cachefs.settings import MountSettings
from tiering.tiers.disk import filesystem_free_bytes
from tiering.units import format_size

MEMINFO = Path("/proc/meminfo")


def directory_bytes(path: Path) -> int:
    """Bytes of the regular files below ``path`` (0 if it does not exist); unreadable entries are skipped."""
    total = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(Path(entry.path))
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def mem_total_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` in bytes; None where it cannot be read (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * (1024 if len(fields) < 3 or fields[2].lower() == "kb" else 1)
    return None


def disk_problem(disk_bytes: int, min_free_bytes: int, cache_dir: Path, *,
                 free_bytes: Callable[[Path], int], used_bytes: Callable[[], int]) -> str | None:
    """Why ``disk_bytes`` (plus ``min_free_bytes`` kept free) cannot fit in ``cache_dir``, or None."""
    if disk_bytes == 0:
        return None
    free = free_bytes(cache_dir)
    if disk_bytes + min_free_bytes <= free:
        return None
    used = used_bytes()
    if disk_bytes + min_free_bytes <= free + used:
        return None
    keep = f", and --min-free-space keeps {format_size(min_free_bytes)} of it free" if min_free_bytes else ""
    return (f"--disk-cache {format_size(disk_bytes)} does not fit in {cache_dir}: its filesystem has "
            f"{format_size(free)} free and the cache already holds {format_size(used)} there{keep}; "
            f"give a smaller --disk-cache or another --cache-dir")


def ram_problem(ram_bytes: int, mem_total: int | None) -> str | None:
    """Why ``ram_bytes`` cannot be a RAM cache on a machine with ``mem_total`` bytes, or None."""
    if mem_total is None or ram_bytes <= mem_total:
        return None
    return (f"--ram-cache {format_size(ram_bytes)} is more than this machine's memory "
            f"({format_size(mem_total)} MemTotal); give a smaller --ram-cache")


def check_resources(settings: MountSettings, *,
                    free_bytes: Callable[[Path], int] = filesystem_free_bytes,
                    usage: Callable[[Path], int] = directory_bytes,
                    mem_total: Callable[[], int | None] = mem_total_bytes) -> str | None:
    """The first reason the caches of ``settings`` cannot fit this machine, or None."""
    cache = settings.cache
    problem = ram_problem(cache.ram_bytes, mem_total())
    if problem:
        return problem
    return disk_problem(cache.disk_bytes, cache.disk_min_free_bytes, settings.cache_dir, free_bytes=free_bytes,
                        used_bytes=lambda: usage(settings.source_cache_dir()))
