"""``csi_driver.janitor``: which node caches a sweep removes, and which it must keep."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from csi_driver.janitor import CacheJanitor
from csi_driver.mounter import FakeMounter
from csi_driver.node import SLOT_RECORD, NodeOps, NodeSettings, cache_dir_name


def _cache(root: Path, volume_id: str, target: str | None = None) -> Path:
    slot = root / "volumes" / cache_dir_name(volume_id) / "slot-0"
    (slot / "0123456789abcdef" / "blocks").mkdir(parents=True)
    (slot / "0123456789abcdef" / "blocks" / "b").write_bytes(b"x" * 4096)
    (slot / SLOT_RECORD).write_text(json.dumps({"volume_id": volume_id, "target": target}))
    return slot.parent


def test_a_sweep_removes_only_unused_caches_of_volumes_that_are_gone(tmp_path: Path, caplog) -> None:
    mounter = FakeMounter()
    node = NodeOps(NodeSettings("n1", tmp_path), mounter)
    live = {"kept"}
    alive = _cache(tmp_path, "kept")
    gone = _cache(tmp_path, "gone")
    mounted = _cache(tmp_path, "mounted-gone", target=str(tmp_path / "t"))
    mounter.mounts[tmp_path / "t"] = object()  # type: ignore[assignment]
    staged = _cache(tmp_path, "staged-gone")
    records = staged / "slot-0" / "0123456789abcdef" / "staging" / "records"
    records.mkdir(parents=True)
    (records / "k.rec").write_text("{}")
    janitor = CacheJanitor(node, lambda: set(live), "csi.cachefs.io")
    live |= {"gone", "mounted-gone", "staged-gone"}
    assert janitor.sweep() == []  # each named by a PersistentVolume: seen
    live = {"kept"}  # then deleted: known gone
    with caplog.at_level(logging.INFO, logger="csi_driver.janitor"):
        assert janitor.sweep() == ["gone"]
    assert not gone.exists() and alive.is_dir() and mounted.is_dir() and staged.is_dir()
    assert "removed the cache of volume gone" in caplog.text and "PersistentVolume of csi.cachefs.io was deleted" in caplog.text
    assert "staged-gone no longer exists, but its cache" in caplog.text and "1 written changes" in caplog.text


def test_a_sweep_that_cannot_list_the_volumes_removes_nothing(tmp_path: Path, caplog) -> None:
    node = NodeOps(NodeSettings("n1", tmp_path), FakeMounter())
    cache = _cache(tmp_path, "unknown")

    def down() -> set[str]:
        raise ConnectionError("the API server cannot be reached")

    with caplog.at_level(logging.WARNING, logger="csi_driver.janitor"):
        assert CacheJanitor(node, down, "csi.cachefs.io").sweep() == []
    assert cache.is_dir() and "cannot list PersistentVolumes" in caplog.text


def test_a_reinstalls_caches_are_kept_for_an_hour_unless_their_volume_is_known_gone(tmp_path: Path, caplog) -> None:
    """Issue 36: the uninstall deletes the PersistentVolumes; a fresh plugin finds their caches and must
    not remove them at its first rounds. Kept until a PV names them (then used) or UNNAMED_GRACE_S
    after the first round found them unnamed (recorded on disk, so a restart does not reset it)."""
    from csi_driver.janitor import UNNAMED_GRACE_S, UNNAMED_MARK

    clock = [1_000_000.0]
    node = NodeOps(NodeSettings("n1", tmp_path), FakeMounter())
    reused, dropped = _cache(tmp_path, "static-pv"), _cache(tmp_path, "old-dynamic-pvc")
    live: set[str] = set()
    janitor = CacheJanitor(node, lambda: set(live), "csi.cachefs.io", now=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="csi_driver.janitor"):
        assert janitor.sweep() == []
    assert "kept 60 minutes for a reinstall" in caplog.text and (dropped / UNNAMED_MARK).is_file()
    clock[0] += UNNAMED_GRACE_S - 60
    assert CacheJanitor(node, lambda: set(live), "csi.cachefs.io", now=lambda: clock[0]).sweep() == []  # restarted
    live.add("static-pv")  # the reinstall makes its PersistentVolume again: the cache is its own
    assert janitor.sweep() == [] and not (reused / UNNAMED_MARK).exists()
    clock[0] += 120
    assert janitor.sweep() == ["old-dynamic-pvc"]  # unnamed for an hour
    live.clear()  # the static volume is deleted while this plugin watches: known gone, at once
    assert janitor.sweep() == ["static-pv"]
