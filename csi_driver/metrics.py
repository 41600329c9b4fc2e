"""The node plugin's Prometheus endpoint: the driver's own counters and every mount's metrics.

One scrape target per node (``--metrics-addr``, port 9810 in deploy/): each cachefs daemon serves
``/metrics`` on its control socket, and this endpoint collects them all, adding the labels
``volume_id`` and ``target_path`` to every sample, so a dashboard can follow one volume across
nodes. The driver's own series:

- ``cachefs_csi_operations_total{method, code}``: CSI calls answered, by gRPC status code.
- ``cachefs_csi_mounts{state}``: cachefs mounts on the node, ``healthy`` or ``broken`` (a daemon
  gone: the mount answers "Transport endpoint is not connected" until republished; or a daemon
  that did not answer the scrape in time). Every pod's bind of a staged volume counts too (its
  health only; its daemon's metrics come once, with the staged mount's), probed through its path,
  so what counts is the top of the target's stack: what a pod whose volume mount propagates from
  the host (``HostToContainer``) sees, since a recovery stacks the new bind on the dead one
  (``NodeOps._stack_bind``). A target whose bind could not be restored is broken, and says so,
  until the pod's unpublish. (A pod without HostToContainer keeps the dead bind whatever the top
  is: the plugin cannot see into it; docs say so.)
- ``cachefs_csi_mount_pods_ended_with_staged_writes_total``: mount pods that ended (deleted, evicted,
  died) leaving acknowledged writes journaled on this node, not in the bucket
  (``podwatch.StagedWritesReporter``); the next mount of the volume on this node uploads them.

Mounts are found in the mount table (fstype ``fuse.cachefs``) and counted when this plugin's cache
root holds their publish record, so other cachefs mounts on the host are left out; a broken one is counted, never
waited on. Each mount's scrape is bounded by ``MOUNT_SCRAPE_TIMEOUT_S``.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import http.server
import logging
import os
import re
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

from cachefs import mounts
from cachefs.mounts import CONTROL_XATTR
from csi_driver.mounter import BROKEN_ERRNOS

log = logging.getLogger(__name__)

OPERATIONS_TOTAL = "cachefs_csi_operations_total"
MOUNTS = "cachefs_csi_mounts"
ENDED_WITH_STAGED_WRITES_TOTAL = "cachefs_csi_mount_pods_ended_with_staged_writes_total"
# A daemon answers /metrics from memory in milliseconds; a wedged one must not stall the scrape.
MOUNT_SCRAPE_TIMEOUT_S = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Mount scrapes in flight at once; also the most threads a set of wedged daemons can hold.
SCRAPE_WORKERS = 8
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=SCRAPE_WORKERS, thread_name_prefix="scrape")

_operations: Counter[tuple[str, str]] = Counter()
_lock = threading.Lock()
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


_ended_with_staged_writes = 0


def record(method: str, code: str) -> None:
    with _lock:
        _operations[(method, code)] += 1


def record_staged_writes_left() -> None:
    """A mount pod ended with writes still journaled on this node."""
    global _ended_with_staged_writes
    with _lock:
        _ended_with_staged_writes += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def scrape_mount(target: str) -> str | None:
    """The ``/metrics`` text of the daemon serving ``target``; None if it is broken or silent."""
    try:
        path = os.getxattr(target, CONTROL_XATTR).decode()
        conn = _UnixHTTPConnection(path, MOUNT_SCRAPE_TIMEOUT_S)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read().decode(errors="replace")
        finally:
            conn.close()
    except OSError as exc:
        if exc.errno not in BROKEN_ERRNOS:
            log.debug("cannot scrape the mount at %s: %s", target, exc)
        return None
    except http.client.HTTPException as exc:
        log.debug("cannot scrape the mount at %s: %s", target, exc)
        return None
    return body if response.status == 200 else None


def merge(documents: Iterable[tuple[dict[str, str], str]]) -> list[str]:
    """Merge Prometheus text documents, adding each one's labels to its samples, one block per family."""
    order: list[str] = []
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for labels, text in documents:
        extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in meta:
                        order.append(family)
                        meta[family], samples[family] = [], []
                    if len(meta[family]) < 2 and line not in meta[family]:
                        meta[family].append(line)
                continue
            match = _NAME.match(line)
            if not line.strip() or match is None:
                continue
            name, rest = match.group(0), line[match.end():]
            key = family if family and name.startswith(family) else name
            if key not in meta:
                order.append(key)
                meta[key], samples[key] = [], []
            if rest.startswith("{"):
                body = rest[1:]
                sample = f"{name}{{{extra},{body}" if not body.startswith("}") else f"{name}{{{extra}{body}"
            else:
                sample = f"{name}{{{extra}}}{rest}"
            samples[key].append(sample)
    out: list[str] = []
    for family in order:
        out += meta[family] + samples[family]
    return out


def render(targets: Callable[[], dict[str, str]], binds: Callable[[], dict[str, str]] = dict) -> str:
    """The whole document: the driver's counters, then every healthy mount's metrics. ``binds``:
    the pods' binds of staged volumes (target -> volume id), counted by state, never scraped twice."""
    lines = [f"# HELP {OPERATIONS_TOTAL} CSI calls answered, by method and gRPC status code.",
             f"# TYPE {OPERATIONS_TOTAL} counter"]
    with _lock:
        counts = sorted(_operations.items())
    lines += [f'{OPERATIONS_TOTAL}{{method="{m}",code="{c}"}} {n}' for (m, c), n in counts]
    with _lock:
        left = _ended_with_staged_writes
    lines += [f"# HELP {ENDED_WITH_STAGED_WRITES_TOTAL} Mount pods that ended leaving writes journaled on this node, "
              "not in the bucket.", f"# TYPE {ENDED_WITH_STAGED_WRITES_TOTAL} counter",
              f"{ENDED_WITH_STAGED_WRITES_TOTAL} {left}"]
    documents, states = [], Counter({"healthy": 0, "broken": 0})
    found = sorted(targets().items())
    # In parallel, on a bounded pool, with one deadline: a wedged daemon (its getxattr never
    # answered) costs one worker and is reported broken, and the scrape still returns in time.
    bound = sorted((t, v) for t, v in binds().items() if t not in dict(found))
    futures = [(target, volume_id, scraped, _POOL.submit(scrape_mount, target))
               for scraped, pairs in ((True, found), (False, bound)) for target, volume_id in pairs]
    deadline = time.monotonic() + MOUNT_SCRAPE_TIMEOUT_S + 1
    for target, volume_id, scraped, future in futures:
        try:
            text = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            text = None
        states["healthy" if text is not None else "broken"] += 1
        if text is not None and scraped:
            documents.append(({"volume_id": volume_id, "target_path": target}, text))
    lines += [f"# HELP {MOUNTS} cachefs mounts on this node, by state.", f"# TYPE {MOUNTS} gauge"]
    lines += [f'{MOUNTS}{{state="{state}"}} {n}' for state, n in sorted(states.items())]
    lines += merge(documents)
    return "\n".join(lines) + "\n"


def cachefs_targets(volume_of: Callable[[str], str | None]) -> dict[str, str]:
    """Every cachefs mount this driver published -> its volume id.

    A cachefs mount on the node without a publish record in the driver's cache root (one an
    administrator made by hand, or another driver instance's) is not this plugin's to report.
    """
    found = {}
    for entry in mounts.mount_entries():
        if entry.fstype != mounts.FSTYPE:
            continue
        volume_id = volume_of(entry.mountpoint)
        if volume_id is not None:
            found[entry.mountpoint] = volume_id
    return found


def serve(address: str, targets: Callable[[], dict[str, str]],
          binds: Callable[[], dict[str, str]] = dict) -> http.server.ThreadingHTTPServer:
    """Serve ``/metrics`` on ``HOST:PORT`` from a daemon thread; returns the server (``shutdown()``)."""
    host, _, port = address.rpartition(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = render(targets, binds).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes every 15 s are not news
            pass

    host = host.strip("[]")  # [fd00::1]:9810 as well as fd00::1:9810 (a pod's IPv6 address)

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host or "0.0.0.0", int(port)), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def volume_lookup(cache_root: Path) -> Callable[[str], str | None]:
    """Map a target path to the volume id recorded in its cache slot (node.py's publish records)."""
    import json

    def lookup(target: str) -> str | None:
        for record in (cache_root / "volumes").glob("*/slot-*/publish.json"):
            try:
                data = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("target") == target:
                return str(data.get("volume_id") or "")
        return None

    return lookup
