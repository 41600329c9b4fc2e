"""cachefs.loader without a mount: pages, path mapping, epochs, ranks, a mount that cannot be told.

The daemon is replaced by a recorder of the request bodies (``request_json`` and ``control_socket``
patched in the module): what the loader sends is the subject here; the route itself is tested on a
real mount (tests/fuse/test_announce.py).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from cachefs import loader
from cachefs.client import UsageError

MNT = "/mnt/data"


class FakeDaemon:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.missing: set[str] = set()

    def request_json(self, sock: str, route: str, *, method: str, body: dict[str, Any], timeout_s: float) -> Any:
        assert (sock, route, method) == ("sock", "/announce", "POST")
        self.bodies.append(body)
        found = [p for p in body["paths"] if p not in self.missing]
        missing = [p for p in body["paths"] if p in self.missing]
        return {"files": len(found), "bytes": 10 * len(found), "missing_count": len(missing), "missing": missing,
                "invalid_count": 0, "invalid": [], "directories_count": 0, "directories": []}


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch) -> FakeDaemon:
    fake = FakeDaemon()
    monkeypatch.setattr(loader, "control_socket", lambda _path: "sock")
    monkeypatch.setattr(loader, "request_json", fake.request_json)
    return fake


def test_announce_pages_and_reports(daemon: FakeDaemon) -> None:
    daemon.missing = {"d/gone"}
    paths = [f"{MNT}/d/{i}" for i in range(5)] + [f"{MNT}/d/gone", "/elsewhere/x", "rel/y"]
    result = loader.announce(MNT, paths, stream="s", cwd=MNT, page_entries=3)
    assert [b["paths"] for b in daemon.bodies] == [["d/0", "d/1", "d/2"], ["d/3", "d/4", "d/gone"], ["rel/y"]]
    assert [b["append"] for b in daemon.bodies] == [False, True, True]
    assert (result.files, result.bytes, result.missing, result.invalid) == (6, 60, ["d/gone"], ["/elsewhere/x"])
    assert not result.ok


def test_an_empty_order_ends_the_stream(daemon: FakeDaemon) -> None:
    loader.announce(MNT, [], stream="s")
    assert daemon.bodies == [{"stream": "s", "paths": [], "append": False}]
    # An order of paths all outside the mount is reported, and does not end the stream.
    result = loader.announce(MNT, ["/etc/passwd"], stream="s")
    assert len(daemon.bodies) == 1 and result.invalid == ["/etc/passwd"]


def test_sampler_yields_indices_unchanged_and_announces_each_epoch(daemon: FakeDaemon) -> None:
    order = [3, 1, 4, 1, 5, 9, 2, 6]
    sampler = loader.AnnouncingSampler(order, MNT, path_of=lambda i: f"{MNT}/f{i}", stream="s", page_entries=3)
    assert len(sampler) == 8
    for _epoch in range(2):
        daemon.bodies.clear()
        assert list(sampler) == order
        sent = [p for b in daemon.bodies for p in b["paths"]]
        assert sent == [f"f{i}" for i in order]
        assert daemon.bodies[0]["append"] is False and all(b["append"] for b in daemon.bodies[1:])


def test_sampler_pages_as_iteration_goes(daemon: FakeDaemon) -> None:
    sampler = loader.AnnouncingSampler(range(10), MNT, path_of=lambda i: f"{MNT}/f{i}", page_entries=2)
    it = iter(sampler)
    next(it)
    assert len(daemon.bodies) == 1 + loader.PAGES_AHEAD  # the first page and one ahead, not the epoch
    list(it)
    assert len(daemon.bodies) == 5


class FakeDistributedSampler:
    """What AnnouncingSampler uses of torch's DistributedSampler: iteration, len, rank, set_epoch."""

    def __init__(self, size: int, rank: int, replicas: int) -> None:
        self.size, self.rank, self.replicas, self.epoch = size, rank, replicas, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = sorted(range(self.size), key=lambda i: (i * 7919 + self.epoch) % self.size)
        return iter(order[self.rank :: self.replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.replicas))


def test_each_rank_announces_its_own_part_under_its_own_stream(daemon: FakeDaemon) -> None:
    class Dataset:
        samples = [(f"{MNT}/img{i}.jpg", i % 3) for i in range(12)]  # ImageFolder-style (path, class)

    parts = []
    for rank in range(3):
        inner = FakeDistributedSampler(12, rank, 3)
        sampler = loader.AnnouncingSampler(inner, MNT, dataset=Dataset())
        sampler.set_epoch(4)
        assert inner.epoch == 4
        daemon.bodies.clear()
        indices = list(sampler)
        expected = FakeDistributedSampler(12, rank, 3)
        expected.set_epoch(4)
        assert indices == list(expected)
        assert [b["paths"] for b in daemon.bodies] == [[f"img{i}.jpg" for i in indices]]
        assert daemon.bodies[0]["stream"].endswith(f":rank{rank}")
        parts.append(set(indices))
    assert set().union(*parts) == set(range(12)) and sum(len(p) for p in parts) == 12


def test_a_mount_that_cannot_be_told_costs_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def not_a_mount(_path: Any) -> str:
        raise UsageError("/mnt/data is not a mountpoint")

    monkeypatch.setattr(loader, "control_socket", not_a_mount)
    sampler = loader.AnnouncingSampler([2, 0, 1], MNT, path_of=lambda i: f"{MNT}/f{i}")
    assert list(sampler) == [2, 0, 1] and list(sampler) == [2, 0, 1]
    assert sampler.failures == 2
    assert len([r for r in caplog.records if "could not announce" in r.getMessage()]) == 1
    with pytest.raises(loader.AnnounceError, match="not a mountpoint"):
        list(loader.AnnouncingSampler([0], MNT, path_of=lambda i: f"{MNT}/f{i}", strict=True))


def test_a_dataset_without_paths_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="has none of the attributes samples, imgs, paths, files; pass path_of="):
        loader.AnnouncingSampler([0], MNT, dataset=object())


def test_importing_cachefs_loader_never_imports_torch() -> None:
    code = "import sys, cachefs, cachefs.loader, cachefs.cli.main; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
