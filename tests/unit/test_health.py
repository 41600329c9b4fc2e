"""TierHealth state transitions, cool-down probes and logging, in virtual time."""

from __future__ import annotations

import errno
import logging

import pytest

from tiering.clock import FakeClock
from tiering.health import TierHealth, TierState

EIO = OSError(errno.EIO, "Input/output error")


def make(clock: FakeClock | None = None, **kw) -> TierHealth:
    return TierHealth(clock or FakeClock(), unstable_after=3, down_after=5, cooldown_s=30.0, name="disk", **kw)


def fail(health: TierHealth, n: int) -> None:
    for _ in range(n):
        health.record_failure(EIO)


def test_starts_healthy_and_usable() -> None:
    health = make()
    assert health.state == "healthy" and health.state is TierState.HEALTHY
    assert health.usable()


def test_consecutive_failures_make_it_unstable_then_down() -> None:
    health = make()
    fail(health, 2)
    assert health.state is TierState.HEALTHY
    fail(health, 1)
    assert health.state is TierState.UNSTABLE
    assert health.usable(), "an unstable tier is still used"
    fail(health, 1)
    assert health.state is TierState.UNSTABLE
    fail(health, 1)
    assert health.state is TierState.DOWN
    assert not health.usable()


def test_a_success_resets_the_count() -> None:
    health = make()
    fail(health, 2)
    health.record_success()
    fail(health, 2)
    assert health.state is TierState.HEALTHY
    assert health.consecutive_failures == 2


def test_down_allows_one_probe_after_the_cooldown() -> None:
    clock = FakeClock()
    health = make(clock)
    fail(health, 5)
    clock.advance(29.9)
    assert not health.usable()
    clock.advance(0.1)
    assert health.usable(), "the probe"
    assert not health.usable(), "only one probe per cool-down"
    assert not health.usable()
    health.record_success()
    assert health.state is TierState.HEALTHY
    assert health.usable() and health.usable()


def test_a_failed_probe_restarts_the_cooldown() -> None:
    clock = FakeClock()
    health = make(clock)
    fail(health, 5)
    clock.advance(30)
    assert health.usable()
    clock.advance(10)
    health.record_failure(EIO)
    assert health.state is TierState.DOWN
    clock.advance(29)
    assert not health.usable()
    clock.advance(1)
    assert health.usable()


def test_a_probe_without_outcome_lets_another_through_later() -> None:
    clock = FakeClock()
    health = make(clock)
    fail(health, 5)
    clock.advance(30)
    assert health.usable()
    clock.advance(15)
    assert not health.usable()
    clock.advance(15)
    assert health.usable()


def test_logs_once_per_state_change(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tiering.health")
    health = make()
    fail(health, 20)
    health.record_success()
    health.record_success()
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in records] == [logging.WARNING, logging.ERROR, logging.INFO]
    assert "unstable" in records[0][1] and "disk" in records[0][1]
    assert "down" in records[1][1] and "Input/output error" in records[1][1]
    assert "healthy again" in records[2][1]


@pytest.mark.parametrize(
    "kw",
    [{"unstable_after": 0}, {"unstable_after": 5, "down_after": 4}, {"cooldown_s": -1.0}],
)
def test_bad_tuning_is_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        TierHealth(FakeClock(), **kw)


def test_a_stalled_call_takes_the_tier_down_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """A read that has not returned in seconds (a hung device; cachefs.fuse.session's stall watch) is
    not one failure of ten: the tier is skipped at once, for a cool-down, and said so once; the read's
    own return, a success, makes it healthy again."""
    clock = FakeClock()
    h = make(clock)
    with caplog.at_level(logging.ERROR, logger="tiering.health"):
        h.record_stall("a block read has not returned for 10 s")
        h.record_stall("a block read has not returned for 10 s")
    assert h.state is TierState.DOWN and not h.usable()
    assert [r.getMessage() for r in caplog.records] == [
        "disk tier is down: a block read has not returned for 10 s; skipping it for 30 s"]
    clock.advance(30.0)
    assert h.usable()  # the probe, after the cool-down, as for failures
    h.record_success()
    assert h.state is TierState.HEALTHY and h.consecutive_failures == 0
