"""Fixtures for tests on a real FUSE mount, made by the real ``cachefs`` CLI in a subprocess.

FUSE tests skip with a clear reason where /dev/fuse is missing, except when CACHEFS_REQUIRE_FUSE=1
(set by .ci/run): there a machine without FUSE fails the run instead of silently skipping it.
Every mount made here is unmounted at teardown, and only daemons this fixture started are killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cachefs import mounts

CLI = [sys.executable, "-m", "cachefs"]
# Upper bound for any CLI call in a test: a mount waits for the store check (bounded at 20 s).
CLI_TIMEOUT_S = 90


def fuse_unavailable_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


def require_fuse(what: str = "FUSE tests") -> None:
    """Skip the calling test where FUSE cannot run; fail it instead under CACHEFS_REQUIRE_FUSE=1 (CI)."""
    reason = fuse_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CACHEFS_REQUIRE_FUSE") == "1":
        pytest.fail(f"{what} cannot run: {reason} (CACHEFS_REQUIRE_FUSE=1)")
    pytest.skip(f"{what} need a working FUSE: {reason}")


@pytest.fixture(autouse=True)
def _require_fuse() -> None:
    require_fuse()


def read_dropping_page_cache(path: Path) -> bytes:
    """Drop the kernel's cached pages of the file first (FUSE has no O_DIRECT for us), then read:
    every byte comes from the daemon (its RAM or disk tier) or, through passthrough, the backing file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


@dataclass
class Mount:
    path: Path
    cache_dir: Path
    source: str
    env: dict[str, str]
    pid: int | None = None
    args: list[str] = field(default_factory=list)
    stderr: str = ""  # what `cachefs mount` said (its warnings, the mounted line)

    def stats(self) -> dict:
        result = run_cli("stats", str(self.path), "--json", env=self.env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def gets(self) -> int:
        return self.stats()["object_store"]["get_requests"]

    def stats_port(self) -> int:
        """The port ``--stats-addr HOST:0`` bound (named by the control socket's ``/info``): tests ask
        for port 0, not for a port found free, which another process may take before the daemon binds."""
        from cachefs.client import call

        addr = call(self.path, "/info")["stats_addr"]
        return int(addr.rpartition(":")[2])

    def unmount(self) -> subprocess.CompletedProcess[str]:
        result = run_cli("unmount", str(self.path), env=self.env)
        if result.returncode != 0:  # what the daemon said last goes into the failing assertion's message
            result.stderr += self.daemon_log_tail()
            print(f"cachefs unmount {self.path} failed (exit {result.returncode}):\n{result.stderr}")  # shown whole
        return result

    def daemon_log_tail(self, lines: int = 60) -> str:
        text = ""
        for log in sorted(self.cache_dir.glob("*/daemon.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            text += f"\n--- the last {len(tail)} lines of {log}:\n" + "\n".join(tail)
        return text

    @property
    def mounted(self) -> bool:
        return mounts.find_mount(self.path) is not None


class Mounter:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.mounts: list[Mount] = []
        self._n = 0

    def mount(
        self,
        source: str,
        *extra: str,
        env: dict[str, str] | None = None,
        cache_dir: Path | None = None,
        mountpoint: Path | None = None,
        check: bool = True,
    ) -> Mount:
        self._n += 1
        path = mountpoint or self.base / f"mnt{self._n}"
        path.mkdir(parents=True, exist_ok=True)
        cache = cache_dir or self.base / f"cache{self._n}"
        mount = Mount(path, cache, source, dict(env or {}), args=list(extra))
        result = run_cli("mount", source, str(path), "--cache-dir", str(cache), *extra, env=env)
        if check:
            assert result.returncode == 0, f"mount failed: {result.stderr}"
        if result.returncode != 0:
            raise MountFailed(result)
        mount.stderr = result.stderr
        self.mounts.append(mount)
        info = self._info(mount)
        mount.pid = info.get("pid")
        return mount

    def _info(self, mount: Mount) -> dict:
        from cachefs.client import call

        return call(mount.path, "/info")

    def cleanup(self) -> None:
        for mount in reversed(self.mounts):
            if mount.mounted:
                result = mount.unmount()
                if result.returncode != 0 and mount.mounted:
                    subprocess.run(["fusermount3", "-u", "-z", str(mount.path)], capture_output=True, timeout=30)
            if mount.pid is not None:
                _kill_if_alive(mount.pid)


class MountFailed(Exception):
    def __init__(self, result: subprocess.CompletedProcess[str]) -> None:
        super().__init__(result.stderr)
        self.result = result


def _kill_if_alive(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def mounter(tmp_path: Path):
    m = Mounter(tmp_path)
    try:
        yield m
    finally:
        m.cleanup()
