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

Except where that would strand acknowledged writes: a cache directory whose write-back journal holds
records (staged writes a crashed or killed daemon never uploaded) must always mount far enough to
upload them, or a mount with fixed options (a systemd unit, a mount pod) would be refused forever
while another program keeps the disk full. Such a mount goes ahead with the disk cache shrunk to what
fits (never below what is staged there), and says so in one line naming the pending writes
(``fit_disk``); once they are uploaded and space is freed, a remount takes the size asked for.

RAM: more than ``MemTotal`` of ``/proc/meminfo`` is refused. Inside a container that is the host's
memory, not the cgroup limit, so the guard catches typos, not every over-commit.

The probes (free space, directory usage, total memory) are parameters, so the checks are tested with
fakes (STYLE.md point 8); ``check_resources`` with the defaults is what ``cachefs mount`` runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from dataclasses import dataclass

from cachefs.settings import MountSettings
from cachefs.sourcedir import STAGING_DIRNAME, staged_records
from tiering.tiers.disk import filesystem_free_bytes
from tiering.units import format_size
from tiering.writeback.journal import DATA_DIR

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


def pending_writes(staging: Path) -> tuple[int, int]:
    """``(records, staged bytes)`` of the write-back journal in ``staging`` (a source cache directory's
    ``staging/``): the acknowledged changes not yet uploaded, and the bytes their data takes."""
    records = staged_records(staging)
    return records, directory_bytes(staging / DATA_DIR) if records else 0


@dataclass(frozen=True)
class DiskFit:
    """What the disk check decided: refuse (``problem``), or mount with ``disk_bytes`` instead of the
    size asked for (``notice`` says why, in one line), or neither (it fits)."""

    problem: str | None = None
    disk_bytes: int | None = None
    notice: str | None = None


def fit_disk(disk_bytes: int, min_free_bytes: int, cache_dir: Path, staging: Path, *, block_size: int,
             free_bytes: Callable[[Path], int], used_bytes: Callable[[], int],
             pending: Callable[[Path], tuple[int, int]] = pending_writes) -> DiskFit:
    """``disk_problem``, except that a cache directory holding pending writes mounts with the disk
    cache that fits (at least what is staged, at least one block) so that they are uploaded."""
    problem = disk_problem(disk_bytes, min_free_bytes, cache_dir, free_bytes=free_bytes, used_bytes=used_bytes)
    if problem is None:
        return DiskFit()
    records, staged = pending(staging)
    if not records:
        return DiskFit(problem=problem)
    room = max(0, free_bytes(cache_dir) + used_bytes() - min_free_bytes)
    staged_blocks = -(-staged // block_size)  # what is staged stays: rounded up to whole blocks
    fits = max(room // block_size, staged_blocks, 1) * block_size
    notice = (f"{problem.removesuffix('; give a smaller --disk-cache or another --cache-dir')}; "
              f"{records} acknowledged change(s) ({format_size(staged)} staged) wait there for upload: "
              f"mounting with --disk-cache {format_size(fits)} so they are uploaded (free space and remount "
              f"for the size asked for)")
    return DiskFit(disk_bytes=fits, notice=notice)


def ram_problem(ram_bytes: int, mem_total: int | None) -> str | None:
    """Why ``ram_bytes`` cannot be a RAM cache on a machine with ``mem_total`` bytes, or None."""
    if mem_total is None or ram_bytes <= mem_total:
        return None
    return (f"--ram-cache {format_size(ram_bytes)} is more than this machine's memory "
            f"({format_size(mem_total)} MemTotal); give a smaller --ram-cache")


def check_resources(settings: MountSettings, *,
                    free_bytes: Callable[[Path], int] = filesystem_free_bytes,
                    usage: Callable[[Path], int] = directory_bytes,
                    mem_total: Callable[[], int | None] = mem_total_bytes,
                    pending: Callable[[Path], tuple[int, int]] = pending_writes) -> DiskFit:
    """Whether the caches of ``settings`` fit this machine: the first reason they cannot
    (``problem``), or the disk cache to mount with so that pending writes drain (``disk_bytes``)."""
    cache = settings.cache
    problem = ram_problem(cache.ram_bytes, mem_total())
    if problem:
        return DiskFit(problem=problem)
    return fit_disk(cache.disk_bytes, cache.disk_min_free_bytes, settings.cache_dir,
                    settings.source_cache_dir() / STAGING_DIRNAME, block_size=cache.block_size,
                    free_bytes=free_bytes, used_bytes=lambda: usage(settings.source_cache_dir()), pending=pending)
