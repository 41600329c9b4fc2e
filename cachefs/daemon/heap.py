"""What the daemon built while starting, kept out of Python's cyclic garbage collector.

Why. CPython's collector runs in whichever thread allocates past its threshold, with the GIL held,
and a full (generation 2) collection visits every tracked object in the process. By the time a
daemon serves, most of those are start-up's and live until it exits: botocore's service model of S3
(parsed JSON: dicts, lists and strings), the modules, the settings, the
disk tier's index and the metadata index's listings: ~99,000 objects in a daemon mounted on
SeaweedFS. A cold epoch of small files allocates enough (futures, tasks, handles, the inode table's
entries) to set full collections off as it goes, and each one walked all of that, usually on the event
loop: timed with a ``gc.callbacks`` hook in the daemon (``benchmarks/coldfiles.py``, 2,000 cold files of
100 KiB, load 6-17 on 2 cores), 0.06-0.46 s of the loop's CPU per full collection, a stall of every
FUSE request meanwhile. After ``freeze_startup_heap`` the same collections cost 4-15 ms. This removes
the pause, not the collector's average cost over a long epoch: CPython sets a full collection off
each time the objects that survived the last one grow by a quarter, so that average follows the
long-lived objects each file adds (docs/dataplane.md, "Small files, profiled").

How. Once everything start-up makes is made, and before the mount is served, one ``gc.collect()``
drops start-up's garbage and ``gc.freeze()`` moves every object left into the permanent generation,
which no collection visits. Collections go on as before for everything made after. An object made
at start-up and dropped later is freed by its reference count as usual; a reference cycle among
frozen objects that the daemon later dropped would stay in memory, which is why only start-up's
objects (the process's long-lived state) are frozen, once, and never those of later work.

``heap_stats`` is the ``process`` section of ``/stats``: how many objects are frozen, how many
collections of each generation ran and the CPU time they took (``time_collections``, a
``gc.callbacks`` hook: two clock reads per collection, 10-60 collections per 1,000 cold files), so a
benchmark sees what the collector costs in its pass.

Only the daemon process does this (``cachefs.daemon.main.run_daemon``, which runs only in
``cachefs mount --foreground``'s own process), never a user of the library.
"""

from __future__ import annotations

import gc
import time
from typing import Any

# CPU seconds spent in collections of generations 0, 1 and 2 since time_collections, and when the one
# under way started (collections never overlap: one runs at a time, holding the GIL).
_GC_CPU_S = [0.0, 0.0, 0.0]
_STARTED = [0.0]
# How many objects freeze_startup_heap froze, counted once there: gc.get_freeze_count() walks the whole
# permanent generation, 4 ms for 84,000 objects (load 7), and in the GIL profile of a cold pass whose
# span held two /stats calls it was 5% of all samples: too much for every /stats and metrics scrape.
_FROZEN = [0]


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then freeze every object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    _FROZEN[0] = gc.get_freeze_count()
    return _FROZEN[0]


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
    """Objects ``freeze_startup_heap`` froze, collections run per generation (0, 1, 2) since the process
    started, and their CPU seconds since ``time_collections``. Constant time: no walk of any generation."""
    return {"gc_frozen_objects": _FROZEN[0],
            "gc_collections": [generation["collections"] for generation in gc.get_stats()],
            "gc_cpu_s": [round(seconds, 6) for seconds in _GC_CPU_S]}
