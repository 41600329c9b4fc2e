"""Health of a cache tier: healthy -> unstable -> down, and back on the first success.

A cache tier that fails is a miss, never an error for a reader. But a disk that answers every
request with EIO after a 30-second timeout, or a full disk that refuses every write, would still
cost every read its I/O attempt and flood the log. ``TierHealth`` counts *consecutive* failures:

``healthy``   normal operation.
``unstable``  ``unstable_after`` failures in a row: still used, reported by the stats endpoint.
``down``      ``down_after`` failures in a row: the tier is skipped (``usable()`` is False, callers
              do no I/O) for ``cooldown_s``. Then one probe is let through (``usable()`` answers
              True once); its success makes the tier healthy again, its failure restarts the
              cool-down. A probe whose outcome is never recorded (the caller found nothing to do)
              simply lets another probe through after a further cool-down.

Any success resets the count and the state to healthy. The log gets one line per state change, not
one per failure, so a dead disk produces three lines, not three million.

The tier calls this from a thread pool, so the state sits behind a small lock. Time comes from an
injected ``Clock`` so tests drive the cool-down in virtual time.
"""

from __future__ import annotations

import enum
import logging
import threading

from tiering.clock import Clock

log = logging.getLogger("tiering.health")

# Three failures in a row is past a one-off glitch (a single EIO, a file removed under us) but still
# early enough that the stats endpoint shows trouble before the tier is taken out.
DEFAULT_UNSTABLE_AFTER = 3
# Ten in a row means the device is failing or full, not unlucky: stop paying for I/O on it.
DEFAULT_DOWN_AFTER = 10
# 30 s: long enough that a dead disk costs at most one failed probe per half minute, short enough
# that a disk freed by an operator (ENOSPC cleared) is back in use without a restart.
DEFAULT_COOLDOWN_S = 30.0


class TierState(enum.StrEnum):
    HEALTHY = "healthy"
    UNSTABLE = "unstable"
    DOWN = "down"


class TierHealth:
    """Consecutive-failure tracker with a cool-down and single probes while down."""

    def __init__(
        self,
        clock: Clock,
        *,
        unstable_after: int = DEFAULT_UNSTABLE_AFTER,
        down_after: int = DEFAULT_DOWN_AFTER,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        name: str = "tier",
    ) -> None:
        if unstable_after < 1:
            raise ValueError(f"unstable_after must be at least 1, got {unstable_after}")
        if down_after < unstable_after:
            raise ValueError(f"down_after ({down_after}) must not be below unstable_after ({unstable_after})")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must not be negative, got {cooldown_s}")
        self.name = name
        self.unstable_after = unstable_after
        self.down_after = down_after
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = TierState.HEALTHY
        self._failures = 0  # consecutive
        self._next_probe_at = 0.0  # meaningful only while down

    @property
    def state(self) -> TierState:
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def usable(self) -> bool:
        """Whether the caller may do I/O on the tier now.

        While down, answers True once per cool-down (the probe) and False otherwise. Call it only
        right before doing I/O, and record the outcome.
        """
        with self._lock:
            if self._state is not TierState.DOWN:
                return True
            now = self._clock.monotonic()
            if now < self._next_probe_at:
                return False
            # Let exactly one probe through; the next one only after another cool-down, whatever
            # this one's outcome (a success will have made the tier healthy before then).
            self._next_probe_at = now + self.cooldown_s
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._state is TierState.HEALTHY:
                return
            old, self._state = self._state, TierState.HEALTHY
        log.info("%s tier is healthy again (was %s)", self.name, old)

    def record_failure(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self._failures += 1
            old = self._state
            if self._failures >= self.down_after:
                new = TierState.DOWN
                # Counted from the last failure: a failed probe restarts the cool-down.
                self._next_probe_at = self._clock.monotonic() + self.cooldown_s
            elif self._failures >= self.unstable_after:
                new = TierState.UNSTABLE
            else:
                new = TierState.HEALTHY
            self._state = new
            failures = self._failures
        if new is old:
            log.debug("%s tier failure %d (%s): %s", self.name, failures, new, exc)
        elif new is TierState.DOWN:
            log.error(
                "%s tier is down after %d consecutive failures, skipping it for %.0f s: %s",
                self.name,
                failures,
                self.cooldown_s,
                exc,
            )
        else:
            log.warning("%s tier is unstable after %d consecutive failures: %s", self.name, failures, exc)

    def record_stall(self, what: str) -> None:
        """A call that has not returned for far too long (a hung device, ``what`` says which call): down
        at once, as many failures in a row would have made it, so no one else waits on it; its own
        return (a success) makes it healthy again."""
        with self._lock:
            self._failures = max(self._failures, self.down_after)
            old, self._state = self._state, TierState.DOWN
            self._next_probe_at = self._clock.monotonic() + self.cooldown_s
        if old is not TierState.DOWN:
            log.error("%s tier is down: %s; skipping it for %.0f s", self.name, what, self.cooldown_s)

    def __repr__(self) -> str:
        return f"TierHealth(name={self.name!r}, state={self._state.value}, failures={self._failures})"
