"""Before a cluster hit is served: proof that this volume's own source credentials may read the object.

Why. The cluster tier is shared by every volume of the same source, whoever mounts it: a block in
it was fetched by some node with *its* volume's credentials. A volume whose credentials may list a
bucket but not read from it (or may read only part of it) would otherwise read, through the cluster
tier, what the source would refuse it. So a cluster hit is served only once this volume's source
store has answered a one-byte GET of the object with ``If-Match: <the ETag the block belongs to>``.
A GET, not a HEAD: S3 answers HEAD under ``s3:GetObject`` too, but a HEAD returns no byte of the
object, so it does not show that the volume may decrypt it (an SSE-KMS object needs ``kms:Decrypt``
for its bytes, HEAD may not ask for it, and a volume without it must not read them through the
cluster tier); the one byte costs the same round trip. An empty object has no block to serve: a HEAD is enough for it.

Cost. The proof is per object version, remembered in memory (``AUTHORIZED_MAX`` versions, least
recently used dropped first) and shared by concurrent loads (one request in flight per version): a
file read block by block costs one HEAD, not one per block, and a later epoch over the same files
costs nothing, nor does a block the node copied to its disk tier (served from there without the
cluster tier). Measured on the shuffled 100 KiB epoch (``benchmarks/cluster_authorization.py``): one
one-byte GET per file on the first epoch through the cluster tier, none after (docs/security.md).

Answers. The source's ETag differs (the object changed: 412, ``ObjectChangedError``): no proof, the hit is dropped and the load
goes to the source, which answers for the new version. The source refuses (``AccessDeniedError``):
raised, counted in ``cluster_refused``, so the read fails as the source's own GET would (EACCES),
and nothing cluster-cached is returned. The source is unreachable or slow: no proof, the hit is
dropped; the load goes on to the source and meets its circuit there (a volume never proven may not
read the cluster tier while its source is down). Refusals and failures are never remembered.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from tiering.blocks import ObjectRef
from tiering.engine.stats import EngineStats
from tiering.errors import AccessDeniedError, ObjectChangedError, ObjectStoreError
from tiering.protocols import ObjectStore
from tiering.storehealth import StoreHealth

log = logging.getLogger("tiering.engine.authorize")

# Object versions proven readable, remembered: ~200 bytes each, so 100,000 are ~20 MB, more files
# than one epoch of most datasets opens through the cluster tier before its blocks are on disk.
AUTHORIZED_MAX = 100_000


class SourceAuthorization:
    """Proofs, per object version, that the source lets this volume read it (the module docstring)."""

    def __init__(self, store: ObjectStore, stats: EngineStats, *, timeout_s: float,
                 health: StoreHealth | None = None, max_entries: int = AUTHORIZED_MAX) -> None:
        self._store = store
        self._health = health
        self._stats = stats
        self._timeout_s = timeout_s
        self._max = max_entries
        self._proven: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._inflight: dict[tuple[str, str], asyncio.Future[bool]] = {}

    def proven(self, ref: ObjectRef) -> bool:
        return (ref.key, ref.etag) in self._proven

    async def check(self, ref: ObjectRef) -> bool:
        """Whether a cluster hit of ``ref`` may be served; raises ``AccessDeniedError`` if the source
        refuses this volume the object."""
        version = (ref.key, ref.etag)
        if version in self._proven:
            self._proven.move_to_end(version)
            return True
        pending = self._inflight.get(version)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._inflight[version] = fut
        try:
            allowed = await self._ask(ref)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(exc)
                fut.exception()  # retrieved: joiners may be none
            raise
        else:
            fut.set_result(allowed)
        finally:
            self._inflight.pop(version, None)
        if allowed:
            self._proven[version] = None
            while len(self._proven) > self._max:
                self._proven.popitem(last=False)
        return allowed

    async def _ask(self, ref: ObjectRef) -> bool:
        if self._health is not None and not self._health.reachable:
            return False  # a source known to be down: no request, no proof (the load meets its circuit)
        self._stats.cluster_authorizations += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                if ref.size == 0:
                    return (await self._store.head(ref.key)).etag == ref.etag
                await self._store.get_range(ref.key, ref.etag, 0, 1)  # If-Match: this version or 412
        except AccessDeniedError:
            self._stats.cluster_refused += 1
            raise
        except ObjectChangedError:
            return False
        except (ObjectStoreError, TimeoutError) as exc:
            log.debug("cluster tier: could not prove %r readable from the source (%s); the hit is not served",
                      ref.key, exc or "timeout")
            return False
        return True


__all__ = ["AUTHORIZED_MAX", "SourceAuthorization"]
