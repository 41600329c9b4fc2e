"""``HandoverMounter``: the node plugin mounts, a launched daemon serves (the ``Mounter`` of
``--mount-mode process`` and ``--mount-mode pod``).

A mount is made in this order, every step bounded, and undone whole on any failure (the daemon
stopped, the mount detached lazily):

1. the daemon's run directory (``<run_root>/<name>``, mode 0700) is prepared, and it and the cache
   slot are handed to the daemon's user when the daemon runs as another user;
2. the plugin mounts ``/dev/fuse`` at the target itself (``fusefd.mount_fuse``);
3. it listens on ``<run_dir>/fuse.sock`` and has the launcher start ``cachefs mount ...
   --fuse-fd-socket <run_dir>/fuse.sock`` (``launchers.DaemonSpec``);
4. it sends the daemon the fd, with ``fuseThreads - 1`` clones of its connection for the daemon's
   reader threads (``cachefs.handover.clone_fuse``: a mount pod cannot open ``/dev/fuse``), and closes
   its own copies, so that the daemon is the connection's only holder: the daemon's death ends the
   connection (ENOTCONN) instead of hanging the mount;
5. for a read-only mount, it serves ``<run_dir>/backing.sock`` beforehand (``csi_driver.backing``),
   where the daemon has it register passthrough backing files, each request carrying the daemon's
   own fd (the plugin keeps none); the broker stops at unmount and is served again by ``resume``
   after a restart of the plugin;
6. it reads the daemon's start-up report (``OK``, or the one-line reason it cannot serve), checks
   that the mount answers, and tunes the connection's read-ahead and background requests
   (``cachefs.tuning``: sysfs, which an unprivileged daemon may not write).

The daemon needs no privilege: it neither mounts nor unmounts. Because it holds the only fd, it
keeps serving when the plugin is killed or restarted; nothing needs re-attaching afterwards (the
staged volumes' records and the mount table say what is mounted, ``NodeOps.adopt``). A daemon that
never gets its fd gives up after ``cachefs.cli.mount.HANDOVER_WAIT_S``, and one whose mount is
unmounted exits by itself, so no daemon outlives its mount for long.

**Unmount**: flush (``cachefs flush`` through the daemon's control socket, which lives in the run
directory: reachable from the plugin in either mode), the kernel unmount (the daemon sees the
connection end and exits), then the launcher makes sure the daemon is gone. A broken mount (its
daemon died) is detached lazily and its daemon's remains stopped.

Credentials reach the daemon only through ``DaemonSpec.env``: never its argv, never a log line.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from cachefs.backing import BROKER_SOCKET
from cachefs.handover import MAX_SOCKET_PATH, HandoverError, clone_fuse
from cachefs.settings import DEFAULT_FUSE_THREADS
from cachefs.tuning import tune_fuse_connection
from csi_driver import fusefd
from csi_driver.backing import BackingBroker
from csi_driver.errors import Code, CsiError
from csi_driver.launchers import DaemonLauncher, DaemonSpec, daemon_name
from csi_driver.mounter import (
    MOUNT_TIMEOUT_S,
    UNMOUNT_TIMEOUT_S,
    CachefsMounter,
    MountRequest,
    last_line,
)
from csi_driver.redact import REGISTRY

log = logging.getLogger(__name__)

# How long a daemon may take to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 30.0
# After the daemon reports OK, how long the mount may take to answer its first request.
ANSWER_TIMEOUT_S = 20.0
# How long the unmount waits for the daemon to exit by itself once its mount is gone.
EXIT_WAIT_S = 30.0
POLL_S = 0.1


def _answers(target: Path, timeout_s: float) -> str | None:
    """None once ``statvfs(target)`` answers (it always reaches the daemon), else why not. The call
    runs in a thread: a daemon that never answers must not hold this caller."""
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            os.statvfs(target)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or str(exc))

    thread = threading.Thread(target=probe, name=f"probe {target}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"no answer within {timeout_s:g} s"


class HandoverMounter(CachefsMounter):
    """A ``Mounter`` that mounts itself and hands each mount to a daemon from ``launcher``.

    ``command`` is the ``cachefs`` CLI the plugin runs itself (``flush``); the daemon's program is the
    launcher's. ``daemon_uid``/``daemon_gid``: run every daemon as this user (its cache slot and run
    directory are chowned to it; files in the mount stay owned by the plugin's user unless the volume
    says otherwise). Bind mounts, ``is_mounted`` and ``is_broken`` are ``CachefsMounter``'s."""

    def __init__(self, launcher: DaemonLauncher, run_root: Path, *, command: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None, daemon_uid: int | None = None,
                 daemon_gid: int | None = None, mount_timeout_s: float = MOUNT_TIMEOUT_S,
                 unmount_timeout_s: float = UNMOUNT_TIMEOUT_S, stop_timeout_s: float = STOP_TIMEOUT_S,
                 log_level: str = "INFO") -> None:
        super().__init__(command=command, environ=environ, mount_timeout_s=mount_timeout_s,
                         unmount_timeout_s=unmount_timeout_s, log_level=log_level)
        self.launcher = launcher
        self.run_root = run_root
        self.daemon_uid = daemon_uid
        self.daemon_gid = daemon_gid
        self.stop_timeout_s = stop_timeout_s
        # The passthrough brokers of the read-only mounts, by target (csi_driver.backing).
        self.brokers: dict[Path, BackingBroker] = {}
        # Targets being mounted now: a daemon that dies before it serves one is that mount's failure
        # (answered to the caller), not a broken mount to report (podwatch.BrokenMountReporter).
        self.mounting: set[Path] = set()

    # -- the daemon's description -------------------------------------------------------------------
    def spec_for(self, request: MountRequest) -> DaemonSpec:
        name = daemon_name(request.target)
        run_dir = self.run_root / name
        if self.daemon_uid is not None:
            # An unprivileged daemon would make itself the owner of every file: keep the plugin's.
            owner = request.owner
            request = dataclasses.replace(request, owner=dataclasses.replace(
                owner, uid=os.geteuid() if owner.uid is None else owner.uid,
                gid=os.getegid() if owner.gid is None else owner.gid))
        # The longest socket the daemon makes: its control socket, $XDG_RUNTIME_DIR/cachefs/<16 hex>.sock.
        longest = run_dir / "cachefs" / f"{'0' * 16}.sock"
        if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
            raise CsiError(Code.FAILED_PRECONDITION, f"the run root {self.run_root} is too long for unix socket "
                                                     f"paths ({longest} exceeds {MAX_SOCKET_PATH} bytes)")
        args = self.mount_argv(request)[len(self.command):]
        args += ["--fuse-fd-socket", str(run_dir / "fuse.sock")]
        if request.read_only:  # passthrough is for read-only mounts only
            args += ["--backing-broker", str(run_dir / BROKER_SOCKET)]
        env = {key: value for key, value in self.child_environ(request).items() if key.startswith("AWS_")}
        env["XDG_RUNTIME_DIR"] = str(run_dir)  # the control socket: in the run dir, reachable from here
        return DaemonSpec(
            name=name, volume_id=request.volume_id, target=request.target, args=tuple(args), env=env,
            cache_dir=request.cache_dir, run_dir=run_dir, read_only=request.read_only,
            uid=self.daemon_uid, gid=self.daemon_gid, ram_cache_bytes=request.cache.ram_bytes,
            disk_cache_bytes=request.cache.disk_bytes, context=dict(request.context),
            pod_resources=request.pod_resources, stop_timeout_s=request.cache.stop_timeout_s,
            log_file=request.cache_dir / "daemon.log", source=request.source,
            fuse_threads=request.cache.fuse_threads,
        )

    def _prepare_dirs(self, spec: DaemonSpec) -> None:
        try:
            spec.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            spec.cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if spec.uid is not None:
                for directory in (spec.run_dir, spec.cache_dir):
                    _chown_tree(directory, spec.uid, spec.gid)
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"cannot prepare the daemon's directories for {spec.target}: "
                                          f"{exc.strerror or exc}") from None

    # -- Mounter ------------------------------------------------------------------------------------
    def mount(self, request: MountRequest) -> None:
        spec = self.spec_for(request)
        self._mount(spec, self.launcher.start, f"cannot mount {request.source} on {request.target}")
        self._save_spec(spec)
        log.info("mounted %s on %s; served by daemon %s (%s)", request.source, spec.target, spec.name,
                 self.launcher.describe(spec.name))

    def relaunch(self, target: Path) -> None:
        """The daemon of the mount at ``target`` died: detach the dead mount, mount ``/dev/fuse`` there
        again and hand it to a new daemon started from the saved spec (``<run_root>/<name>.spec.json``,
        no credential in it) by ``launcher.restart``, which gives it the environment the first start
        was given (a mount pod's Secret, kept while the volume is mounted)."""
        name = daemon_name(target)
        try:
            spec = DaemonSpec.from_json(self._spec_path(name).read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CsiError(Code.FAILED_PRECONDITION, f"cannot start the daemon of {target} again: its spec "
                                                     f"{self._spec_path(name)} is unreadable ({exc})") from None
        if self.is_mounted(target):
            self.detach(target)  # dead: nothing to flush
        self._mount(spec, self.launcher.restart, f"cannot mount {target} again")
        log.info("mounted %s again with a new daemon %s (%s)", target, spec.name, self.launcher.describe(spec.name))

    def _spec_path(self, name: str) -> Path:
        return self.run_root / f"{name}.spec.json"

    def _save_spec(self, spec: DaemonSpec) -> None:
        """What ``relaunch`` needs, beside the daemon's run directory (which the daemon's user owns):
        root's, mode 0600, and without the environment's values."""
        path = self._spec_path(spec.name)
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(spec.to_json())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot save %s (%s): the daemon of %s cannot be restarted without a publish", path,
                        exc.strerror, spec.target)

    def _mount(self, spec: DaemonSpec, launch: Callable[[DaemonSpec], None], what: str) -> None:
        if self.launcher.is_running(spec.name):
            # A daemon of an earlier mount at this target (a dead mount being replaced).
            log.warning("a daemon for %s is still running (%s); stopping it before mounting again", spec.target,
                        self.launcher.describe(spec.name))
            self.launcher.stop(spec.name, self.stop_timeout_s)
        self._prepare_dirs(spec)
        self._stop_broker(spec.target)  # an earlier daemon's, whose ids went with its connection
        self._start_broker(spec)
        self.mounting.add(spec.target)
        try:
            try:
                fd = fusefd.mount_fuse(spec.target, read_only=spec.read_only, source=spec.source)
            except OSError as exc:
                self._stop_broker(spec.target)
                raise CsiError(Code.INTERNAL, f"{what}: {exc.strerror or exc}") from None
            deadline = time.monotonic() + self.mount_timeout_s
            try:
                self._hand_over(spec, fd, deadline, what, launch)
            except BaseException:
                self._undo(spec)
                raise
        finally:
            self.mounting.discard(spec.target)

    def _hand_over(self, spec: DaemonSpec, fd: int, deadline: float, what: str,
                   launch: Callable[[DaemonSpec], None]) -> None:
        def alive() -> bool:
            return self.launcher.is_running(spec.name)

        # One reader thread of the daemon per descriptor: the plugin opens the clones, since a mount
        # pod has no /dev/fuse (where it cannot, the daemon's loop reads alone; one log line there).
        threads = DEFAULT_FUSE_THREADS if spec.fuse_threads is None else spec.fuse_threads
        clones = clone_fuse(fd, threads - 1)

        try:
            try:
                with fusefd.HandoverSocket(spec.handover_socket, uid=spec.uid, gid=spec.gid) as listener:
                    launch(spec)
                    conn = listener.hand_over(fd, deadline, alive, clones)
            finally:
                for own in (fd, *clones):
                    os.close(own)  # from here on the daemon holds the connection's only fds
            with conn:
                warnings, error, invalid = fusefd.read_report(conn, deadline, alive)
        except HandoverError as exc:
            code = Code.DEADLINE_EXCEEDED if isinstance(exc, fusefd.HandoverTimeout) else Code.INTERNAL
            raise CsiError(code, f"{what}: {exc} ({self.launcher.describe(spec.name)})") from None
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"{what}: {exc.strerror or exc}") from None
        for line in warnings:
            log.warning("%s: %s", spec.target, REGISTRY.scrub(line))
        if error is not None:
            code = Code.INVALID_ARGUMENT if invalid else Code.INTERNAL
            raise CsiError(code, f"{what}: {REGISTRY.scrub(error)}")
        problem = _answers(spec.target, min(ANSWER_TIMEOUT_S, max(1.0, deadline - time.monotonic())))
        if problem is not None:
            raise CsiError(Code.INTERNAL, f"{what}: the daemon reported ready, but the mount does not answer "
                                          f"({problem})")
        tune_fuse_connection(spec.target)  # read-ahead, background requests: the daemon may not

    # -- the passthrough broker ------------------------------------------------------------------------
    def _start_broker(self, spec: DaemonSpec, *, resumed: bool = False) -> None:
        """Serve ``<run_dir>/backing.sock`` for a read-only mount (``resumed``: after a plugin restart,
        for a daemon that serves on). A broker that cannot start costs passthrough only: the daemon,
        finding no broker, serves every read."""
        if not spec.read_only:
            return
        broker = BackingBroker(spec.run_dir / BROKER_SOCKET, uid=os.geteuid() if spec.uid is None else spec.uid,
                               gid=spec.gid, cache_dir=spec.cache_dir, resumed=resumed)
        try:
            broker.start()
        except OSError as exc:
            log.warning("%s: no passthrough broker (%s); its daemon serves every read", spec.target,
                        exc.strerror or exc)
            return
        self.brokers[spec.target] = broker

    def _stop_broker(self, target: Path) -> None:
        broker = self.brokers.pop(target, None)
        if broker is not None:
            broker.stop()

    def resume(self) -> None:
        """After a restart of the plugin: serve the brokers of the read-only mounts whose daemons
        serve on (their saved specs say which), so their passthrough goes on."""
        for path in sorted(self.run_root.glob("*.spec.json")):
            try:
                spec = DaemonSpec.from_json(path.read_text())
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if spec.read_only and spec.target not in self.brokers and self.is_mounted(spec.target) \
                    and not self.is_broken(spec.target):
                self._start_broker(spec, resumed=True)

    def _undo(self, spec: DaemonSpec) -> None:
        """Stop the daemon (ending the connection), then detach the mount; log what cannot be undone."""
        self._stop_broker(spec.target)
        try:
            self.launcher.stop(spec.name, self.stop_timeout_s)
        except CsiError as exc:
            log.warning("undoing the mount at %s: %s", spec.target, exc.message)
        try:
            fusefd.unmount(spec.target, lazy=True)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOENT):
                log.warning("undoing the mount at %s: %s", spec.target, exc.strerror)
        if not self.launcher.is_running(spec.name):
            shutil.rmtree(spec.run_dir, ignore_errors=True)

    def unmount(self, target: Path) -> None:
        name = daemon_name(target)
        if self.is_mounted(target):
            if self.is_broken(target):
                self.detach(target)
            else:
                self._flush(target)
                try:
                    fusefd.unmount(target)
                except OSError as exc:
                    if self.is_mounted(target):
                        raise CsiError(Code.INTERNAL, f"cannot unmount {target}: {exc.strerror or exc}") from None
        # Its mount gone, the daemon exits by itself; stop() makes sure, and cleans up.
        deadline = time.monotonic() + EXIT_WAIT_S
        while self.launcher.is_running(name) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.launcher.stop(name, self.stop_timeout_s)
        self._stop_broker(target)
        shutil.rmtree(self.run_root / name, ignore_errors=True)
        self._spec_path(name).unlink(missing_ok=True)

    def _flush(self, target: Path) -> None:
        """Everything written through ``target`` is in the object store, or ``CsiError`` (and no unmount)."""
        argv = [*self.command, "flush", str(target), "--timeout", f"{self.unmount_timeout_s:g}"]
        result = self._run(argv, dict(self.environ), self.unmount_timeout_s + 10, f"flushing {target}")
        if result.returncode != 0:
            raise CsiError(Code.INTERNAL, f"not unmounting {target}: written data is not in the object store yet "
                                          f"({last_line(result.stderr)}); retry later")

    def detach(self, target: Path) -> None:
        """Lazily detach a dead mount (nothing is left to flush)."""
        self._stop_broker(target)
        try:
            fusefd.unmount(target, lazy=True)
        except OSError as exc:
            if self.is_mounted(target):
                raise CsiError(Code.INTERNAL, f"cannot detach broken mount {target}: {exc.strerror or exc}") from None
        log.warning("detached the broken mount at %s (its daemon was gone)", target)


def _chown_tree(directory: Path, uid: int, gid: int | None) -> None:
    """Give ``directory`` (and, the first time, everything in it) to ``uid``/``gid``."""
    group = -1 if gid is None else gid
    st = os.stat(directory)
    if st.st_uid == uid and (gid is None or st.st_gid == gid):
        return
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, group, follow_symlinks=False)
    os.chown(directory, uid, group)
