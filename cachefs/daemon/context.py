"""What the daemon hands its features: one ``DaemonContext`` per mount, and the ``Feature`` lifecycle.

A feature (write-back, prefetch jobs, metrics) is built by its module's ``install(ctx)``, called
before the control API starts, so it can add routes; its ``start()`` runs before the kernel mount
(so a replay or a warm-up finishes first) and its ``stop()`` after the unmount, in reverse order,
also when the mount failed. The daemon (``cachefs.daemon.main``) imports each feature module by
name in its source, so readers and the import contracts see every one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cachefs.daemon.control import ControlServer
from cachefs.daemon.stopping import Stopping
from cachefs.fs.filesystem import CacheFS
from cachefs.settings import MountSettings
from tiering.engine.blockcache import BlockCache
from tiering.protocols import ObjectStore


@dataclass
class DaemonContext:
    """Everything a feature may build on. Created once per mount."""

    settings: MountSettings
    store: ObjectStore
    cache: BlockCache
    fs: CacheFS
    control: ControlServer
    cache_dir: Path
    # The daemon's stop: its deadline, and what to drain while still serving (cachefs.daemon.stopping).
    stopping: Stopping = field(default_factory=lambda: Stopping(0.0))


class Feature(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...
