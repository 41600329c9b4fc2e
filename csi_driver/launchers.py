"""Where a volume's FUSE daemon runs: the ``DaemonLauncher`` seam and its process implementation.

The node plugin mounts a volume itself (``fusefd``: it opens ``/dev/fuse`` and mounts it with
``fd=N``) and then has a launcher start the daemon that serves that mount. The daemon is started
with ``cachefs mount ... --fuse-fd-socket PATH``: it connects to the plugin's unix socket at PATH,
receives the mounted ``/dev/fuse`` descriptor (SCM_RIGHTS) and serves it, so it needs no privilege
and no view of the mountpoint. What a daemon is given is one ``DaemonSpec``; how it runs is the
launcher's business:

- ``ProcessLauncher`` (``cachefs-csi --mount-mode process``): a host process in its own session,
  optionally as another (unprivileged) user, its pid recorded in its run directory so a restarted
  plugin finds it again;
- ``csi_driver.mountpods.PodLauncher`` (``--mount-mode pod``): one mount pod per volume per node;
- ``FakeLauncher``: in memory, for unit tests.

A launcher only starts, watches and stops daemons: mounting, the handover and the unmount belong to
``csi_driver.handover.HandoverMounter``. A launcher never puts ``DaemonSpec.env`` (credentials) on
a command line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from cachefs import mounts
from cachefs.settings import STOP_MARGIN_S
from csi_driver.attributes import MountPodResources
from csi_driver.errors import Code, CsiError

log = logging.getLogger(__name__)

# The handover socket and the daemon's pid record, inside ``DaemonSpec.run_dir``.
HANDOVER_SOCKET = "fuse.sock"
PID_RECORD = "daemon.json"
# A daemon name: "cachefs-" and 20 hex digits, a valid DNS-1123 label (a pod name part).
NAME_PREFIX = "cachefs-"
_NAME_HEX = 20
# How often a wait re-checks a process.
POLL_S = 0.05


def daemon_name(target: Path) -> str:
    """The daemon name of the mount at ``target``: stable, so a restarted plugin finds it again."""
    return NAME_PREFIX + hashlib.sha256(str(target).encode()).hexdigest()[:_NAME_HEX]


@dataclass(frozen=True)
class DaemonSpec:
    """Everything a launcher needs to run the daemon of one mount.

    ``args`` are the ``cachefs`` arguments (after the program name), with no credentials: the launcher
    prepends its program (``python -m cachefs`` on the host, ``cachefs`` in the mount pod's image).
    ``env`` carries every AWS variable the daemon should see (the volume's Secret, or the node
    plugin's own identity where the volume names none), ``AWS_REGION`` and ``XDG_RUNTIME_DIR``; it
    holds secrets, so it never reaches an argv or a log. ``cache_dir`` and ``run_dir`` are host
    directories the daemon must see at the same paths (a mount pod gets them as hostPath volumes).
    """

    name: str  # daemon_name(target): the key of this daemon for start/is_running/stop/names
    volume_id: str  # the CSI volume id ("" when unknown: the FlexVolume shim)
    target: Path  # the mountpoint on the host (the staging path, or a pod's target when not staged)
    args: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    cache_dir: Path  # the volume's cache slot: read-write, same path in a pod
    run_dir: Path  # holds the handover socket and the control socket: read-write, same path in a pod
    read_only: bool = False
    uid: int | None = None  # run the daemon as this user (None: the launcher's own, root in a pod)
    gid: int | None = None
    ram_cache_bytes: int | None = None  # resource hints (None: cachefs's defaults)
    disk_cache_bytes: int | None = None
    # Pod info of the publish that made the mount (csi.storage.k8s.io/pod.name, pod.namespace,
    # pod.uid, serviceAccount.name), where the CO sent it: where to report Events. Empty at stage.
    context: Mapping[str, str] = field(default_factory=dict)
    log_file: Path | None = None  # a host process's log (ProcessLauncher); a pod logs to stderr
    # The volume's mountPod* attributes: the mount pod's requests and limits (PodLauncher only).
    pod_resources: MountPodResources = field(default_factory=MountPodResources)
    # The volume's stopTimeout (None: cachefs's default): how long the daemon uploads after SIGTERM,
    # which a mount pod's grace period must cover (PodLauncher).
    stop_timeout_s: float | None = None
    source: str = ""  # the volume's source URL: what the mount table shows (``fusefd.mount_fuse``)
    # The volume's fuseThreads (None: cachefs's default): the plugin hands the daemon that many
    # descriptors of the connection, the mounted one and clones (a mount pod cannot open /dev/fuse).
    fuse_threads: int | None = None

    @property
    def handover_socket(self) -> Path:
        return self.run_dir / HANDOVER_SOCKET

    def to_json(self) -> str:
        """Everything but the environment's values (credentials): what a restart needs besides them."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "env"}
        data["env_names"] = sorted(self.env)
        data["pod_resources"] = asdict(self.pod_resources)
        return json.dumps(data, default=str, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DaemonSpec:
        """A spec saved by ``to_json``; ``env`` holds the variables' names, each with an empty value."""
        data = json.loads(text)
        paths = {"target", "cache_dir", "run_dir", "log_file"}
        known = {f.name for f in fields(cls)} - {"env"}
        values: dict[str, Any] = {k: (Path(v) if k in paths and v is not None else v) for k, v in data.items()
                                  if k in known}
        values["args"] = tuple(values["args"])
        values["pod_resources"] = MountPodResources(**data.get("pod_resources") or {})
        return cls(env={name: "" for name in data.get("env_names", [])}, **values)


class DaemonLauncher(Protocol):
    def start(self, spec: DaemonSpec) -> None:
        """Start the daemon and return without waiting for it to serve; ``CsiError`` if it cannot be
        started. A daemon of the same name left over (not running any more) is replaced."""

    def restart(self, spec: DaemonSpec) -> None:
        """Start the daemon of ``spec`` again after it died, with the environment its first start was
        given (``spec.env`` holds only the names: the values were never written anywhere but where the
        launcher keeps them); ``CsiError`` FAILED_PRECONDITION where the launcher kept none."""

    def is_running(self, name: str) -> bool:
        """Whether the daemon ``name`` exists and has not exited (a pod: Pending or Running, so the
        plugin keeps waiting for its handover while the pod is scheduled and pulled)."""

    def stop(self, name: str, timeout_s: float) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL after ``timeout_s``, or after the daemon's own longer
        grace period where it declares one: a mount pod's terminationGracePeriodSeconds) and wait until
        it is gone; a daemon that does not exist is success. Bounded by that grace plus a few seconds."""

    def names(self) -> list[str]:
        """The daemons this launcher knows that are still running (for re-adoption at start-up)."""

    def describe(self, name: str) -> str:
        """Where to look for the daemon ``name`` (a pid and log file, a pod), for messages."""


# ------------------------------------------------------------------------------------------ process
def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), or None if it is gone or a zombie."""
    fields = mounts.process_stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


def _exit_status(proc: subprocess.Popen[bytes]) -> str:
    """How an exited child ended, in words: "exit status 3", "killed by SIGKILL"."""
    code = proc.returncode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class ProcessLauncher:
    """Daemons as host processes in their own sessions (``start_new_session``), so a plugin that
    dies or restarts leaves them serving. Each daemon's pid, start time and log file are written to
    ``<run_dir>/daemon.json``; a later plugin (a new ``ProcessLauncher`` over the same ``run_root``)
    finds the daemon there, and the start time guards against a reused pid.

    ``command`` is the program to run (default: this interpreter with ``-m cachefs``). ``environ`` is
    the base environment; its ``AWS_*`` variables are dropped, the spec's ``env`` supplies them.
    """

    def __init__(self, run_root: Path, *, command: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.run_root = run_root
        self.command = list(command or [sys.executable, "-m", "cachefs"])
        base = os.environ if environ is None else environ
        self.environ = {key: value for key, value in base.items() if not key.startswith("AWS_")}
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._ended: dict[str, str] = {}  # how each child of ours that exited ended, for messages

    def _record(self, name: str) -> Path:
        return self.run_root / name / PID_RECORD

    def _pid(self, name: str) -> int | None:
        """The live pid of daemon ``name`` (reaping it first if it is our own child that exited)."""
        child = self._children.get(name)
        if child is not None and child.poll() is not None:
            del self._children[name]
            self._ended[name] = _exit_status(child)
        record = self._read_record(name)
        if record is None:
            return None
        pid, started = record.get("pid"), record.get("started")
        # A record without a start time never matches: None is also what a dead pid reads as.
        return pid if isinstance(pid, int) and started is not None and _start_time(pid) == started else None

    def _read_record(self, name: str) -> dict | None:
        try:
            data = json.loads(self._record(name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def start(self, spec: DaemonSpec) -> None:
        if self.is_running(spec.name):
            raise CsiError(Code.ALREADY_EXISTS, f"daemon {spec.name} is already running ({self.describe(spec.name)})")
        log_path = spec.log_file or spec.run_dir / "daemon.log"
        proc, started = self._spawn(spec, log_path)
        if started is None:
            # Gone before its start time could be read: it died as it started, and has said nothing
            # (a daemon that runs at all writes its log). Seen under a full test run, with an empty log;
            # once more, so a transient failure does not fail the publish, and never a third time.
            status = _exit_status(proc)
            log.warning("daemon %s for %s exited as it started (%s; log %s); starting it once more",
                        spec.name, spec.target, status, log_path)
            proc, started = self._spawn(spec, log_path)
            if started is None:
                raise CsiError(Code.INTERNAL, f"the daemon of {spec.target} exited as it started, twice "
                                              f"({_exit_status(proc)}; log {log_path})")
        self._children[spec.name] = proc
        self._ended.pop(spec.name, None)
        record = self._record(spec.name)
        record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = record.with_name(record.name + ".tmp")
        # The daemon's own grace after SIGTERM (its stop timeout, for uploads, plus the margin to exit),
        # kept with the pid so a later plugin's stop honours it too.
        grace = spec.stop_timeout_s + STOP_MARGIN_S if spec.stop_timeout_s is not None else None
        tmp.write_text(json.dumps({"pid": proc.pid, "started": started, "log": str(log_path),
                                   "target": str(spec.target), "grace_s": grace}) + "\n")
        os.replace(tmp, record)
        log.info("started daemon %s for %s: pid %d, log %s", spec.name, spec.target, proc.pid, log_path)

    def _spawn(self, spec: DaemonSpec, log_path: Path) -> tuple[subprocess.Popen[bytes], str | None]:
        """The daemon's process and its start time, None if it is already gone (reaped then)."""
        argv = [*self.command, *spec.args]
        if spec.log_file is not None:
            argv += ["--log-file", str(spec.log_file)]
        env = {**self.environ, **spec.env}
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:
                if spec.uid is not None:
                    os.fchown(out.fileno(), spec.uid, spec.gid if spec.gid is not None else -1)
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd="/",
                    start_new_session=True, close_fds=True,
                    user=spec.uid, group=spec.gid, extra_groups=[] if spec.uid is not None else None,
                )
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"cannot start the daemon of {spec.target}: {exc.strerror or exc}") from None
        started = _start_time(proc.pid)
        if started is None:
            proc.wait(timeout=10)  # a zombie already, or gone: reaped at once
        return proc, started

    def restart(self, spec: DaemonSpec) -> None:
        raise CsiError(Code.FAILED_PRECONDITION, f"daemon {spec.name} cannot be started again without a publish: "
                                                 "a host process's environment (credentials) is kept nowhere")

    def is_running(self, name: str) -> bool:
        return self._pid(name) is not None

    def stop(self, name: str, timeout_s: float) -> None:
        pid = self._pid(name)
        if pid is not None:
            own = (self._read_record(name) or {}).get("grace_s")
            if isinstance(own, (int, float)) and own > timeout_s:
                timeout_s = float(own)  # never cut the uploads of a volume with a longer stopTimeout short
            self._signal(pid, signal.SIGTERM)
            if not self._wait_gone(name, timeout_s):
                log.warning("daemon %s (pid %d) did not exit within %g s of SIGTERM; killing it", name, pid, timeout_s)
                self._signal(pid, signal.SIGKILL)
                if not self._wait_gone(name, 10.0):
                    raise CsiError(Code.INTERNAL, f"daemon {name} (pid {pid}) survived SIGKILL")
        self._record(name).unlink(missing_ok=True)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _wait_gone(self, name: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pid(name) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def names(self) -> list[str]:
        try:
            candidates = sorted(p.name for p in self.run_root.iterdir() if p.name.startswith(NAME_PREFIX))
        except OSError:
            return []
        return [name for name in candidates if self.is_running(name)]

    def describe(self, name: str) -> str:
        pid = self._pid(name)
        record = self._read_record(name) or {}
        ended = self._ended.get(name)
        where = f"pid {pid}" if pid is not None else f"not running ({ended})" if ended else "not running"
        return f"daemon {where}, log {record.get('log', 'unknown')}"


# --------------------------------------------------------------------------------------------- fake
class FakeLauncher:
    """In-memory ``DaemonLauncher`` for unit tests: records specs, runs nothing."""

    def __init__(self) -> None:
        self.specs: dict[str, DaemonSpec] = {}
        self.running: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.fail_next: CsiError | None = None

    def start(self, spec: DaemonSpec) -> None:
        self.calls.append(("start", spec.name))
        error, self.fail_next = self.fail_next, None
        if error is not None:
            raise error
        self.specs[spec.name] = spec
        self.running.add(spec.name)

    def restart(self, spec: DaemonSpec) -> None:
        self.calls.append(("restart", spec.name))
        kept = self.specs[spec.name]  # as a pod launcher keeps the Secret: the first start's environment
        self.specs[spec.name] = DaemonSpec(**{**{f.name: getattr(spec, f.name) for f in fields(spec)}, "env": kept.env})
        self.running.add(spec.name)

    def is_running(self, name: str) -> bool:
        return name in self.running

    def stop(self, name: str, timeout_s: float) -> None:
        self.calls.append(("stop", name))
        self.running.discard(name)

    def names(self) -> list[str]:
        return sorted(self.running)

    def describe(self, name: str) -> str:
        return f"fake daemon {name}"

    def die(self, name: str) -> None:
        """Simulate the daemon exiting (a crash, an OOM kill)."""
        self.running.discard(name)
