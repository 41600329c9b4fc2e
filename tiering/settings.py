"""Typed, frozen, validated settings of the data engine. Built by the CLI; never read from argv here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiering.blocks import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, MiB
from tiering.units import format_size

GiB = 1024 * MiB

# RAM tier default: 1 GiB holds 128 default blocks, enough for read-ahead windows of several
# concurrent streams, and small next to the memory of a GPU training node.
DEFAULT_RAM_BYTES = 1 * GiB
# Disk tier default: 10 GiB is safe on any node; production mounts set it to the NVMe size.
DEFAULT_DISK_BYTES = 10 * GiB
# Disk tier watermarks: when usage crosses HIGH, evict down to LOW in one pass, so eviction runs in
# batches instead of on every insert, while the capacity itself is never exceeded.
DEFAULT_HIGH_WATERMARK = 0.95
DEFAULT_LOW_WATERMARK = 0.85
# Parallel ranged GETs in flight for one mount. 16 keeps a loopback SeaweedFS busy on a 2-core
# machine. Their blocks count against the RAM tier while in flight (tiering.engine.inflight).
DEFAULT_MAX_CONCURRENT_FETCHES = 16
# Upper bound accepted for it: past a thousand GETs in flight a mount only trips the store's request
# rate limits and holds that many blocks of memory.
MAX_CONCURRENT_FETCHES = 1024
# Read-ahead window: starts at one block and doubles on each sequential read, up to 128 MiB
# (16 default blocks): enough to keep every fetch slot busy for one stream.
DEFAULT_READAHEAD_MAX_BYTES = 128 * MiB
# A GET that has not completed in this time is failed with EIO: a reader never hangs on a dead store.
DEFAULT_FETCH_TIMEOUT_S = 30.0
# Pinned data may take at most this share of the disk tier by default: half keeps the other half
# for the working set of unpinned reads, so pinning a dataset never turns the tier into a thrashing
# buffer for everything else. ``--max-pinned`` changes it (up to the low watermark, see below).
DEFAULT_MAX_PINNED_FRACTION = 0.5

# The shared cluster tier (tiering.tiers.cluster), defined here so the CLI reads them without the tier.
# A cluster GET of one 8 MiB block inside the cluster takes tens of milliseconds; 5 s tolerates a
# loaded store and still leaves the source's 30 s fetch timeout most of its time.
DEFAULT_CLUSTER_TIMEOUT_S = 5.0
# Write-behind: blocks wait in memory until uploaded. 256 MiB (32 default blocks) absorbs a burst
# of cold reads at source speed while the in-cluster PUTs, faster than the source, catch up; the
# block count bounds the queue of small blocks.
DEFAULT_WRITE_BEHIND_BYTES = 256 * MiB
DEFAULT_WRITE_BEHIND_BLOCKS = 256
# Parallel uploads: an in-cluster PUT takes milliseconds; 4 in flight keep up with a source read at
# several hundred MB/s without competing with the readers' own GETs for connections.
DEFAULT_WRITE_BEHIND_WORKERS = 4
# Blocks offered to a full write-behind queue, remembered (their keys only, ~200 bytes each) to be
# uploaded from the disk tier once the queue has room: 65,536 blocks of 8 MiB are 512 GiB of reads.
DEFAULT_WRITE_BEHIND_DEFERRED = 65536


@dataclass(frozen=True)
class CacheSettings:
    block_size: int = DEFAULT_BLOCK_SIZE
    ram_bytes: int = DEFAULT_RAM_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    disk_dir: Path | None = None  # None: no disk tier
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    low_watermark: float = DEFAULT_LOW_WATERMARK
    max_concurrent_fetches: int = DEFAULT_MAX_CONCURRENT_FETCHES
    readahead_max_bytes: int = DEFAULT_READAHEAD_MAX_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    # Upper bound on pinned bytes (footprint on the disk tier); None: DEFAULT_MAX_PINNED_FRACTION of it.
    max_pinned_bytes: int | None = None
    # The disk tier evicts clean blocks when its filesystem's free space would fall below this
    # (rclone's --vfs-cache-min-free-space); 0: only the capacity bounds it.
    disk_min_free_bytes: int = 0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    def problems(self) -> list[str]:
        """What is wrong, one line each, naming the option (as ``cachefs mount`` spells it) and showing
        the value in the user's unit."""
        out: list[str] = []
        bs = format_size(self.block_size)
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            out.append(f"--block-size {bs} is outside {format_size(MIN_BLOCK_SIZE)} to {format_size(MAX_BLOCK_SIZE)}")
        for option, value in (("--ram-cache", self.ram_bytes), ("--disk-cache", self.disk_bytes),
                              ("--min-free-space", self.disk_min_free_bytes)):
            if value < 0:
                out.append(f"{option} must not be negative, got {value}")
        if 0 < self.ram_bytes < self.block_size:
            out.append(f"--ram-cache {format_size(self.ram_bytes)} is smaller than one block (--block-size {bs}): "
                       f"give at least {bs}, or 0 to turn the RAM tier off")
        if self.disk_dir is not None and 0 < self.disk_bytes < self.block_size:
            out.append(f"--disk-cache {format_size(self.disk_bytes)} is smaller than one block (--block-size {bs}): "
                       f"give at least {bs}, or 0 to turn the disk tier off")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            out.append("watermarks must satisfy 0 < low < high <= 1")
        if not 1 <= self.max_concurrent_fetches <= MAX_CONCURRENT_FETCHES:
            out.append(f"--max-fetches {self.max_concurrent_fetches} must be between 1 and {MAX_CONCURRENT_FETCHES}")
        if self.readahead_max_bytes < 0:
            out.append(f"--readahead must not be negative, got {self.readahead_max_bytes}")
        if not 0 < self.fetch_timeout_s <= 3600:
            out.append(f"--fetch-timeout {self.fetch_timeout_s:g} must be more than 0 and at most 3600 seconds")
        if self.max_pinned_bytes is not None:
            # At most the low watermark: eviction frees down to it, and it must always find unpinned
            # blocks to take, or every insert past the high watermark would be refused.
            most = int(self.disk_bytes * self.low_watermark)
            if self.max_pinned_bytes < 0:
                out.append("--max-pinned must not be negative")
            elif self.max_pinned_bytes > most:
                out.append(f"--max-pinned {format_size(self.max_pinned_bytes)} exceeds {self.low_watermark:.0%} of "
                           f"--disk-cache ({format_size(most)}): eviction needs room for unpinned blocks")
        return out

    @property
    def pin_limit_bytes(self) -> int:
        """The most bytes pinned blocks may take on the disk tier."""
        if self.max_pinned_bytes is not None:
            return self.max_pinned_bytes
        return int(self.disk_bytes * DEFAULT_MAX_PINNED_FRACTION)
