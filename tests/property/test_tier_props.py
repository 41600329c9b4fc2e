"""Model-based tests of the block tiers: random put/get/discard against a plain reference model.

The model is an ordered dict of key -> (bytes, footprint) in LRU order, with the eviction rule
written out plainly: if ``used + new > high``, drop least-recently-used entries until
``used + new <= low``. For the RAM tier ``high == low == capacity`` (evict just enough); for the disk
tier they are the watermarks. Since the rule is deterministic, the model predicts exactly which
blocks each tier holds, in which order, and how many bytes it uses; on top of that the safety
properties are checked directly: usage never exceeds capacity, a get never returns bytes other than
the last ones put for that key (so never another ETag's), and a block just put is gettable.

The disk machine can also restart the tier on the same directory (order rebuilt from mtimes) and
corrupt a held block (it must then read as a miss and be forgotten).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiering.blocks import BlockKey
from tiering.tiers.disk import DiskTier, block_file_size
from tiering.tiers.ram import RamTier
from tests.support.diskblocks import flip_byte

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

KEYS = st.builds(
    BlockKey,
    st.sampled_from(["a", "dir/b", "é/ü"]),
    st.sampled_from(["e1", '"etag-2"']),  # same object, two versions: must never mix
    st.integers(0, 2),
)
SIZES = st.integers(0, 3000)
CAPACITIES = st.one_of(st.just(0), st.integers(1, 12_000))


class TierModel:
    def __init__(self, capacity: int, high: int, low: int, footprint: Callable[[BlockKey, int], int]) -> None:
        self.capacity, self.high, self.low, self.footprint = capacity, high, low, footprint
        self.blocks: OrderedDict[BlockKey, tuple[bytes, int]] = OrderedDict()

    @property
    def used(self) -> int:
        return sum(size for _, size in self.blocks.values())

    def put(self, key: BlockKey, data: bytes) -> bool:
        self.blocks.pop(key, None)
        size = self.footprint(key, len(data))
        if self.capacity == 0 or size > self.capacity:
            return False
        if self.used + size > self.high:
            while self.blocks and self.used + size > self.low:
                self.blocks.popitem(last=False)
        self.blocks[key] = (data, size)
        return True

    def get(self, key: BlockKey) -> bytes | None:
        if key not in self.blocks:
            return None
        self.blocks.move_to_end(key)
        return self.blocks[key][0]


class TierMachine(RuleBasedStateMachine):
    """Shared rules; subclasses build the tier and the matching model."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = 0
        self.last_put: dict[BlockKey, bytes] = {}

    def build(self, capacity: int) -> tuple[object, TierModel]:
        raise NotImplementedError

    @initialize(capacity=CAPACITIES)
    def start(self, capacity: int) -> None:
        self.tier, self.model = self.build(capacity)

    def make_data(self, key: BlockKey, size: int) -> bytes:
        self.counter += 1
        seed = hashlib.sha256(f"{key.token()}#{self.counter}".encode("utf-8", "surrogateescape")).digest()
        return (seed * (size // len(seed) + 1))[:size]

    @rule(key=KEYS, size=SIZES)
    def put(self, key: BlockKey, size: int) -> None:
        data = self.make_data(key, size)
        self.last_put[key] = data
        expected = self.model.put(key, data)
        assert self.tier.put(key, data) is expected
        if expected:
            assert self.tier.contains(key)
            assert self.tier.get(key) == data
            self.model.get(key)

    @rule(key=KEYS)
    def get(self, key: BlockKey) -> None:
        got = self.tier.get(key)
        if got is not None:
            assert got == self.last_put.get(key), "returned bytes that were not the last put for this key"
        assert got == self.model.get(key)

    @rule(key=KEYS)
    def discard(self, key: BlockKey) -> None:
        self.tier.discard(key)
        self.model.blocks.pop(key, None)

    @invariant()
    def capacity_is_respected(self) -> None:
        if hasattr(self, "tier"):
            assert self.tier.used_bytes() <= self.tier.capacity_bytes

    @invariant()
    def matches_the_model(self) -> None:
        if not hasattr(self, "tier"):
            return
        assert self.tier.used_bytes() == self.model.used
        assert len(self.tier) == len(self.model.blocks)
        assert self.tier.keys() == self.expected_keys()

    def expected_keys(self) -> list[BlockKey]:
        return list(self.model.blocks)


class RamTierMachine(TierMachine):
    def build(self, capacity: int) -> tuple[object, TierModel]:
        return RamTier(capacity), TierModel(capacity, capacity, capacity, lambda key, n: n)


class DiskTierMachine(TierMachine):
    """Small blocks as files of their own: a restart orders them by mtime, hits included."""

    HIGH, LOW = 0.95, 0.85
    PACK_SMALL = False

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="cachefs-prop-"))
        self.known: set[BlockKey] = set()  # keys this process of the tier has seen
        self.corrupted: set[BlockKey] = set()

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def build(self, capacity: int) -> tuple[object, TierModel]:
        tier = DiskTier(self.directory, capacity, high_watermark=self.HIGH, low_watermark=self.LOW,
                        pack_small=self.PACK_SMALL)
        return tier, self.build_model(capacity)

    def build_model(self, capacity: int) -> TierModel:
        return TierModel(capacity, int(capacity * self.HIGH), int(capacity * self.LOW), block_file_size)

    def expected_keys(self) -> list[BlockKey]:
        return [k for k in self.model.blocks if k in self.known]

    def put(self, key: BlockKey, size: int) -> None:  # type: ignore[override]
        super().put(key, size)
        self.corrupted.discard(key)
        self.known.add(key)

    put = rule(key=KEYS, size=SIZES)(put)

    def get(self, key: BlockKey) -> None:  # type: ignore[override]
        if key in self.corrupted:
            assert self.tier.get(key) is None
            self.model.blocks.pop(key)
            self.corrupted.discard(key)
            return
        super().get(key)
        if key in self.model.blocks:
            self.known.add(key)

    get = rule(key=KEYS)(get)

    @precondition(lambda self: hasattr(self, "model"))
    @rule(capacity=st.one_of(st.none(), CAPACITIES))
    def restart(self, capacity: int | None) -> None:
        """A new process on the same directory: same blocks, same LRU order, no known keys.

        With another capacity, blocks beyond a lowered one are evicted down to the low watermark.
        """
        if capacity is not None:
            blocks = self.model.blocks
            self.model = self.build_model(capacity)
            self.model.blocks = blocks
            if self.model.used > capacity:
                while blocks and self.model.used > self.model.low:
                    blocks.popitem(last=False)
        self.tier = DiskTier(self.directory, self.model.capacity, high_watermark=self.HIGH, low_watermark=self.LOW,
                             pack_small=self.PACK_SMALL)
        self.known.clear()

    def corruptible(self) -> list[BlockKey]:
        return sorted(set(self.model.blocks) - self.corrupted, key=BlockKey.token)

    @precondition(lambda self: hasattr(self, "model") and bool(self.corruptible()))
    @rule(data=st.data(), where=st.sampled_from(["header", "data"]))
    def corrupt(self, data: st.DataObject, where: str) -> None:
        key = data.draw(st.sampled_from(self.corruptible()))
        digest = key.digest()
        path = self.directory / "blocks" / digest[:2] / f"{digest}.blk"
        raw = bytearray(path.read_bytes())
        raw[0 if where == "header" or len(raw) == block_file_size(key, 0) else -1] ^= 0xFF
        before = path.stat()
        path.write_bytes(bytes(raw))
        # Bit rot does not touch the file's times. Rewriting it here would, and the tier orders the
        # blocks it finds at start-up by mtime (their recency), so a restart would then evict in
        # another order than the model (found by hypothesis: a corrupted block outlived an older one).
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        self.corrupted.add(key)

    @invariant()
    def corrupted_blocks_leave_with_eviction(self) -> None:
        if hasattr(self, "model"):
            self.corrupted &= set(self.model.blocks)


class PackedDiskTierMachine(DiskTierMachine):
    """Small blocks as records of pack files (the default, ``tiering.tiers.packs``): the same rules,
    but a restart orders the blocks by when their record was written (hits before it do not count),
    and does not find a record whose header was damaged (a block file is found by its name, and
    dropped on its first read)."""

    PACK_SMALL = True

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[BlockKey, int] = {}  # the order each held block's record was written in
        self.bad_header: set[BlockKey] = set()

    def put(self, key: BlockKey, size: int) -> None:  # type: ignore[override]
        super().put(key, size)
        self.bad_header.discard(key)
        if key in self.model.blocks:
            self.written[key] = self.counter

    put = rule(key=KEYS, size=SIZES)(put)

    @precondition(lambda self: hasattr(self, "model"))
    @rule(capacity=st.one_of(st.none(), CAPACITIES))
    def restart(self, capacity: int | None) -> None:
        order = sorted(self.model.blocks, key=lambda k: self.written[k])
        self.model.blocks = OrderedDict((k, self.model.blocks[k]) for k in order if k not in self.bad_header)
        self.corrupted -= self.bad_header
        self.bad_header.clear()
        super().restart(capacity)

    @precondition(lambda self: hasattr(self, "model") and bool(self.corruptible()))
    @rule(data=st.data(), where=st.sampled_from(["header", "data"]))
    def corrupt(self, data: st.DataObject, where: str) -> None:
        key = data.draw(st.sampled_from(self.corruptible()))
        flip_byte(self.tier, key, 0 if where == "header" else -1)
        self.corrupted.add(key)
        if where == "header" or not self.model.blocks[key][0]:  # no data: its last byte is the header's CRC
            self.bad_header.add(key)


TestRamTier = RamTierMachine.TestCase
TestRamTier.settings = SETTINGS
TestDiskTier = DiskTierMachine.TestCase
TestDiskTier.settings = SETTINGS
TestPackedDiskTier = PackedDiskTierMachine.TestCase
TestPackedDiskTier.settings = SETTINGS


def test_regression_a_corrupted_block_keeps_its_recency_across_a_restart() -> None:
    """The case hypothesis found: corrupt the older of two blocks, restart with a lower capacity.

    The restart must evict the older (corrupted) block and keep the newer one, as the model does.
    """
    machine = DiskTierMachine()
    try:
        machine.start(capacity=69)
        older, newer = BlockKey("a", "e1", 0), BlockKey("a", "e1", 1)
        machine.put(key=older, size=1)
        machine.put(key=newer, size=0)
        digest = older.digest()
        path = machine.directory / "blocks" / digest[:2] / f"{digest}.blk"
        before = path.stat()
        machine.corrupt(data=_OneDraw(older), where="header")
        assert path.stat().st_mtime_ns == before.st_mtime_ns
        machine.restart(capacity=38)
        machine.corrupted_blocks_leave_with_eviction()
        machine.matches_the_model()
        assert machine.tier.contains(newer) and not machine.tier.contains(older)
    finally:
        machine.teardown()


class _OneDraw:
    """Stands in for hypothesis' ``st.data()`` in the regression test: every draw gives ``value``."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object) -> object:
        return self.value
