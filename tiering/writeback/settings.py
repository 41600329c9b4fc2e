"""Settings of write-back, and the tuning numbers behind them (each with its reason)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024

# How long an acknowledged file waits before its upload starts. Tools that save by writing a temp
# file and renaming it, or that close and reopen a file to append, would otherwise upload every
# intermediate version (and delete the temp object again); two seconds absorbs those sequences while
# a checkpoint still reaches the store within seconds. `cachefs flush`, --write-through and a disk
# tier near its high watermark skip the wait.
DEFAULT_UPLOAD_DELAY_S = 2.0
# The longest an acknowledged version waits for its upload when the file keeps changing. The
# coalescing delay above starts again at every close, so a log appended every second, or a metrics
# file rewritten more often than the delay, would reach the store only once it stops changing (at
# unmount); this bounds how stale the store may be. Half a minute keeps the store within a pod's
# termination grace period of what the pod wrote, while a file rewritten every second is uploaded
# once per 30 s rather than once per change. Default: the larger of this and --upload-delay (a mount
# that asks for a longer coalescing delay keeps it).
DEFAULT_UPLOAD_MAX_DELAY_S = 30.0
# How long a stopping daemon (SIGTERM, SIGINT, an unmount by any route) goes on uploading what is
# pending before it exits, leaving the rest journaled for the next mount. Kubernetes gives a pod 30 s
# between SIGTERM and SIGKILL (terminationGracePeriodSeconds' default), and systemd 90 s; 25 s leaves
# 5 s of that for acknowledging open files, unmounting and exiting (STOP_MARGIN_S).
DEFAULT_STOP_TIMEOUT_S = 25.0
STOP_MARGIN_S = 5.0
# Objects uploaded (or deleted) at once. Each large upload already sends several parts in parallel
# (the store bounds those, see tiering.objectstore.s3), so a few files at once keep the link busy
# while small files are not stuck behind a large one.
DEFAULT_MAX_UPLOADS = 4
# How long a writer waits for staging space (uploads freeing it) before failing with ENOSPC. A minute
# rides out a store that is briefly slow or a burst larger than the disk tier; a writer is never
# parked indefinitely on a store that is down.
DEFAULT_SPACE_WAIT_S = 60.0

# Retries of a failed upload: capped exponential backoff with jitter. The S3 client already retried
# each request (3 attempts), so our first retry can wait a second; doubling to at most a minute means
# a store that comes back is noticed within a minute, while a dead one costs each pending file less
# than one request a minute. The delay is drawn from [half, all] of the step ("equal jitter"), so
# thousands of pending files do not retry in lockstep. `cachefs flush` retries at once.
UPLOAD_BACKOFF_BASE_S = 1.0
UPLOAD_BACKOFF_CAP_S = 60.0
# While the store is unreachable, nothing is sent but one probe (the next due operation) per backoff
# step, whatever the backlog: a probe every 10 s at most costs nothing, and a store that comes back
# is noticed within seconds instead of a minute, so the backlog starts draining at once.
STORE_PROBE_CAP_S = 10.0

# Deadline of one store operation of write-back (a PUT, multipart parts and completion included, a
# DELETE, a marker): UPLOAD_TIMEOUT_FLOOR_S plus the time to send the object at UPLOAD_MIN_RATE. An
# upload that outlives it (a frozen store: connections accepted, never answered) is cancelled,
# counted as an unreachable store and retried, so no upload holds its slot forever. The floor covers
# connection set-up, botocore's retries and a loaded store; 1 MiB/s is far below any link a store is
# reached over (a 10 GiB checkpoint gets about three hours), so only a store that stopped answering
# reaches it.
UPLOAD_TIMEOUT_FLOOR_S = 30.0
UPLOAD_MIN_RATE = 1 * MiB  # bytes per second


def upload_deadline_s(size: int) -> float:
    """How long one write-back store operation of ``size`` bytes may take."""
    return UPLOAD_TIMEOUT_FLOOR_S + max(0, size) / UPLOAD_MIN_RATE


# Staging space is reserved from the disk tier in chunks of this size as a file grows: one reservation
# (a lock and possibly an eviction batch) per 4 MiB instead of one per 128 KiB FUSE write. A file that
# stops growing gives the rest back when it is acknowledged.
RESERVE_CHUNK = 4 * MiB
# Space is counted in filesystem blocks: a staged file of 1 byte still takes one 4 KiB block, and each
# journal record (a small file) takes one as well, so 100,000 small staged files are counted as the
# 400 MiB they occupy, not as their byte sizes.
FS_BLOCK = 4096
RECORD_BYTES = FS_BLOCK

# Write-behind: once this many bytes were written to a staged data file since the last time, the
# writer thread asks the kernel to start writing them to disk (sync_file_range WRITE, which does not
# wait), so the fsync in close() finds most of a large file on disk already instead of writing all
# of it then. Large enough to be one request per many FUSE writes.
WRITE_BEHIND_BYTES = 16 * MiB

# Blocks fetched at once when a file already in the store is first modified and its content is
# copied into staging (through the block cache). Enough to keep a few fetch slots busy without
# taking all of them from readers.
MATERIALIZE_WINDOW = 4


# Write durability (``tiering.writeback.durable``): ``local`` acknowledges a write once it is on the
# node's disk; ``cluster`` also once it is in the cluster store, so that the loss of the node loses
# nothing acknowledged.
DURABILITY_LOCAL, DURABILITY_CLUSTER = "local", "cluster"
DURABILITIES = (DURABILITY_LOCAL, DURABILITY_CLUSTER)
# Lease of a writer's journal in the cluster store: see ``tiering.writeback.durable`` for the reason
# of a minute. Bounds: a lease renewed more than once a second would be most of the store traffic of
# an idle mount; one over an hour leaves a lost node's writes unrecovered for too long.
DEFAULT_LEASE_TTL_S = 60.0
MIN_LEASE_TTL_S, MAX_LEASE_TTL_S = 2.0, 3600.0


@dataclass(frozen=True)
class WriteBackSettings:
    upload_delay_s: float = DEFAULT_UPLOAD_DELAY_S
    max_uploads: int = DEFAULT_MAX_UPLOADS
    space_wait_s: float = DEFAULT_SPACE_WAIT_S
    # close() and fsync() return only after the upload succeeded, and report its failure.
    write_through: bool = False
    # The longest an acknowledged version waits for its upload while the file keeps changing (None:
    # the larger of DEFAULT_UPLOAD_MAX_DELAY_S and upload_delay_s; see ``max_delay_s``).
    upload_max_delay_s: float | None = None
    # How long stopping goes on uploading before the daemon exits (see DEFAULT_STOP_TIMEOUT_S).
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    durability: str = DURABILITY_LOCAL
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S

    def __post_init__(self) -> None:
        if not 0 <= self.upload_delay_s <= 3600:
            raise ValueError(f"--upload-delay {self.upload_delay_s:g} must be between 0 and 3600 seconds")
        if not 1 <= self.max_uploads <= 256:
            raise ValueError(f"--max-uploads {self.max_uploads} must be between 1 and 256")
        if not 0 <= self.space_wait_s <= 3600:
            raise ValueError(f"--dirty-wait {self.space_wait_s:g} must be between 0 and 3600 seconds")
        if self.upload_max_delay_s is not None:
            if not 0 <= self.upload_max_delay_s <= 86400:
                raise ValueError(f"--upload-max-delay {self.upload_max_delay_s:g} must be between 0 and 86400 seconds")
            if self.upload_max_delay_s < self.upload_delay_s:
                raise ValueError(f"--upload-max-delay {self.upload_max_delay_s:g} must not be shorter than "
                                 f"--upload-delay ({self.upload_delay_s:g} seconds)")
        if not 0 <= self.stop_timeout_s <= 86400:
            raise ValueError(f"--stop-timeout {self.stop_timeout_s:g} must be between 0 and 86400 seconds")
        if self.durability not in DURABILITIES:
            raise ValueError(f"--write-durability must be one of {', '.join(DURABILITIES)}, got {self.durability!r}")
        if not MIN_LEASE_TTL_S <= self.lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ValueError(f"--write-lease-ttl {self.lease_ttl_s:g} must be between {MIN_LEASE_TTL_S:g} and "
                             f"{MAX_LEASE_TTL_S:g} seconds")

    @property
    def max_delay_s(self) -> float:
        """The longest an acknowledged version waits for its upload, however often the file changes."""
        if self.upload_max_delay_s is not None:
            return self.upload_max_delay_s
        return max(DEFAULT_UPLOAD_MAX_DELAY_S, self.upload_delay_s)
