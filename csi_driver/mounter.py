"""The mount seam: one small Protocol, the real implementation over the ``cachefs`` CLI, and a fake.

``CachefsMounter`` mounts by running ``cachefs mount`` in a subprocess, exactly as a person would,
so the driver exercises the same validation, start-up checks and daemonisation as the CLI. The call
returns once the mount is live (``cachefs mount`` waits for the daemon to report) or fails with the
CLI's one-line reason. Every subprocess runs under a bounded timeout.

Credentials reach the mount only through the child's environment (the standard ``AWS_*``
variables), never through its argv, which any user on the node can read in ``/proc/PID/cmdline``.
When a volume brings its own key pair, every other AWS credential source inherited from the node
plugin (a session token, a profile, web identity) is removed from that environment, so the pair is
used exactly as given and never combined with the node's own identity.

Bind mounts (a staged volume's mount shown at each pod's target, ``staging.py``) are made with
``mount(2)`` (``fusefd.bind``: on top of whatever is at the target, a dead mount included) and
removed with util-linux ``umount``: a bind never talks to the daemon, and removing one leaves the
daemon serving the staged mount and every other bind of it.

``FakeMounter`` keeps mounts in a dict; unit tests and the FlexVolume tests' doubles use it, and
can mark a mount broken or make the next call fail.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from cachefs import mounts
from csi_driver import fusefd
from csi_driver.attributes import CacheOptions, Credentials, MountPodResources, OwnerOptions
from csi_driver.errors import Code, CsiError
from csi_driver.redact import REGISTRY

log = logging.getLogger(__name__)

# `cachefs mount` waits up to 120 s for its daemon (a large disk tier is indexed at start-up, and the
# store check is bounded at 20 s); 10 s more covers interpreter start-up of the CLI itself. The
# kubelet gives NodePublishVolume about 2 minutes and retries; a retry that finds this call still
# running is answered ABORTED, and the one after it finds the mount live.
MOUNT_TIMEOUT_S = 130.0
# `cachefs unmount --timeout`: how long the daemon may take to flush dirty data and exit after the
# kernel unmount. Write-back uploads staged data first, so this is generous.
UNMOUNT_TIMEOUT_S = 100.0
# A lazy unmount of a dead FUSE mount is a single syscall; it never waits for anything.
LAZY_UNMOUNT_TIMEOUT_S = 15.0
# The errno a stat of a FUSE mount gets once its daemon is gone.
BROKEN_ERRNOS = frozenset({errno.ENOTCONN, errno.ECONNABORTED})
# AWS variables dropped from the mount's environment when the volume has its own credentials.
AWS_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)


@dataclass(frozen=True)
class MountRequest:
    """One mount to make. ``credentials`` is None to use the node plugin's own AWS identity."""

    source: str
    target: Path
    cache_dir: Path
    endpoint_url: str | None = None
    region: str | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    read_only: bool = False
    credentials: Credentials | None = field(default=None, repr=False)
    owner: OwnerOptions = field(default_factory=OwnerOptions)
    volume_id: str = ""  # for the daemon's launcher (a mount pod's labels); "" when unknown
    # Pod info of the publish that mounts (csi.storage.k8s.io/pod.*), where the CO sent it: where a
    # launcher reports Events. Empty for a mount made at stage.
    context: Mapping[str, str] = field(default_factory=dict)
    pod_resources: MountPodResources = field(default_factory=MountPodResources)  # the mount pod's (pod mode)


class Mounter(Protocol):
    def mount(self, request: MountRequest) -> None:
        """Mount, returning once the mount is live; ``CsiError`` if it cannot be made."""

    def unmount(self, target: Path) -> None:
        """Unmount (flushing dirty data first when the daemon is alive); a broken mount is detached."""

    def is_mounted(self, target: Path) -> bool:
        """Whether a cachefs mount (healthy or broken) is at ``target``."""

    def is_broken(self, target: Path) -> bool:
        """Whether ``target`` is a mount whose daemon is gone ("Transport endpoint is not connected")."""

    def bind(self, source: Path, target: Path, read_only: bool) -> None:
        """Bind-mount the cachefs mount at ``source`` on ``target`` (read-only: the bind refuses writes)."""

    def unbind(self, target: Path) -> None:
        """Remove the bind mount at ``target`` (lazily when its daemon is gone); the daemon is untouched.
        Where binds are stacked, the top one goes."""

    def layers(self, target: Path) -> int:
        """How many mounts are stacked at ``target`` (0: not a mount point)."""

    def relaunch(self, target: Path) -> None:
        """Mount ``target`` (a staged mount whose daemon died) again with a new daemon given what the
        first one was given, credentials included, without a request; ``CsiError`` where it cannot."""

    def resume(self) -> None:
        """At start-up: serve again what the live mounts' daemons need of the plugin (the passthrough
        brokers of ``HandoverMounter``); nothing is mounted or unmounted."""


def probe_broken(path: Path) -> bool:
    """Whether ``path`` is a FUSE mount whose daemon is gone.

    ``statvfs`` always reaches the daemon (the kernel caches no filesystem statistics), so it fails
    with ENOTCONN once the daemon is dead; a plain ``stat`` can still be answered from the kernel's
    attribute cache for up to ``--attr-ttl`` seconds after the daemon died.
    """
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno in BROKEN_ERRNOS
    return False


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else "no output"
    for prefix in ("cachefs: error: ", "cachefs: "):
        if line.startswith(prefix):
            line = line[len(prefix):]
    return REGISTRY.scrub(line)


class CachefsMounter:
    """Mounts by running the ``cachefs`` CLI. ``environ`` is the base environment of every mount."""

    def __init__(self, *, command: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                 mount_timeout_s: float = MOUNT_TIMEOUT_S, unmount_timeout_s: float = UNMOUNT_TIMEOUT_S,
                 log_level: str = "INFO") -> None:
        self.command = list(command or [sys.executable, "-m", "cachefs"])
        self.environ = dict(os.environ if environ is None else environ)
        self.mount_timeout_s = mount_timeout_s
        self.unmount_timeout_s = unmount_timeout_s
        self.log_level = log_level

    # -- helpers ------------------------------------------------------------------------------------
    def child_environ(self, request: MountRequest) -> dict[str, str]:
        env = dict(self.environ)
        if request.credentials is not None:
            for name in AWS_CREDENTIAL_VARIABLES:
                env.pop(name, None)
            env.update(request.credentials.environ())
        if request.region:
            env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = request.region
        return env

    def mount_argv(self, request: MountRequest) -> list[str]:
        argv = [*self.command, "mount", request.source, str(request.target), "--cache-dir", str(request.cache_dir)]
        if request.endpoint_url:
            argv += ["--endpoint-url", request.endpoint_url]
        argv += request.cache.cli_args()
        argv += request.owner.cli_args()
        if request.read_only:
            argv.append("--read-only")
        # Pods run as any uid; without allow_other only root (the node plugin) could enter the mount.
        # The kernel checks them against the owner and modes (FUSE default_permissions).
        argv += ["--allow-other", "--log-level", self.log_level]
        return argv

    def _run(self, argv: list[str], env: dict[str, str], timeout_s: float, what: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise CsiError(Code.DEADLINE_EXCEEDED, f"{what} did not finish within {timeout_s:g} s") from None
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"cannot run {argv[0]}: {exc.strerror or exc}") from None

    # -- Mounter ------------------------------------------------------------------------------------
    def mount(self, request: MountRequest) -> None:
        result = self._run(self.mount_argv(request), self.child_environ(request), self.mount_timeout_s,
                           f"mounting {request.source} on {request.target}")
        if result.returncode == 0:
            return
        reason = last_line(result.stderr)
        # Exit 2: the CLI refused its arguments (bad URL, size, mountpoint). Exit 1: the mount could
        # not be made (no bucket, access denied, endpoint down) - worth retrying later.
        code = Code.INVALID_ARGUMENT if result.returncode == 2 else Code.INTERNAL
        raise CsiError(code, f"cannot mount {request.source} on {request.target}: {reason}")

    def unmount(self, target: Path) -> None:
        if self.is_broken(target):
            self.detach(target)
            return
        argv = [*self.command, "unmount", str(target), "--timeout", f"{self.unmount_timeout_s:g}"]
        result = self._run(argv, dict(self.environ), self.unmount_timeout_s + 10, f"unmounting {target}")
        if result.returncode != 0 and self.is_mounted(target):
            raise CsiError(Code.INTERNAL, f"cannot unmount {target}: {last_line(result.stderr)}")

    def detach(self, target: Path) -> None:
        """Lazily detach a dead mount (``fusermount3 -u -z``): nothing is left to flush."""
        fusermount = shutil.which("fusermount3") or shutil.which("fusermount")
        if fusermount is None:
            raise CsiError(Code.FAILED_PRECONDITION, "fusermount3 is not installed on this node")
        result = self._run([fusermount, "-u", "-z", str(target)], dict(self.environ), LAZY_UNMOUNT_TIMEOUT_S,
                           f"detaching {target}")
        if result.returncode != 0 and self.is_mounted(target):
            raise CsiError(Code.INTERNAL, f"cannot detach broken mount {target}: {last_line(result.stderr)}")
        log.warning("detached the broken mount at %s (its daemon was gone)", target)

    def is_mounted(self, target: Path) -> bool:
        entry = mounts.find_mount(target)
        return entry is not None and entry.fstype == mounts.FSTYPE

    def is_broken(self, target: Path) -> bool:
        if not self.is_mounted(target):
            return False
        return probe_broken(target)

    def bind(self, source: Path, target: Path, read_only: bool) -> None:
        try:
            fusefd.bind(source, target, read_only=read_only)
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"cannot bind {source} on {target}: {exc.strerror or exc}") from None

    def layers(self, target: Path) -> int:
        """How many mounts are stacked at ``target`` (0: none); what a path lookup reaches is the last."""
        where = os.path.abspath(target)
        return sum(1 for entry in mounts.mount_entries() if entry.mountpoint == where)

    def resume(self) -> None:
        """Nothing to serve: a daemon this mounter starts mounts itself, as root."""

    def relaunch(self, target: Path) -> None:
        """Start the dead daemon of the mount at ``target`` again, without its credentials in hand;
        only a launcher that kept them can (``HandoverMounter`` over mount pods)."""
        raise CsiError(Code.FAILED_PRECONDITION, f"the daemon of {target} cannot be started again without a "
                                                 "publish (this mount mode keeps no credentials)")

    def unbind(self, target: Path) -> None:
        argv = ["umount", "-l", str(target)] if self.is_broken(target) else ["umount", str(target)]
        result = self._run(argv, dict(self.environ), LAZY_UNMOUNT_TIMEOUT_S, f"unbinding {target}")
        if result.returncode != 0 and self.is_mounted(target):
            raise CsiError(Code.INTERNAL, f"cannot remove the bind mount {target}: {last_line(result.stderr)}")


class FakeMounter:
    """In-memory ``Mounter`` for unit tests: no processes, no kernel mounts."""

    def __init__(self) -> None:
        self.mounts: dict[Path, MountRequest] = {}
        self.binds: dict[Path, tuple[Path, bool]] = {}  # target -> (source, read-only) of its top bind
        self._stacks: dict[Path, list[tuple[Path, bool, MountRequest]]] = {}  # every bind at a target
        # The mount each bind was made of: a bind of a dead daemon stays dead after a remount.
        self._bound_to: dict[Path, MountRequest] = {}
        self.broken: set[Path] = set()
        self.calls: list[tuple[str, Path]] = []
        self.fail_next: CsiError | None = None

    def _maybe_fail(self) -> None:
        error, self.fail_next = self.fail_next, None
        if error is not None:
            raise error

    def mount(self, request: MountRequest) -> None:
        self.calls.append(("mount", request.target))
        self._maybe_fail()
        if request.target in self.mounts:
            raise CsiError(Code.INVALID_ARGUMENT, f"mountpoint {request.target} is already mounted")
        self.mounts[request.target] = request

    def unmount(self, target: Path) -> None:
        self.calls.append(("unmount", target))
        self._maybe_fail()
        self.mounts.pop(target, None)
        self.broken.discard(target)

    def is_mounted(self, target: Path) -> bool:
        return target in self.mounts or target in self.binds

    def is_broken(self, target: Path) -> bool:
        if target in self.binds:
            source = self.binds[target][0]
            return source in self.broken or self.mounts.get(source) is not self._bound_to.get(target)
        return target in self.broken

    def bind(self, source: Path, target: Path, read_only: bool) -> None:
        self.calls.append(("bind", target))
        self._maybe_fail()
        assert source in self.mounts, f"{source} is not mounted"
        self._stacks.setdefault(target, []).append((source, read_only, self.mounts[source]))
        self._top(target)

    def unbind(self, target: Path) -> None:
        self.calls.append(("unbind", target))
        self._maybe_fail()
        stack = self._stacks.get(target)
        if stack:
            stack.pop()
        self._top(target)

    def _top(self, target: Path) -> None:
        stack = self._stacks.get(target)
        if stack:
            self.binds[target], self._bound_to[target] = stack[-1][:2], stack[-1][2]
        else:
            self._stacks.pop(target, None)
            self.binds.pop(target, None)
            self._bound_to.pop(target, None)

    def layers(self, target: Path) -> int:
        return len(self._stacks.get(target, ())) or int(target in self.mounts)

    def resume(self) -> None:
        """Nothing to serve: no daemons."""

    def relaunch(self, target: Path) -> None:
        """A new daemon for the dead mount at ``target``, given what the first one was given."""
        self.calls.append(("relaunch", target))
        self._maybe_fail()
        assert target in self.mounts, f"{target} is not mounted"
        self.mounts[target] = dataclasses.replace(self.mounts[target])  # a new connection: old binds stay dead
        self.broken.discard(target)

    def break_mount(self, target: Path) -> None:
        """Simulate the daemon of ``target`` dying (kill -9)."""
        assert target in self.mounts, f"{target} is not mounted"
        self.broken.add(target)
