"""What the daemon built while starting, kept out of Python's cyclic garbage collector.

Why. CPython's collector runs in whichever thread allocates past its threshold, with the GIL held,
and a full (generation 2) collection visits every tracked object in the process. By the time a
daemon serves, most of those are start-up's and live until it exits: botocore's service model of S3
(parsed JSON: hundreds of thousands of dicts, lists and strings), the modules, the settings, the
disk tier's index and the metadata index's listings. A cold epoch of small files allocates enough
(futures, tasks, handles, the inode table's entries) to trigger full collections as it goes, and
each one walked all of that on the event loop: measured with a ``gc.callbacks`` timer in the
daemon (``benchmarks/coldfiles.py``, 2,000 cold files of 100 KiB, load 10-14 on 2 cores), one full
collection cost 0.07-0.46 s of the loop's CPU, up to 0.23 ms per file of the pass it fell in, the
largest single item on the busiest thread; ``perf`` put ``gc_collect_main`` at ~10% of the loop's
cycles. The same collections after ``freeze_startup_heap`` cost 8-15 ms each.

How. Once everything start-up makes is made, and before the mount is served, one ``gc.collect()``
drops start-up's garbage and ``gc.freeze()`` moves every object left into the permanent generation,
which no collection visits. Collections go on as before for everything made after (an object made
at start-up and dropped later is freed by its reference count as usual; only a reference cycle among
frozen objects would stay, and start-up makes none that it later drops: the objects frozen are the
process's long-lived state). ``heap_stats`` is the ``process`` section of ``/stats``: how many objects
are frozen, how many collections of each generation ran and the CPU time they took (``time_collections``,
a ``gc.callbacks`` hook: two clock reads per collection, ~100 collections per 1,000 cold files), so a
benchmark sees what the collector costs in its pass.

Only the daemon process does this (``cachefs.daemon.main.run_daemon``, which runs only in
``cachefs mount --foreground``'s own process), never a library user or a test process.
"""

from __future__ import annotations

import gc
import time
from typing import Any

# CPU seconds spent in collections of generations 0, 1 and 2 since time_collections, and when the one
# under way started (collections never overlap: one runs at a time, holding the GIL).
_GC_CPU_S = [0.0, 0.0, 0.0]
_STARTED = [0.0]


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then freeze every object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _timed(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _STARTED[0] = time.thread_time()  # the collection runs in the thread that started it
    else:
        _GC_CPU_S[info["generation"]] += time.thread_time() - _STARTED[0]


def time_collections() -> None:
    """From now on, count the CPU time of every collection by generation (``heap_stats``); once."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def heap_stats() -> dict[str, Any]:
    """Frozen objects, collections run per generation (0, 1, 2) since the process started, and their
    CPU seconds since ``time_collections``."""
    return {"gc_frozen_objects": gc.get_freeze_count(),
            "gc_collections": [generation["collections"] for generation in gc.get_stats()],
            "gc_cpu_s": [round(seconds, 6) for seconds in _GC_CPU_S]}
