"""The object store's health circuit, and the deadline every store call runs under.

A store that refuses connections fails each request at once. A *frozen* one (a network partition, a
load balancer that accepts and never answers, a server stopped with SIGSTOP) fails nothing: each
request waits for its socket timeouts, botocore retries it, and a reader of data it already has sits
behind a revalidation for minutes. Two things keep a frozen store from freezing the mount:

**Deadlines.** Every store call a caller makes goes through ``StoreHealth.call`` with a deadline
around the whole call, botocore's retries included (``asyncio.timeout``: the call is cancelled, and
aiobotocore/aiohttp close the connection of a cancelled request). Metadata calls get a short one
(``FsSettings.metadata_timeout_s``), block fetches the fetch timeout, uploads one scaled by size.
A deadline that passes raises ``ObjectStoreUnavailableError``, like a refused connection. A LIST
is the one call made of many requests (a page per 1,000 keys): the listing cache gives its deadline
to each request (``request_deadline``, a context variable the S3 store reads around each request,
botocore's retries included), so a frozen store fails the first page within it while a directory of
a million keys on a live store is never cut short.

**The circuit.** One ``StoreHealth`` per mount, shared by reads, metadata and write-back. A timeout
or a connection failure opens it (the store is *unreachable*); while it is open, ``call`` fails at
once without touching the store, so revalidation serves stale metadata at once, uncached reads fail
at once and write-back stops sending. The state machine is ``tiering.health.TierHealth`` with one
failure enough to go down and the probe interval as its cool-down: while down, at most one probe per
interval (``maybe_probe``, started by whoever finds the circuit open; nobody waits for it) runs the
store's cheap ``check()`` (one LIST of at most one key) under ``probe_timeout_s``. Any answer from
the store, a probe's or a request's that was already in flight, closes the circuit and wakes the
listeners (write-back resumes uploading). A store that answers with an error (403, 404, 412) is
reachable: only timeouts and ``ObjectStoreUnavailableError`` open the circuit.

The log gets one line when the circuit opens and one when it closes (``TierHealth``'s), so an outage
of an hour costs two lines, not one per request. ``snapshot()`` is what ``/stats`` and ``/metrics``
show: the state, how long it has lasted, and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from tiering.clock import Clock
from tiering.errors import ObjectStoreError, ObjectStoreUnavailableError
from tiering.health import TierHealth, TierState

log = logging.getLogger("tiering.storehealth")

T = TypeVar("T")

# While the store is unreachable, one probe every 5 s: a store that comes back is in use again
# within seconds (a training job stalls no longer than it must), and a dead one costs one tiny
# LIST per 5 s.
DEFAULT_PROBE_INTERVAL_S = 5.0
# A probe is one LIST of at most one key, answered in milliseconds by a live store; 3 s tolerates a
# loaded one without letting a frozen one keep the probe slot long.
DEFAULT_PROBE_TIMEOUT_S = 3.0


_REQUEST_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar("store_request_timeout",
                                                                              default=None)


@contextlib.contextmanager
def request_deadline(timeout_s: float | None) -> Iterator[None]:
    """Inside this block (and tasks it creates), each store request runs under ``timeout_s``."""
    token = _REQUEST_TIMEOUT.set(timeout_s)
    try:
        yield
    finally:
        _REQUEST_TIMEOUT.reset(token)


def request_timeout() -> float | None:
    """The per-request deadline the caller set with ``request_deadline`` (None: none)."""
    return _REQUEST_TIMEOUT.get()


class StoreState(enum.StrEnum):
    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"


class StoreHealth:
    """The circuit: reachable until a timeout or connection failure, then one probe per interval."""

    def __init__(
        self,
        clock: Clock,
        *,
        probe: Callable[[], Awaitable[Any]] | None = None,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        name: str = "object store",
    ) -> None:
        if probe_interval_s <= 0 or probe_timeout_s <= 0:
            raise ValueError("the store probe interval and timeout must be positive")
        self.clock = clock
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._probe = probe
        self._tier = TierHealth(clock, unstable_after=1, down_after=1, cooldown_s=probe_interval_s,
                                name=name)
        self._probe_task: asyncio.Task[None] | None = None
        self._down_since: float | None = None
        self._listeners: list[Callable[[], None]] = []
        self.outages = 0  # times the circuit opened
        self.timeouts = 0  # calls whose deadline passed
        self.short_circuited = 0  # calls failed at once because the circuit was open
        self.probes = 0

    # ------------------------------------------------------------------ state
    @property
    def reachable(self) -> bool:
        return self._tier.state is not TierState.DOWN

    @property
    def state(self) -> StoreState:
        return StoreState.REACHABLE if self.reachable else StoreState.UNREACHABLE

    def unreachable_for(self) -> float:
        """Seconds since the circuit opened (0 while the store is reachable)."""
        since = self._down_since
        return 0.0 if since is None else max(0.0, self.clock.monotonic() - since)

    def on_reachable(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` each time the circuit closes (the store answered again)."""
        self._listeners.append(listener)

    def record_success(self) -> None:
        was_down = not self.reachable
        self._tier.record_success()
        if was_down:
            self._down_since = None
            for listener in list(self._listeners):
                try:
                    listener()
                except Exception:  # noqa: BLE001 - one listener must not keep the others from hearing it
                    log.exception("a store-health listener failed")

    def record_failure(self, exc: BaseException | None = None) -> None:
        if self.reachable:
            self.outages += 1
            self._down_since = self.clock.monotonic()
        self._tier.record_failure(exc)

    # ------------------------------------------------------------------ calls
    async def call(self, make: Callable[[], Awaitable[T]], timeout_s: float | None, what: str, *,
                   started_at: float | None = None) -> T:
        """``await make()`` under a deadline of ``timeout_s`` (None: none), through the circuit.

        ``started_at`` (loop time) counts the deadline from an earlier moment: the FUSE request, say.

        Raises ``ObjectStoreUnavailableError`` at once while the circuit is open, or when the
        deadline passes (which opens it).
        """
        self.check_reachable(what)
        try:
            async with asyncio.timeout_at(_deadline(timeout_s, started_at)):
                result = await make()
        except TimeoutError as exc:
            self.timeouts += 1
            self.record_failure(exc)
            raise ObjectStoreUnavailableError(f"{what}: {_late(timeout_s)}") from exc
        except ObjectStoreUnavailableError as exc:
            self.record_failure(exc)
            raise
        except ObjectStoreError:
            self.record_success()  # it answered, with an error: reachable
            raise
        self.record_success()
        return result

    def check_reachable(self, what: str) -> None:
        """Raise ``ObjectStoreUnavailableError`` at once (and maybe start a probe) while the circuit is open."""
        if self.reachable:
            return
        self.short_circuited += 1
        self.maybe_probe()
        raise ObjectStoreUnavailableError(
            f"{what}: the object store is unreachable (for {self.unreachable_for():.0f} s); not waiting for it")

    def maybe_probe(self) -> None:
        """Start one probe if the circuit is open, none is running and the interval has passed."""
        if self.reachable or self._probe is None:
            return
        if self._probe_task is not None and not self._probe_task.done():
            return
        if not self._tier.usable():  # at most one per interval
            return
        self.probes += 1
        self._probe_task = asyncio.get_running_loop().create_task(self._run_probe(self._probe))

    async def _run_probe(self, probe: Callable[[], Awaitable[Any]]) -> None:
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await probe()
        except (TimeoutError, ObjectStoreUnavailableError) as exc:
            log.debug("object store probe failed: %s", exc or type(exc).__name__)
            self.record_failure(exc)
        except ObjectStoreError:
            self.record_success()  # an answer, even an error, means the store is there
        except Exception as exc:  # noqa: BLE001 - a probe must never kill the loop
            log.debug("object store probe failed unexpectedly", exc_info=True)
            self.record_failure(exc)
        else:
            self.record_success()

    async def close(self) -> None:
        task, self._probe_task = self._probe_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "unreachable_for_s": round(self.unreachable_for(), 3),
            "outages": self.outages,
            "timeouts": self.timeouts,
            "short_circuited": self.short_circuited,
            "probes": self.probes,
        }


async def bounded(health: StoreHealth | None, make: Callable[[], Awaitable[T]], timeout_s: float | None,
                  what: str, *, started_at: float | None = None) -> T:
    """``health.call``, or where there is no circuit (tests, tools) the same deadline alone."""
    if health is not None:
        return await health.call(make, timeout_s, what, started_at=started_at)
    try:
        async with asyncio.timeout_at(_deadline(timeout_s, started_at)):
            return await make()
    except TimeoutError as exc:
        raise ObjectStoreUnavailableError(f"{what}: {_late(timeout_s)}") from exc


def _deadline(timeout_s: float | None, started_at: float | None) -> float | None:
    if timeout_s is None:
        return None
    return (asyncio.get_running_loop().time() if started_at is None else started_at) + timeout_s


def _late(timeout_s: float | None) -> str:
    if timeout_s is None:
        return "the object store timed out"
    return f"the object store did not answer within {timeout_s:g} s"
