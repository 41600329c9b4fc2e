"""Announced read orders: the daemon side of ``cachefs.loader`` and ``cachefs prefetch --order``.

``POST /announce`` takes ``{"stream": id, "paths": [...], "append": false}``: the paths (relative to
the mount root) in the order the stream will open them. Without ``append`` the list replaces the
stream's order (a new epoch); with it, the list extends it (an order sent in pages); an empty list
without ``append`` ends the stream. The paths are resolved against the store the way prefetch jobs
resolve them (``cachefs.daemon.resolver``: one LIST per directory, the mount's naming rules), to the
object versions the engine keys its blocks by, and handed to the mount's ``ReadOrder``
(``tiering.policy.readorder``); the ``OrderPrefetcher`` (``tiering.engine.orderprefetch``) then fetches ahead of
each stream's reader.

Bad entries are reported, not fatal: paths that name nothing, directories, and paths that are not
valid mount-relative paths (absolute, ``..``, names the mount cannot show) are counted and the
first few named in the answer, and the rest of the order is announced. A request over a bound (too
many paths in one page, in one stream, in the mount) is refused whole with a one-line error
(HTTP 400) and changes nothing; the list is checked for size before anything is resolved, so a
huge list costs only its parsing (bounded by the control socket's request size).

``GET /announce`` lists the streams with their position and bytes fetched ahead. The counters are
in the ``announce`` section of ``/stats`` (``cachefs.daemon.stats``).
"""

from __future__ import annotations

from typing import Any

from cachefs.daemon.context import DaemonContext
from cachefs.daemon.control import ControlRequestError, ControlServer
from cachefs.daemon.resolver import Resolver
from cachefs.paths import PathError, check_path
from tiering.blocks import ObjectRef
from tiering.errors import ObjectStoreError
from tiering.engine.orderprefetch import OrderPrefetcher
from tiering.protocols import ObjectInfo, ObjectStore
from tiering.policy.readorder import ReadOrder, ReadOrderLimitError

# How many bad paths of each kind an answer names (the counts are always complete).
NAMES_IN_ANSWER = 20


class AnnounceService:
    def __init__(self, store: ObjectStore, order: ReadOrder, prefetcher: OrderPrefetcher) -> None:
        self.store = store
        self.order = order
        self.prefetcher = prefetcher

    async def announce(self, params: dict[str, Any]) -> dict[str, Any]:
        stream_id = params.get("stream")
        paths = params.get("paths")
        append = params.get("append", False)
        if not isinstance(stream_id, str) or not stream_id:
            raise ControlRequestError(400, "'stream' must be a non-empty string")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ControlRequestError(400, "'paths' must be a list of strings")
        if not isinstance(append, bool):
            raise ControlRequestError(400, "'append' must be true or false")
        limit = self.order.settings.max_page_entries
        if len(paths) > limit:
            raise ControlRequestError(400, f"announcement of {len(paths)} files is over the limit of {limit} per "
                                           f"request: announce long orders in pages (append)")
        invalid: list[str] = []
        valid: list[str] = []
        for path in paths:
            try:
                checked = check_path(path)
            except PathError:
                invalid.append(path)
                continue
            (valid if checked else invalid).append(checked or path)
        resolver = Resolver(self.store)
        refs: list[ObjectRef] = []
        missing: list[str] = []
        directories: list[str] = []
        try:
            await resolver.preload(valid)
            for path in valid:
                found = await resolver.lookup(path)
                if found is False:
                    missing.append(path)
                elif isinstance(found, ObjectInfo):
                    refs.append(ObjectRef(found.key, found.etag, found.size))
                else:
                    directories.append(path)
        except ObjectStoreError as exc:
            raise ControlRequestError(502, str(exc)) from None
        try:
            stream = self.order.announce(stream_id, refs, append=append)
        except ReadOrderLimitError as exc:
            raise ControlRequestError(400, str(exc)) from None
        return {
            "stream": stream_id,
            "files": len(refs),
            "bytes": sum(r.size for r in refs),
            "held": len(stream),
            "missing_count": len(missing),
            "missing": missing[:NAMES_IN_ANSWER],
            "invalid_count": len(invalid),
            "invalid": invalid[:NAMES_IN_ANSWER],
            "directories_count": len(directories),
            "directories": directories[:NAMES_IN_ANSWER],
            "window_bytes": self.prefetcher.window_bytes,
        }

    async def streams(self, _params: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"stream": s.id, "held": len(s), "position": s.position, "ahead_bytes": s.ahead_bytes()}
                for s in self.order.streams()]


def register_routes(control: ControlServer, service: AnnounceService) -> None:
    """Control routes (unix socket only: an order changes what the cache fetches and keeps)."""
    control.add_json_route("POST", "/announce", service.announce)
    control.add_json_route("GET", "/announce", service.streams)


class AnnounceFeature:
    def __init__(self, prefetcher: OrderPrefetcher) -> None:
        self.prefetcher = prefetcher

    async def start(self) -> None:
        self.prefetcher.start()

    async def stop(self) -> None:
        await self.prefetcher.stop()


def install(ctx: DaemonContext) -> AnnounceFeature:
    order = ctx.fs.read_order
    if order is None:  # a filesystem built without one (tests): announcements still work, eviction is LRU
        order = ctx.fs.read_order = ReadOrder(ctx.cache.block_size)
    prefetcher = OrderPrefetcher(order, ctx.cache)
    register_routes(ctx.control, AnnounceService(ctx.store, order, prefetcher))
    return AnnounceFeature(prefetcher)
