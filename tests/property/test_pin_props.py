"""Model-based test of pinning in the disk tier: pinned blocks survive every eviction and restart.

Random puts (which evict under pressure), pins, unpins, discards and restarts on one directory. The
model records, for each pinned key, the bytes last stored for it while pinned. Checked after every
step: usage never exceeds capacity, every pinned block the model holds is still there with exactly
those bytes, and ``pinned_bytes()`` is exactly their footprint. Eviction order among unpinned blocks
is covered by ``test_tier_props.py``; here only what pins promise is checked.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiering.blocks import BlockKey
from tiering.tiers.disk import DiskTier, block_file_size

KEYS = st.builds(BlockKey, st.sampled_from(["a", "d/b", "é"]), st.sampled_from(["e1", '"e2"']), st.integers(0, 3))
SIZES = st.integers(0, 2500)


def content(key: BlockKey, size: int) -> bytes:
    seed = hashlib.sha256(f"{key.token()}/{size}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class PinnedDiskTier(RuleBasedStateMachine):
    @initialize(capacity=st.integers(3000, 15000))
    def start(self, capacity: int) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="pin-props-"))
        self.capacity = capacity
        self.tier = DiskTier(self.directory, capacity)
        self.pinned: set[BlockKey] = set()
        self.last: dict[BlockKey, bytes] = {}  # last bytes stored for a key (it may have been evicted since)
        self.held: dict[BlockKey, bytes] = {}  # pinned keys that must be on disk, with their bytes

    def teardown(self) -> None:
        shutil.rmtree(getattr(self, "directory", "/nonexistent"), ignore_errors=True)

    @rule(key=KEYS, size=SIZES)
    def put(self, key: BlockKey, size: int) -> None:
        data = content(key, size)
        if self.tier.put(key, data):
            self.last[key] = data
            if key in self.pinned:
                self.held[key] = data
        else:  # a refused put drops the older version too
            self.last.pop(key, None)
            self.held.pop(key, None)

    @rule(key=KEYS)
    def pin(self, key: BlockKey) -> None:
        self.tier.pin([key])
        self.pinned.add(key)
        if self.tier.contains(key):
            self.held[key] = self.last[key]

    @rule(key=KEYS)
    def unpin(self, key: BlockKey) -> None:
        self.tier.unpin([key])
        self.pinned.discard(key)
        self.held.pop(key, None)

    @rule(key=KEYS)
    def discard(self, key: BlockKey) -> None:
        self.tier.discard(key)
        self.last.pop(key, None)
        self.held.pop(key, None)

    @rule()
    def evict_unpinned(self) -> None:
        self.tier.evict_unpinned()
        self.last = {k: v for k, v in self.last.items() if k in self.held}

    @rule()
    def restart(self) -> None:
        self.tier = DiskTier(self.directory, self.capacity, pinned=self.pinned)

    @invariant()
    def bounded(self) -> None:
        if hasattr(self, "tier"):
            assert self.tier.used_bytes() <= self.capacity

    @invariant()
    def pinned_blocks_survive(self) -> None:
        if not hasattr(self, "tier"):
            return
        for key, data in self.held.items():
            assert self.tier.contains(key), key
            assert self.tier.get(key) == data
        assert self.tier.pinned_bytes() == sum(block_file_size(k, len(d)) for k, d in self.held.items())


PinnedDiskTier.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPinnedDiskTier = PinnedDiskTier.TestCase
