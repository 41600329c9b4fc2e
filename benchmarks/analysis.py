"""The benchmark's own logic, kept apart from any timing so that it can be unit-tested.

- ``median``: every figure and every limit is the median of its rounds (``None`` for no samples).
- ``best_engine``: a limit is the *fastest* of the engines measured for it in the same run (the
  raw GET engines of ``benchmarks.engines``), so that no client's weakness passes for the machine's;
  the cheapest engine is the reference for CPU.
- ``ratio``: a figure against its limit (or a peer); ``None`` when either side is missing or zero.
- ``limit_beaten``: a tool faster than the limit by more than ``LIMIT_NOISE`` means the limit is
  not one: the benchmark reports it loudly (a warning line, and a flag in the JSON) as its own bug.
- ``quiet_warnings``: whether the machine was quiet before a round (see the thresholds below).
- ``rotation``: the tool order of a round; it turns by one each round, so that no tool always runs
  first (on a cold server) or right after the same neighbour.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

# Two back-to-back measurements of the same path on this kind of machine differ by a few percent;
# a tool ahead of the limit by less than 5% is "equal within noise", by more it shows that the
# limit was not the machine's best (a slower client, a colder server) and must be fixed.
LIMIT_NOISE = 1.05
# More runnable tasks than cores over the last minute means somebody waited for a core. The
# benchmark's own previous round (the server and the tool, about one task per core when busy) is
# still in the 1-minute average when the next round starts, so the bar is one task per core, not 0.
QUIET_LOADAVG_PER_CPU = 1.0
# The share of all CPUs that processes the benchmark did not start used while the benchmark sat
# idle for a short window just before the round. A fifth of the machine busy with others is a
# fifth less for the server and the tool under test: their rates are then lower bounds only.
QUIET_FOREIGN_BUSY = 0.20


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``; None when either is missing or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def best_engine(rates: Mapping[str, float | None], *, higher_is_better: bool = True) -> tuple[str | None, float | None]:
    """The engine with the best figure (the highest rate, or with ``higher_is_better=False`` the lowest
    cost) and that figure; (None, None) when no engine has one."""
    known = [(name, value) for name, value in rates.items() if value is not None and value > 0]
    if not known:
        return None, None
    pick = max if higher_is_better else min
    return pick(known, key=lambda nv: nv[1])


def limit_beaten(limit: float | None, tools: Mapping[str, float | None], *, higher_is_better: bool = True,
                 noise: float = LIMIT_NOISE) -> dict[str, float]:
    """Tool -> its ratio to ``limit``, for every tool past the limit by more than ``noise``.

    Only rates bound the tools (``higher_is_better``); a cost reference (CPU per GiB) is a floor for
    the same work, and a tool that does less work may go under it honestly, so it is never "beaten".
    """
    if not higher_is_better or limit is None or limit <= 0:
        return {}
    return {name: value / limit for name, value in tools.items() if value is not None and value > limit * noise}


# Before each round the harness waits, at most this long, for the 1-minute load average to fall to
# the quiet bar: the average decays with a one-minute time constant, so the benchmark's own previous
# round (load ~3 on 2 cores) needs ~25 s to fall below 2; without the wait every round after the
# first was flagged "not quiet" for the harness's own work (2026-11-26: load 2.4-3.1 before each
# round while others used 0-1% of the CPUs). A machine busy with others stays above it: the round
# then starts after the wait, flagged, as before.
SETTLE_MAX_S = 45.0
SETTLE_POLL_S = 1.0


def settle(read_load: Callable[[], float], sleep: Callable[[float], None], cpus: int, *,
           max_s: float = SETTLE_MAX_S, poll_s: float = SETTLE_POLL_S,
           loadavg_per_cpu: float = QUIET_LOADAVG_PER_CPU) -> float:
    """Wait until ``read_load()`` (the 1-minute load average) is at most the quiet bar for ``cpus``,
    at most ``max_s``; returns the seconds waited (polled every ``poll_s``)."""
    waited = 0.0
    while read_load() > loadavg_per_cpu * cpus and waited + poll_s <= max_s:
        sleep(poll_s)
        waited += poll_s
    return waited


def quiet_warnings(loadavg_1m: float, foreign_busy: float, cpus: int, *,
                   loadavg_per_cpu: float = QUIET_LOADAVG_PER_CPU,
                   foreign_max: float = QUIET_FOREIGN_BUSY) -> list[str]:
    """Why the machine was not quiet before a round (an empty list when it was)."""
    reasons = []
    if loadavg_1m > loadavg_per_cpu * cpus:
        reasons.append(f"load average {loadavg_1m:.2f} > {loadavg_per_cpu:g} per CPU x {cpus} CPUs "
                       "(more runnable tasks than cores over the last minute)")
    if foreign_busy > foreign_max:
        reasons.append(f"{foreign_busy:.0%} of the CPUs busy with processes the benchmark did not start "
                       f"(> {foreign_max:.0%}) while it sat idle")
    return reasons


def rotation(names: Sequence[T], round_index: int) -> list[T]:
    """``names`` turned left by ``round_index`` (round 0: as given)."""
    if not names:
        return []
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


def per_gib(seconds: float | None, nbytes: int) -> float | None:
    """CPU seconds per GiB of ``nbytes``; None for no bytes or no figure."""
    if seconds is None or nbytes <= 0:
        return None
    return seconds / (nbytes / 1024**3)
