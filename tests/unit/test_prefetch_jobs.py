"""Prefetch jobs, path resolution, manifests, pins persistence, snapshot and evict, without a mount."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from cachefs.daemon.control import ControlRequestError
from cachefs.daemon.prefetch import JobState, PrefetchManager, PrefetchRequest
from cachefs.daemon.resolver import Resolver
from cachefs.fs.filesystem import CacheFS
from cachefs.manifest import ManifestEntry, ManifestError, format_manifest, parse_manifest, read_manifest
from cachefs.paths import PathError, check_path, mount_relative
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE, ObjectRef
from tiering.tiers.disk import DiskTier
from tiering.engine.blockcache import BlockCache
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.policy.pins import load_pin_file
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings

BS = MIN_BLOCK_SIZE


def data(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    for key, size in {
        "train/a.bin": 3 * BS + 5, "train/b.bin": BS, "train/sub/c.bin": 2 * BS, "train/empty": 0,
        "val/d.bin": BS // 2, "top.txt": 10,
    }.items():
        s.put_object(key, data(key, size))
    return s


def make(tmp_path: Path, store, *, disk_bytes: int = 256 * BS, max_pinned: int | None = None,
         pin_file: bool = True) -> PrefetchManager:
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS, disk_bytes=disk_bytes, max_pinned_bytes=max_pinned,
                             max_concurrent_fetches=4)
    disk = DiskTier(tmp_path / "cache", disk_bytes) if disk_bytes else None
    cache = BlockCache(settings, store, RamTier(16 * BS), disk)
    return PrefetchManager(store, cache, pin_file=tmp_path / "pins.json" if pin_file else None)


async def run(manager: PrefetchManager, **params) -> dict:
    job = manager.start(PrefetchRequest.from_params(params))
    assert job.task is not None
    await job.task
    return manager.document(job)


# ------------------------------------------------------------------------------------ paths
def test_mount_relative_paths() -> None:
    assert mount_relative("train/a.bin", "/mnt/x", "/mnt/x") == "train/a.bin"
    assert mount_relative("/mnt/x/train/", "/mnt/x", "/home/u") == "train"
    assert mount_relative("/mnt/x", "/mnt/x", "/") == ""
    assert mount_relative("train/../val", "/mnt/x/", "/mnt/x") == "val"
    for outside in ("../../etc", "/etc", "/mnt/xy/a", "train/../../y"):
        with pytest.raises(PathError, match="outside the mount"):
            mount_relative(outside, "/mnt/x", "/mnt/x")


def test_relative_paths_mean_what_they_mean_in_a_shell() -> None:
    """Issue 12: ``cd /mnt/x/out && cachefs status hello.txt`` names out/hello.txt, not hello.txt."""
    assert mount_relative("hello.txt", "/mnt/x", "/mnt/x/out") == "out/hello.txt"
    assert mount_relative("../val/a", "/mnt/x", "/mnt/x/out") == "val/a"
    assert mount_relative(".", "/mnt/x", "/mnt/x/out") == "out"
    assert mount_relative("x/train", "/mnt/x", "/mnt") == "train"
    assert mount_relative("x/train", "x", "/mnt") == "train"  # a relative mountpoint, as typed
    with pytest.raises(PathError, match=r"^train is outside the mount /mnt/x$"):
        mount_relative("train", "/mnt/x", "/home/u")


def test_check_path_refuses_what_the_mount_cannot_show() -> None:
    assert check_path("") == "" and check_path("a/b/") == "a/b"
    for bad in ("/a", "a//b", "a/../b", "./a", "a/\x00", "n" * 300):
        with pytest.raises(PathError):
            check_path(bad)


async def test_resolver_sees_what_the_filesystem_sees() -> None:
    store = InMemoryObjectStore()
    for key in ("d/ok", "d/x//y", "d/./dot", "d/../esc", "d/same", "d/same/inner", "d/" + "n" * 256,
                "d/sub/", "d/sub/f", "d/marker/"):
        store.put_object(key, b"1")
    resolver = Resolver(store)
    entries = await resolver.entries("d")
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=BS, disk_bytes=0), store, RamTier(BS))
    fs = CacheFS(store, cache, FsSettings())
    listing = await fs.listings.get("d")
    assert entries == listing.entries  # same names, same kinds, same ObjectInfo
    assert sorted(entries) == ["marker", "ok", "same", "sub", "x"]
    assert entries["same"] is None  # the directory wins over the file of the same name
    assert await resolver.lookup("d/marker") is None  # an empty directory (marker only) exists
    assert await resolver.lookup("d/nope") is False
    assert [i.key for i in await resolver.walk("d")] == ["d/ok", "d/same/inner", "d/sub/f"]
    assert [i.key for i in await resolver.walk("d", recursive=False)] == ["d/ok"]


# ------------------------------------------------------------------------------------ manifests
def test_manifest_parsing_and_errors(tmp_path: Path) -> None:
    lines = ["train/a.bin", "", '{"path": "val/d.bin", "etag": "\\"e\\"", "size": 3, "extra": 1}', "  "]
    assert parse_manifest(lines, "m") == [ManifestEntry("train/a.bin", 1), ManifestEntry("val/d.bin", 3, '"e"', 3)]
    for bad, message in [
        ('{"path": ', r"manifest m line 2: invalid JSON"),
        ("[1]", None),  # not JSON-looking: a plain path named "[1]"
        ('{"etag": "x"}', r"line 2: \"path\" must be"),
        ('{"path": "a", "size": -1}', r"line 2: \"size\" must be"),
        ('{"path": "a", "size": true}', r"line 2: \"size\" must be"),
        ('{"path": "a", "etag": 5}', r"line 2: \"etag\" must be"),
    ]:
        if message is None:
            assert parse_manifest(["ok", bad], "m")[1].path == bad
            continue
        with pytest.raises(ManifestError, match=message):
            parse_manifest(["ok", bad], "m")
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(str(tmp_path / "none.jsonl"))
    with pytest.raises(ManifestError, match="is a directory"):
        read_manifest(str(tmp_path))
    (tmp_path / "bin").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ManifestError, match="line 2: not valid UTF-8"):
        read_manifest(str(tmp_path / "bin"))


def test_manifest_format_is_sorted_and_reproducible() -> None:
    files = [("b", '"2"', 2), ("a/é", '"1"', 1), ("bad\udcff", '"3"', 3)]
    text = format_manifest(files)
    assert text == format_manifest(reversed(files))
    lines = text.splitlines()
    assert json.loads(lines[0]) == {"etag": '"1"', "path": "a/é", "size": 1}
    assert "é" in lines[0]  # readable UTF-8, not escapes
    text.encode("utf-8")  # a non-UTF-8 name is escaped, so the file stays valid UTF-8
    assert [e.path for e in parse_manifest(lines, "m")] == ["a/é", "b", "bad\udcff"]


# ------------------------------------------------------------------------------------ jobs
async def test_prefetch_directory_then_read_fetches_nothing(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manager = make(tmp_path, store)
    doc = await run(manager, paths=["train"], recursive=True)
    assert doc["state"] == "done" and doc["ok"], doc
    assert doc["files_total"] == 4 and doc["files_cached"] == 4
    assert doc["bytes_total"] == doc["bytes_cached"] == doc["bytes_fetched"] == 6 * BS + 5
    gets = store.stats.get_requests
    for key in ("train/a.bin", "train/b.bin", "train/sub/c.bin"):
        info = store._objects[key].info
        assert await manager.cache.read(ObjectRef(key, info.etag, info.size), 0, info.size) == data(key, info.size)
    assert store.stats.get_requests == gets
    # A second run fetches nothing; --check says everything is there.
    again = await run(manager, paths=["train"], recursive=True)
    assert again["ok"] and again["bytes_fetched"] == 0 and again["bytes_skipped"] == 6 * BS + 5
    check = await run(manager, paths=["train", "val"], recursive=True, check=True)
    assert check["state"] == "done" and not check["ok"]
    assert check["not_cached"] == ["val/d.bin"] and check["files_cached"] == 4
    assert check["cached_ratio"] == pytest.approx((6 * BS + 5) / (6 * BS + 5 + BS // 2))
    assert store.stats.get_requests == gets


async def test_bad_requests_are_rejected_before_fetching(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manager = make(tmp_path, store)
    doc = await run(manager, paths=["train/nope", "zz"])
    assert doc["state"] == "rejected"
    assert doc["error"] == "no such file or directory in the mount: train/nope, zz"
    doc = await run(manager, paths=["train"])
    assert doc["state"] == "rejected" and doc["error"] == "is a directory (use --recursive): train"
    doc = await run(manager, manifest=[{"path": "val/none", "line": 7}], manifest_name="m.txt")
    assert doc["error"] == "manifest m.txt line 7: no such file or directory in the mount: val/none"
    assert store.stats.get_requests == 0
    for params, message in [
        ({"paths": ["../etc"]}, "'..' component"),
        ({"paths": ["/etc"]}, "relative to the mount root"),
        ({"paths": "train"}, "list of strings"),
        ({}, "nothing to prefetch"),
        ({"paths": ["a"], "parallel": 0}, "'parallel'"),
        ({"paths": ["a"], "check": True, "pin": True}, "do not go together"),
        ({"manifest": [{"path": "a", "line": 3, "size": "x"}]}, "line 3"),
    ]:
        with pytest.raises(ControlRequestError, match=message):
            PrefetchRequest.from_params(params)


async def test_manifest_detects_changed_and_deleted_objects(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manager = make(tmp_path, store)
    infos = {k: store._objects[k].info for k in ("train/a.bin", "train/b.bin", "val/d.bin")}
    manifest = [{"path": k, "line": n, "etag": i.etag, "size": i.size} for n, (k, i) in enumerate(infos.items(), 1)]
    store.put_object("train/b.bin", b"new bytes")
    store.delete_object("val/d.bin")
    doc = await run(manager, manifest=manifest)
    assert doc["state"] == "done" and not doc["ok"]
    assert {c["path"]: c["reason"] for c in doc["changed"]} == {"train/b.bin": "ETag differs", "val/d.bin": "deleted"}
    changed = next(c for c in doc["changed"] if c["path"] == "train/b.bin")
    assert changed["line"] == 2 and changed["expected_etag"] == infos["train/b.bin"].etag
    assert doc["files_cached"] == doc["files_total"] == 1  # the unchanged file was prefetched


async def test_cancel_then_resume_fetches_only_the_rest(tmp_path: Path, store: InMemoryObjectStore) -> None:
    for i in range(20):
        store.put_object(f"big/{i:02d}", data(str(i), 2 * BS))
    fetched: list[tuple[str, int]] = []
    gate = asyncio.Event()

    async def slow_get(key, etag, start, end, *, after=None):  # noqa: ANN001, ANN202
        if len(fetched) >= 6:
            await gate.wait()
        fetched.append((key, start))
        return await InMemoryObjectStore.get_range(store, key, etag, start, end)

    store.get_range = slow_get  # type: ignore[method-assign]
    manager = make(tmp_path, store)
    job = manager.start(PrefetchRequest.from_params({"paths": ["big"], "recursive": True, "parallel": 2}))
    while len(fetched) < 6:
        await asyncio.sleep(0.01)
    cancelled = manager.document(await manager.cancel(job.id))
    assert cancelled["state"] == "cancelled" and cancelled["error"] == "cancelled"
    gate.set()
    await manager.cache.close()  # loads in flight when it was cancelled still land on disk
    first = len(fetched)
    assert 6 <= first < 40
    doc = await run(manager, paths=["big"], recursive=True)
    assert doc["ok"] and doc["bytes_skipped"] == first * BS
    assert len(fetched) == 40 and len(set(fetched)) == 40  # every block fetched exactly once


async def test_lease_cancels_an_abandoned_job(tmp_path: Path, store: InMemoryObjectStore) -> None:
    blocked = asyncio.Event()

    async def hang(key, etag, start, end, *, after=None):  # noqa: ANN001, ANN202
        await blocked.wait()

    store.get_range = hang  # type: ignore[method-assign]
    manager = make(tmp_path, store)
    job = manager.start(PrefetchRequest.from_params({"paths": ["train"], "recursive": True, "lease_s": 0.2}))
    assert job.task is not None
    await asyncio.wait_for(job.task, 10)
    assert job.state is JobState.CANCELLED and "abandoned" in (job.error or "")
    blocked.set()


async def test_dataset_that_does_not_fit_is_rejected(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manager = make(tmp_path, store, disk_bytes=4 * BS)
    doc = await run(manager, paths=["train"], recursive=True)
    assert doc["state"] == "rejected"
    assert doc["error"].startswith("the files do not fit the disk tier: they take 384.")
    assert "raise --disk-cache" in doc["error"]
    assert store.stats.get_requests == 0
    no_disk = make(tmp_path / "nd", store, disk_bytes=0)
    doc = await run(no_disk, paths=["top.txt"])
    assert doc["state"] == "rejected" and "no disk tier" in doc["error"]


async def test_pins_limit_persistence_and_unpin(tmp_path: Path, store: InMemoryObjectStore) -> None:
    limit = 5 * BS
    manager = make(tmp_path, store, max_pinned=limit)
    doc = await run(manager, paths=["train/a.bin", "val/d.bin"], pin=True)
    assert doc["ok"] and doc["pin"]
    assert sorted(r.key for r in load_pin_file(tmp_path / "pins.json")) == ["train/a.bin", "val/d.bin"]
    over = await run(manager, paths=["train"], recursive=True, pin=True)
    assert over["state"] == "rejected" and over["error"].startswith("pin limit exceeded")
    assert len(manager.cache.pins) == 2  # unchanged
    # A new daemon on the same cache dir restores the pins.
    again = make(tmp_path, store, max_pinned=limit)
    await again.restore_pins()
    assert sorted(r.key for r in again.cache.pins.refs()) == ["train/a.bin", "val/d.bin"]
    assert again.cache.pin_stats()["cached_bytes"] == again.cache.pin_stats()["bytes"]
    # unpin by directory prefix; a path that does not exist is an error; no path unpins all.
    result = await again.unpin({"paths": ["train"]})
    assert result["files"] == 1 and result["pinned_objects"] == 1
    with pytest.raises(ControlRequestError, match="no such file or directory in the mount: nope"):
        await again.unpin({"paths": ["nope"]})
    assert (await again.unpin({"paths": ["top.txt"]}))["files"] == 0  # exists, not pinned: fine
    assert (await again.unpin({}))["files"] == 1
    assert load_pin_file(tmp_path / "pins.json") == []


async def test_snapshot_and_evict(tmp_path: Path, store: InMemoryObjectStore) -> None:
    store.put_object("train/a b/", b"")  # an empty directory marker
    store.put_object("train/x//y", b"bad")  # not a valid name: skipped
    manager = make(tmp_path, store)
    snap = await manager.snapshot({"path": "train"})
    assert [f["path"] for f in snap["files"]] == ["train/a.bin", "train/b.bin", "train/empty", "train/sub/c.bin"]
    assert snap["skipped_keys"] >= 1
    assert (await manager.snapshot({"path": "top.txt"}))["files"][0]["size"] == 10
    with pytest.raises(ControlRequestError, match="no such file"):
        await manager.snapshot({"path": "none"})
    await run(manager, paths=["train"], recursive=True, pin=False)
    await run(manager, paths=["val"], recursive=True, pin=True)
    result = await manager.evict({"paths": ["train/sub"]})
    assert result["files"] == 1 and result["blocks"] == 2
    check = await run(manager, paths=["train"], recursive=True, check=True)
    assert check["not_cached"] == ["train/sub/c.bin"]
    everything = await manager.evict({})
    assert everything["blocks"] > 0 and everything["pinned_bytes_kept"] > 0
    check = await run(manager, paths=["train", "val"], recursive=True, check=True)
    assert check["files_cached"] == 2  # the empty file, and the pinned val/d.bin
    with pytest.raises(ControlRequestError, match="'tier'"):
        await manager.evict({"tier": "cpu"})


async def test_listing_failure_fails_the_job(tmp_path: Path, store: InMemoryObjectStore) -> None:
    failing = FailingObjectStore(store, fail_lists=True)
    manager = make(tmp_path, failing)
    doc = await run(manager, paths=["train"], recursive=True)
    assert doc["state"] == "failed" and "injected failure" in doc["error"]


async def test_store_failure_during_fetch_is_a_per_file_failure(tmp_path: Path, store: InMemoryObjectStore) -> None:
    failing = FailingObjectStore(store)
    manager = make(tmp_path, failing)
    failing.on_get = lambda key, start, end: setattr(failing, "fail_gets", key == "train/b.bin")
    doc = await run(manager, paths=["train"], recursive=True)
    assert doc["state"] == "done" and not doc["ok"]
    assert [f["path"] for f in doc["failures"]] == ["train/b.bin"]
    assert doc["files_cached"] == 3


# ------------------------------------------------------------------------------------ the cluster tier
async def test_prefetch_tier_cluster_fills_only_the_cluster_tier_and_check_reports_it(
        tmp_path: Path, store: InMemoryObjectStore) -> None:
    from tiering.tiers.cluster import InMemoryClusterTier

    cluster = InMemoryClusterTier()
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS, disk_bytes=256 * BS, max_concurrent_fetches=4)
    cache = BlockCache(settings, store, RamTier(16 * BS), DiskTier(tmp_path / "cache", 256 * BS), cluster=cluster)
    manager = PrefetchManager(store, cache, pin_file=None)
    before = await run(manager, paths=["train"], recursive=True, check=True, tier="cluster")
    assert before["state"] == "done" and before["bytes_cached"] == 0 and not before["ok"]
    doc = await run(manager, paths=["train"], recursive=True, tier="cluster")
    assert doc["ok"] and doc["tier"] == "cluster" and doc["bytes_fetched"] == doc["bytes_total"] == 6 * BS + 5
    assert len(cluster.blocks) == 4 + 1 + 2 and len(cache.ram) == 0 and cache.disk is not None and len(cache.disk) == 0
    after = await run(manager, paths=["train"], recursive=True, check=True, tier="cluster")
    assert after["ok"] and after["bytes_cached"] == after["bytes_total"]
    again = await run(manager, paths=["train"], recursive=True, tier="cluster")
    assert again["ok"] and again["bytes_fetched"] == 0 and again["bytes_skipped"] == again["bytes_total"]


async def test_prefetch_tier_cluster_without_a_cluster_tier_or_with_pin_is_refused(
        tmp_path: Path, store: InMemoryObjectStore) -> None:
    manager = make(tmp_path, store)
    doc = await run(manager, paths=["train"], recursive=True, tier="cluster")
    assert doc["state"] == "rejected" and "--cluster-cache" in doc["error"]
    for params in ({"tier": "cloud"}, {"tier": "cluster", "pin": True}):
        with pytest.raises(ControlRequestError):
            PrefetchRequest.from_params({"paths": ["train"], **params})
