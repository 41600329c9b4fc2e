"""Shuffled small-file epochs for the side-by-side benchmark (``benchmarks.bench``), issue 15's figures.

What a training loader does to a mount: read every file of a dataset whole, in a shuffled order, by
1 reader or by several at once (DataLoader workers). Here with the benchmark's small-file dataset
(``--files`` x ``--file-size``, 10,000 x 100 KiB by default), on a fresh mount each time (a new
FUSE superblock: nothing in the page cache, and nothing in the tool's own caches):

  epoch            files/s of one shuffled epoch (the same order for every tool), ``readers`` threads
  epoch announced  cachefs only: the order announced first (``cachefs.loader.announce``, timed too),
                   so the daemon fetches ahead of the readers within its window
  daemon CPU       user + system CPU of the daemon process over the epoch (/proc/PID/stat), per file:
                   a cost that holds across machines better than a rate

``hit_ratio_run``: a dataset twice the disk tier (the RAM tier only ``SMALL_RAM``), ``epochs``
shuffled epochs on one mount, each announced as it starts, against the same epochs on another mount
that is not told (LRU). Each file's pages are dropped from the page cache right after it is read
(``posix_fadvise(DONTNEED)`` on that one file: nothing system-wide), so every epoch reaches the
daemon. The hit ratio of an epoch is the share of its files served without a GET: one 100 KiB file
is one GET when it is not cached (announced: fetched ahead or read, either way one GET).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cachefs import loader
from cachefs.client import call

MiB = 1024 * 1024
# The hit-ratio run's RAM tier: almost nothing, so the disk tier's eviction policy decides.
SMALL_RAM = 8 * MiB
# The order every tool reads (the same shuffled permutation; epoch e of the hit-ratio run uses
# SEED + e).
SEED = 15
STREAM = "bench"


def shuffled(names: list[str], seed: int) -> list[str]:
    order = names[:]
    random.Random(seed).shuffle(order)
    return order


def read_whole(path: Path, drop: bool = False) -> int:
    """Bytes of ``path`` read to the end (then its pages dropped from the page cache if ``drop``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        n = 0
        while chunk := os.read(fd, 1 * MiB):
            n += len(chunk)
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return n
    finally:
        os.close(fd)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds the live process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def epoch(mnt: Path, relative: list[str], readers: int, *, announce: bool, drop: bool = False,
          expected_bytes: int | None = None) -> float:
    """Files/s of reading ``relative`` (paths under ``mnt``) in order with ``readers`` threads.

    With ``announce`` the order is announced first, inside the timed span.
    """
    paths = [mnt / p for p in relative]
    start = time.perf_counter()
    if announce:
        result = loader.announce(mnt, paths, stream=STREAM)
        if not result.ok:
            raise RuntimeError(f"announce: {result.missing_count} missing, {result.invalid_count} invalid paths")
    if readers <= 1:
        total = sum(read_whole(p, drop) for p in paths)
    else:
        with ThreadPoolExecutor(max_workers=readers) as pool:
            total = sum(pool.map(lambda p: read_whole(p, drop), paths))
    elapsed = time.perf_counter() - start
    if expected_bytes is not None and total != expected_bytes:
        raise RuntimeError(f"an epoch read {total} bytes, expected {expected_bytes}")
    return len(paths) / elapsed


def timed_epoch(mnt: Path, pid: int, relative: list[str], readers: int, *, announce: bool,
                expected_bytes: int) -> tuple[float, float]:
    """(files/s, daemon CPU ms per file) of one epoch."""
    cpu = process_cpu_s(pid)
    rate = epoch(mnt, relative, readers, announce=announce, expected_bytes=expected_bytes)
    return rate, (process_cpu_s(pid) - cpu) * 1000 / len(relative)


def stats(mnt: Path) -> dict[str, Any]:
    return call(mnt, "/stats")


def hit_ratio_run(mnt: Path, relative: list[str], epochs: int, readers: int, *, announce: bool,
                  expected_bytes: int) -> list[dict[str, float]]:
    """One row per epoch: files/s, GETs and the share of files served without a GET."""
    rows = []
    for e in range(epochs):
        order = shuffled(relative, SEED + 1 + e)
        before = stats(mnt)
        rate = epoch(mnt, order, readers, announce=announce, drop=True, expected_bytes=expected_bytes)
        after = stats(mnt)
        gets = after["object_store"]["get_requests"] - before["object_store"]["get_requests"]
        row = {"epoch": e + 1, "files_per_s": rate, "gets": gets, "hit_ratio": max(0.0, 1 - gets / len(order))}
        if announce:
            row["stalls"] = after["announce"]["stalls"] - before["announce"]["stalls"]
        rows.append(row)
    return rows


def later_epochs_hit_ratio(rows: list[dict[str, float]]) -> float | None:
    """The mean hit ratio of the epochs after the first (the first is cold for every policy)."""
    later = [r["hit_ratio"] for r in rows[1:]]
    return statistics.mean(later) if later else None
