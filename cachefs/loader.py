"""Tell a cachefs mount what a data loader will read next: ``announce`` and ``AnnouncingSampler``.

A training epoch reads a shuffled permutation of files. When the loader announces that order, the
daemon fetches ahead of the reader (many small GETs in parallel, within a bounded window) and ranks
eviction by the order (``tiering.policy.readorder``), so the first epoch runs at the store's parallel GET
rate and a dataset larger than the cache is not thrashed by LRU.

``announce(mountpoint, paths, stream=...)`` sends an order to the daemon of the mount, in pages
(``POST /announce``, ``cachefs.daemon.announce``): paths are taken as a shell would (absolute, or
relative to ``cwd``); paths outside the mount, missing ones and directories are reported in the
result, not raised, and the rest of the order is announced.

``AnnouncingSampler`` wraps any sampler, or any iterable of indices, for a PyTorch ``DataLoader``:
each time iteration starts (each epoch) it takes the epoch's order from the wrapped sampler, maps
the indices to paths (``path_of(index)``, or the dataset's ``samples``/``imgs``/``paths``/``files``
attribute, whose items may be ``(path, label)`` pairs), announces them, and yields the indices
unchanged. It is duck-typed: it never imports torch (torch is the optional ``cachefs[torch]``
extra, and importing cachefs never imports it). The sampler runs in the DataLoader's main process
and the workers open the files in about that order, which the daemon follows (positions tolerate
workers a few files apart). With ``DistributedSampler`` each rank's process wraps its own sampler
and announces its own part, under a stream id naming its rank; ``set_epoch`` is passed through.
Long epochs are announced in pages as iteration goes (the daemon holds a bounded order per
stream). A mount that cannot be told (not a cachefs mount, daemon gone) costs one warning and
nothing else: the indices flow as ever.

This module reaches the daemon only through ``cachefs.client`` (an import-linter contract).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from cachefs.client import ControlError, UsageError, control_socket, request_json
from cachefs.paths import PathError, mount_relative

log = logging.getLogger(__name__)

# Paths per request: 20,000 paths is ~1 MB of JSON, resolved by the daemon in one pass (one LIST
# per directory) well within the control timeout; the daemon refuses pages over 100,000.
DEFAULT_PAGE_ENTRIES = 20_000
# Pages the sampler keeps announced ahead of its own position: the daemon fetches within a window
# far smaller than a page, so one page ahead is enough, and the daemon holds at most ~3 pages.
PAGES_AHEAD = 1
# Resolving a page lists its directories on the store: allow more than a status query.
ANNOUNCE_TIMEOUT_S = 60.0
# How many problem paths a result keeps by name (the counts are complete).
NAMES_KEPT = 20
# The attributes of a dataset that commonly list its files, in order (torchvision's ImageFolder and
# DatasetFolder have ``samples`` and ``imgs`` of (path, class) pairs).
DATASET_PATH_ATTRIBUTES = ("samples", "imgs", "paths", "files")


class AnnounceError(Exception):
    """The order could not be announced (not a cachefs mount, daemon unreachable, over a bound)."""


@dataclass
class AnnounceResult:
    """What an announcement did, summed over its pages."""

    stream: str
    files: int = 0
    bytes: int = 0
    missing_count: int = 0
    missing: list[str] = field(default_factory=list)
    invalid_count: int = 0  # not a valid path in the mount (or outside it)
    invalid: list[str] = field(default_factory=list)
    directories_count: int = 0
    directories: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing_count or self.invalid_count or self.directories_count)

    def add(self, answer: dict[str, Any]) -> None:
        self.files += int(answer.get("files", 0))
        self.bytes += int(answer.get("bytes", 0))
        for kind in ("missing", "invalid", "directories"):
            setattr(self, f"{kind}_count", getattr(self, f"{kind}_count") + int(answer.get(f"{kind}_count", 0)))
            kept: list[str] = getattr(self, kind)
            kept.extend(answer.get(kind, [])[: NAMES_KEPT - len(kept)])


def default_stream(rank: int | None = None) -> str:
    """A stream id unique to this process (and rank): ``host:pid[:rankN]``."""
    base = f"{socket.gethostname()}:{os.getpid()}"
    return base if rank is None else f"{base}:rank{rank}"


def _call(sock: str, body: dict[str, Any]) -> Any:
    def send() -> Any:
        return request_json(sock, "/announce", method="POST", body=body, timeout_s=ANNOUNCE_TIMEOUT_S)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return send()
    # Called from a thread running an event loop (a notebook): the client needs a loop of its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(send).result()


def announce(mountpoint: str | os.PathLike[str], paths: Iterable[str | os.PathLike[str]], *,
             stream: str | None = None, append: bool = False, cwd: str | None = None,
             page_entries: int = DEFAULT_PAGE_ENTRIES) -> AnnounceResult:
    """Announce that ``stream`` will open ``paths`` in this order (module docstring).

    Without ``append`` the order replaces the stream's previous one (a new epoch); an empty list
    ends the stream. Raises ``AnnounceError`` with a one-line reason if nothing could be announced.
    """
    if page_entries < 1:
        raise ValueError("page_entries must be at least 1")
    root = os.path.abspath(mountpoint)
    base = cwd if cwd is not None else os.getcwd()
    result = AnnounceResult(stream or default_stream())
    relative: list[str] = []
    for p in paths:
        text = os.fspath(p)
        try:
            relative.append(mount_relative(text, root, base))
        except PathError:
            result.invalid_count += 1
            if len(result.invalid) < NAMES_KEPT:
                result.invalid.append(text)
    if not relative and result.invalid_count:
        return result  # nothing in the mount to announce (an empty request would end the stream)
    try:
        sock = control_socket(Path(root))
        first = True
        for start in range(0, max(len(relative), 1), page_entries):
            page = relative[start : start + page_entries]
            body = {"stream": result.stream, "paths": page, "append": append or not first}
            result.add(_call(sock, body))
            first = False
    except (UsageError, ControlError) as exc:
        raise AnnounceError(str(exc)) from None
    return result


def _dataset_paths(dataset: Any) -> Callable[[int], str]:
    for name in DATASET_PATH_ATTRIBUTES:
        items = getattr(dataset, name, None)
        if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
            def path_of(index: int, items: Sequence[Any] = items) -> str:
                item = items[index]
                return os.fspath(item[0] if isinstance(item, tuple) else item)
            return path_of
    raise ValueError(f"cannot map indices to paths: {type(dataset).__name__} has none of the attributes "
                     f"{', '.join(DATASET_PATH_ATTRIBUTES)}; pass path_of=")


class AnnouncingSampler:
    """Wraps a sampler (or any iterable of indices); announces each epoch's order (module docstring).

    ``path_of(index)`` gives the path of a sample; without it, ``dataset`` must list its files in
    one of ``DATASET_PATH_ATTRIBUTES``. ``stream`` defaults to one per process and rank.
    ``strict=True`` raises ``AnnounceError`` instead of warning when the mount cannot be told.
    """

    def __init__(self, sampler: Iterable[int], mountpoint: str | os.PathLike[str], *,
                 path_of: Callable[[int], str | os.PathLike[str]] | None = None, dataset: Any = None,
                 stream: str | None = None, page_entries: int = DEFAULT_PAGE_ENTRIES,
                 strict: bool = False) -> None:
        if path_of is None:
            if dataset is None:
                raise ValueError("AnnouncingSampler needs path_of= or dataset= to map indices to paths")
            path_of = _dataset_paths(dataset)
        self.sampler = sampler
        self.mountpoint = os.fspath(mountpoint)
        self.path_of = path_of
        rank = getattr(sampler, "rank", None)
        self.stream = stream or default_stream(rank if isinstance(rank, int) else None)
        self.page_entries = page_entries
        self.strict = strict
        self.last_result: AnnounceResult | None = None
        self.failures = 0
        self._warned = False

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Passed to the wrapped sampler (``DistributedSampler`` reshuffles by epoch)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)
        page = self.page_entries
        announced = 0  # pages announced so far
        for n, index in enumerate(order):
            if n % page == 0:
                while announced <= n // page + PAGES_AHEAD and announced * page < max(len(order), 1):
                    self._announce(order[announced * page : (announced + 1) * page], append=announced > 0)
                    announced += 1
            yield index
        if not order:
            self._announce([], append=False)

    def _announce(self, indices: list[int], *, append: bool) -> None:
        try:
            paths = [self.path_of(i) for i in indices]
            result = announce(self.mountpoint, paths, stream=self.stream, append=append,
                              page_entries=self.page_entries)
        except AnnounceError as exc:
            self.failures += 1
            if self.strict:
                raise
            if not self._warned:
                self._warned = True
                log.warning("cachefs: could not announce the read order to %s: %s", self.mountpoint, exc)
            return
        if not append or self.last_result is None:
            self.last_result = result
        else:
            self.last_result.add({**vars(result)})
