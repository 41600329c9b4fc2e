"""The S3 store's two GET engines, chosen by the length of the range.

A small file's block (under ``CURL_MAX_BYTES``) goes to one libcurl multi handle driven by one thread
(``tiering.objectstore.curlget``): a quarter of the CPU per GET of a worker pool, since no thread is
woken per request. A larger block goes to ``RangedGetter``'s threads (``tiering.objectstore.rangedget``),
whose ``MSG_WAITALL`` receive copies each byte once with the GIL released for the whole block. Each
engine is made on first use, with at most ``connections`` connections (threads) of its own.
"""

from __future__ import annotations

import asyncio

from tiering.objectstore.curlget import CURL_MAX_BYTES, CurlGetter
from tiering.objectstore.rangedget import RangedGetter


class GetEngines:
    def __init__(self, *, connections: int, connect_timeout_s: float, read_timeout_s: float,
                 ca_bundle: str | None) -> None:
        self._connections = connections
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._ca_bundle = ca_bundle
        self._curl: CurlGetter | None = None
        self._ranged: RangedGetter | None = None

    def for_length(self, length: int) -> CurlGetter | RangedGetter:
        """The engine for a range of ``length`` bytes."""
        connect_s, read_s = self._timeouts
        if length < CURL_MAX_BYTES:
            if self._curl is None:
                self._curl = CurlGetter(connections=self._connections, connect_timeout_s=connect_s,
                                        read_timeout_s=read_s, ca_bundle=self._ca_bundle)
            return self._curl
        if self._ranged is None:
            self._ranged = RangedGetter(threads=self._connections, connect_timeout_s=connect_s,
                                        read_timeout_s=read_s, ca_bundle=self._ca_bundle)
        return self._ranged

    async def close(self) -> None:
        """Both engines closed (running requests are aborted); a later ``for_length`` makes new ones."""
        curl, self._curl = self._curl, None
        ranged, self._ranged = self._ranged, None
        if ranged is not None:
            ranged.close()
        if curl is not None:
            await asyncio.to_thread(curl.close)  # it waits for libcurl's thread to end


__all__ = ["GetEngines"]
