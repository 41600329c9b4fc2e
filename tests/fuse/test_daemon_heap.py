"""The mount daemon freezes what it made while starting before it serves (cachefs.daemon.heap, issue
35): ``/stats`` shows the frozen objects, and a full collection while serving leaves them be."""

from __future__ import annotations

from pathlib import Path

from cachefs.client import call


def test_a_serving_daemon_has_frozen_its_start_up_heap(tmp_path: Path, mounter) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "a.txt").write_bytes(b"hello")
    m = mounter.mount(f"file://{store}", "--read-only")
    assert (m.path / "a.txt").read_bytes() == b"hello"
    process = call(m.path, "/stats")["process"]
    # Start-up's objects (the modules, the settings, the tiers): thousands, frozen before the mount.
    assert process["gc_frozen_objects"] > 10_000
    assert len(process["gc_collections"]) == len(process["gc_cpu_s"]) == 3
