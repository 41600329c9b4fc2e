"""Helpers shared by the write-back tests on a real mount (``tests/fuse/test_writeback_*.py``).

What a user can observe is all these helpers look at: POSIX calls through the mount, the ``cachefs``
CLI (``flush``, ``unmount``), and the objects in the bucket read back with boto3. Nothing here
imports the write-back engine.

Directories in the bucket (see the README and ``tiering.writeback``): ``mkdir`` writes a directory
marker object ``dir/`` and ``rmdir`` deletes it; a directory is also implied by any key below it.
``bucket_problems`` therefore checks, against a local model directory:

* files: exactly the model's files, byte for byte (no extra, no missing key);
* markers: none for a directory the model does not have (a removed or renamed directory must not
  come back on the next mount), and every model directory is represented, by a marker or by a key
  below it; an empty model directory needs its marker, or it would vanish. Where every directory
  was made through the mount (the model test), each must have its marker: the README says a
  directory made with ``mkdir`` is a marker and lives until ``rmdir``.

Every wait is bounded; processes are signalled only by the PIDs the test itself recorded.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from tests.fuse.conftest import Mount, run_cli

MiB = 1024 * 1024
T = TypeVar("T")

# Upper bound of a `cachefs flush` the tests expect to succeed: everything the tests write drains
# from a loopback SeaweedFS in seconds; the margin is for a loaded 2-core CI runner.
FLUSH_TIMEOUT_S = 120
# Keys per ListObjectsV2 page asked for by ``list_keys`` (the S3 maximum and default).
LIST_PAGE_KEYS = 1000
# Upper bound for a kill -9'd daemon to be gone (it is not our child: we poll /proc).
DEATH_WAIT_S = 10.0


def s3env(server: Any) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the CLI --------------------------------------------------------------------------------------


def flush(mount: Mount, timeout_s: float = FLUSH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``cachefs flush MOUNTPOINT --timeout S``; the subprocess itself is bounded a bit beyond S."""
    return run_cli("flush", str(mount.path), "--timeout", f"{timeout_s:g}", env=mount.env, timeout=timeout_s + 60)


def flush_ok(mount: Mount, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    result = flush(mount, timeout_s)
    assert result.returncode == 0, (
        f"cachefs flush failed (exit {result.returncode}):\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )


# -- bounded calls ----------------------------------------------------------------------------------


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a daemon thread and fail (not hang) if it has not returned within ``timeout_s``.

    A FUSE call that never returns cannot be interrupted from Python; the thread is left behind (the
    mount fixture's teardown unmounts lazily and kills the daemon, which releases it).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"bounded:{what}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"{what} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


# -- daemons ----------------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead: it holds no files and no mount)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state follows the parenthesised command name, which may itself contain ") ".
    state = text.rpartition(")")[2].split()[0]
    return state not in ("Z", "X")


def kill9(mount: Mount) -> None:
    """SIGKILL the daemon this test started for ``mount`` (by its recorded PID) and wait until it is gone."""
    assert mount.pid is not None, "the mount fixture did not record the daemon's pid"
    try:
        os.kill(mount.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + DEATH_WAIT_S
    while pid_alive(mount.pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon {mount.pid} still alive {DEATH_WAIT_S:g} s after SIGKILL")
        time.sleep(0.02)


def clear_dead_mount(mount: Mount) -> str:
    """Take away the mount of a dead daemon; returns which way worked (for the test's report).

    ``cachefs unmount`` must clear a mount whose daemon died (README); a refusal is accepted only if
    ``--force`` then clears it (the flush-first rule cannot flush through a dead daemon). The lazy
    ``fusermount3 -u -z`` is the fixture's last resort and is reported as a failure of the CLI.
    """
    plain = mount.unmount()
    if not mount.mounted:
        return "cachefs unmount"
    forced = run_cli("unmount", str(mount.path), "--force", env=mount.env)
    if not mount.mounted:
        return "cachefs unmount --force"
    subprocess.run(["fusermount3", "-u", "-z", str(mount.path)], capture_output=True, timeout=30)
    raise AssertionError(
        "cachefs unmount could not clear the mount of a killed daemon:\n"
        f"plain: exit {plain.returncode}: {plain.stderr.strip()}\n"
        f"--force: exit {forced.returncode}: {forced.stderr.strip()}"
    )


# -- trees ------------------------------------------------------------------------------------------


def read_tree(root: Path) -> tuple[dict[str, bytes], set[str]]:
    """``(files, dirs)`` below ``root``: relative path -> bytes, and relative directory paths."""
    files: dict[str, bytes] = {}
    dirs: set[str] = set()

    def walk(directory: Path, rel: str) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            child = f"{rel}/{entry.name}" if rel else entry.name
            st = os.stat(entry.path, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                dirs.add(child)
                walk(Path(entry.path), child)
            elif stat.S_ISREG(st.st_mode):
                data = Path(entry.path).read_bytes()
                assert len(data) == st.st_size, f"{child}: stat says {st.st_size} bytes, read gave {len(data)}"
                files[child] = data
            else:
                raise AssertionError(f"unexpected file type {stat.filemode(st.st_mode)} at {child}")

    walk(root, "")
    return files, dirs


def tree_problems(model: Path, mount: Path, *, limit: int = 20) -> list[str]:
    """Differences between two trees (names, types, sizes, bytes), at most ``limit`` of them."""
    m_files, m_dirs = read_tree(model)
    f_files, f_dirs = read_tree(mount)
    problems: list[str] = []
    for d in sorted(m_dirs ^ f_dirs):
        problems.append(f"directory {d!r} only in the {'model' if d in m_dirs else 'mount'}")
    for name in sorted(set(m_files) | set(f_files)):
        a, b = m_files.get(name), f_files.get(name)
        if a is None or b is None:
            problems.append(f"file {name!r} only in the {'model' if b is None else 'mount'}")
        elif a != b:
            problems.append(f"file {name!r} differs: {describe_diff(a, b)}")
    return problems[:limit]


def describe_diff(expected: bytes, actual: bytes) -> str:
    if len(expected) != len(actual):
        head = f"model {len(expected)} bytes, got {len(actual)}"
    else:
        head = f"{len(expected)} bytes"
    first = next((i for i, (x, y) in enumerate(zip(expected, actual)) if x != y), min(len(expected), len(actual)))
    return f"{head}, first difference at offset {first}"


# -- the bucket -------------------------------------------------------------------------------------


def list_keys(client: Any, bucket: str, prefix: str) -> dict[str, dict[str, Any]]:
    """Every object under ``prefix`` (all pages): key -> {"size", "etag"}.

    A full page answered "not truncated" is not trusted: SeaweedFS (4.48) answers a recursive
    ListObjectsV2 whose page of 1,000 keys ends exactly on a directory marker that is the last entry
    of its parent with ``IsTruncated: false``, so every key below that marker would be missed (the
    crash test once reported a whole trial directory "lost" that way). After a full page the listing
    goes on from its last key (``StartAfter``) until a page comes back short.
    """
    out: dict[str, dict[str, Any]] = {}
    token: str | None = None
    start_after: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE_KEYS}
        if token:
            kwargs["ContinuationToken"] = token
        elif start_after:
            kwargs["StartAfter"] = start_after
        page = client.list_objects_v2(**kwargs)
        contents = page.get("Contents", [])
        for obj in contents:
            out[obj["Key"]] = {"size": obj["Size"], "etag": obj["ETag"]}
        if page.get("IsTruncated"):
            token, start_after = page["NextContinuationToken"], None
        elif len(contents) >= LIST_PAGE_KEYS:
            last = contents[-1]["Key"]
            assert start_after is None or last > start_after, f"listing {prefix!r} does not advance past {last!r}"
            token, start_after = None, last  # see the docstring: check past it
        else:
            return out


def get_bytes(client: Any, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def read_bucket(client: Any, bucket: str, prefix: str) -> tuple[dict[str, bytes], set[str]]:
    """``(files, markers)`` under ``prefix`` (``prefix`` ends with ``/`` or is empty): relative key ->
    bytes for objects, relative directory path for marker objects (``a/b/`` -> ``a/b``). A marker for
    the prefix itself (the mount root) is ignored."""
    files: dict[str, bytes] = {}
    markers: set[str] = set()
    for key in list_keys(client, bucket, prefix):
        rel = key[len(prefix):]
        if rel == "":
            continue
        if rel.endswith("/"):
            markers.add(rel[:-1])
        else:
            files[rel] = get_bytes(client, bucket, key)
    return files, markers


def bucket_problems(client: Any, bucket: str, prefix: str, model: Path, *, every_dir_marked: bool = False,
                    limit: int = 20) -> list[str]:
    """How the bucket under ``prefix`` differs from the model tree (see the module docstring).

    ``every_dir_marked``: every model directory must have its marker (true when every directory was
    made through the mount: ``mkdir``, and ``rename`` of a directory, write markers).
    """
    m_files, m_dirs = read_tree(model)
    b_files, markers = read_bucket(client, bucket, prefix)
    problems: list[str] = []
    for name in sorted(set(m_files) | set(b_files)):
        a, b = m_files.get(name), b_files.get(name)
        if a is None:
            problems.append(f"object {prefix + name!r} ({len(b or b'')} bytes) is not a file of the model")
        elif b is None:
            problems.append(f"file {name!r} ({len(a)} bytes) is missing from the bucket")
        elif a != b:
            problems.append(f"object {prefix + name!r} differs from the model: {describe_diff(a, b)}")
    for d in sorted(markers - m_dirs):
        problems.append(f"directory marker {prefix + d + '/'!r} for a directory the model does not have")
    implied = {"/".join(name.split("/")[:i]) for name in b_files for i in range(1, name.count("/") + 1)}
    implied |= {"/".join(d.split("/")[:i]) for d in markers for i in range(1, d.count("/") + 1)}
    for d in sorted(m_dirs - markers - implied):
        problems.append(f"directory {d!r} is neither a marker nor implied by a key below it")
    if every_dir_marked:
        for d in sorted((m_dirs - markers) & implied):
            problems.append(f"directory {d!r} (made through the mount) has no marker {prefix + d + '/'!r}")
    return problems[:limit]


# -- workload data ----------------------------------------------------------------------------------


def errno_name(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


# -- a slow link to the store -----------------------------------------------------------------------


class LoopbackProxy:
    """A TCP proxy on 127.0.0.1 in front of a store, for tests that change the link, not the server.

    ``rate_bytes_per_s``: the bytes sent towards the store (uploads) are limited to that rate over all
    connections together, so a test can make the store slower than its writers; replies pass
    unthrottled. ``freeze()``: new connections are accepted and never answered, and what arrives on
    open ones is swallowed (a silent partition, not a refused connection); ``thaw()`` drops what was
    in flight, as a healed partition resets it, and forwards again. Threads and plain sockets;
    ``close`` stops everything (bounded).
    """

    CHUNK = 64 * 1024

    def __init__(self, target_port: int, rate_bytes_per_s: float | None = None, port: int = 0) -> None:
        self.target = ("127.0.0.1", target_port)
        self.rate = rate_bytes_per_s
        self._lock = threading.Lock()
        self._next_free = time.monotonic()
        self._frozen = threading.Event()
        self._thawed = threading.Event()
        self._closed = threading.Event()
        self._held: list[socket.socket] = []  # accepted while frozen: never answered
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", port))  # port: 0, or a closed proxy's again
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True, name="loopback-proxy")
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self._thawed.clear()
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()
        self._thawed.set()
        with self._lock:
            held, self._held = self._held, []
        for sock in held:
            _close(sock)

    def _throttle(self, nbytes: int) -> None:
        assert self.rate is not None
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.rate
            wait = self._next_free - now
        if wait > 0:
            self._closed.wait(wait)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._frozen.is_set():
                with self._lock:
                    self._held.append(client)  # the kernel's buffers take what it sends; no answer
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, towards_store in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, towards_store), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, towards_store: bool) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(self.CHUNK)
                if not data:
                    break
                if self._frozen.is_set():
                    self._thawed.wait(600)  # swallowed, never answered; the thaw drops the connection
                    break
                if towards_store and self.rate is not None:
                    self._throttle(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def close(self) -> None:
        self._closed.set()
        self._thawed.set()
        self._listener.close()
        with self._lock:
            sockets = self._sockets + self._held
        for sock in sockets:
            _close(sock)
        self._thread.join(5)

    def __enter__(self) -> "LoopbackProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
