"""Fixed-bucket latency histograms, kept by the engine and exported by the metrics endpoint.

The engine records how long each object-store request took without knowing anything about
Prometheus: ``LatencyHistogram.observe(seconds)`` adds one count to the first bucket whose upper
bound is at least the duration (and to the running sum), and the metrics module turns a snapshot of
the buckets into a Prometheus histogram at scrape time. Bucket counts here are *per bucket*
(non-cumulative, so one observation touches one integer); ``cumulative()`` gives the running totals
that the Prometheus exposition format wants.

The bounds are fixed at construction (``DEFAULT_LATENCY_BUCKETS_S``): a histogram whose buckets move
cannot be aggregated across daemons or over time. Everything runs on the event loop, so there is no
lock; an observation is a bisect and two additions.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

# Upper bounds, in seconds, of the latency buckets. A ranged GET of one block from an in-region or
# loopback store takes from ~2 ms (64 KiB) to ~100 ms (8 MiB on a loaded server); retries and
# throttling push the tail into seconds, and the engine gives up at the fetch timeout (30 s by
# default). Roughly x2.5 steps from 1 ms to 30 s resolve both the body and the tail with 14 buckets.
DEFAULT_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


@dataclass
class LatencyHistogram:
    """Counts of durations per bucket; the last count is the ``+Inf`` bucket."""

    bounds: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not all(b > 0 and math.isfinite(b) for b in self.bounds):
            raise ValueError(f"histogram bounds must be finite, positive and strictly increasing: {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        elif len(self.counts) != len(self.bounds) + 1:
            raise ValueError("a histogram needs one count per bound plus one for +Inf")

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)`` for every bucket, ending with ``(inf, count)``."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append((bound, running))
        return out

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly copy: ``{"count", "sum_s", "buckets": {"<bound>": cumulative, "+Inf": ...}}``."""
        return {
            "count": self.count,
            "sum_s": round(self.sum_s, 6),
            "buckets": {("+Inf" if math.isinf(b) else repr(b)): n for b, n in self.cumulative()},
        }
