"""A kubelet stand-in: runs the pods bound to one node in the API double as local processes.

It polls the API double (``tests/support/kubeapi.py``) for pods whose ``spec.nodeName`` is its node
and, for each new one, does what a kubelet and a container runtime would do with a mount pod (or
another single-container pod of cachefs's image, such as the operator's):

- refuses what such a pod must never ask for: a privileged container (``privileged: true``),
  privilege escalation (``allowPrivilegeEscalation`` not false), a hostPath mounted at another path
  than its own (the node plugin relies on same-path mounts), or a literal ``value`` for a variable
  that looks like a credential;
- resolves ``env[].valueFrom.secretKeyRef`` from the Secrets in the API (waiting, as a kubelet does,
  while the Secret is missing, and reporting the container ``waiting: CreateContainerConfigError``);
- gives each pod an IP of its own (``status.podIP``, a random address of 127.0.0.0/8, which is all
  loopback on Linux: pods then bind the same port without clashing, as in their own network
  namespaces), resolves ``env[].valueFrom.fieldRef`` of ``status.podIP``, ``metadata.name``,
  ``metadata.namespace`` and ``spec.nodeName`` (the downward API), and expands ``$(VAR)`` in the
  command and args from the container's environment (``$$`` stays a literal ``$``; an unknown
  variable is left as written, as a kubelet does);
- runs the container's command as a process group of its own (``cachefs`` is this interpreter's
  ``-m cachefs``; another command that is one of this venv's console scripts runs from it), under
  ``setpriv`` with an empty capability bounding set and ``no_new_privs``, as the uid and gid a
  container runtime would: the container's ``runAsUser``/``runAsGroup``, else the pod's, else the
  image's (``IMAGE_UID``: deploy/Dockerfile sets no ``USER``, so root). The process gets no more
  privilege than the pod spec grants, and **no passwd entry** where the uid has none (65532, the
  manifests' uid, has none here as in the image): its environment is a runtime's, with no
  ``USER``/``LOGNAME`` from the test's and ``HOME`` from the passwd entry, else ``/`` (containerd's
  rule), so ``getpass.getuser()``/``Path.home()`` fail as they do in the image (issue 23: kopf's
  peering id crashed that way);
- with ``readOnlyRootFilesystem: true`` (and root to do it), runs it in a mount namespace of its own
  with ``/`` read-only and the pod's hostPath and emptyDir volumes bind-mounted writable at their
  mount paths (``tests/support/container_root.py``);
- gives the container its termination-message file (``terminationMessagePath``, a host file of
  mode 0666 bound at that path, as the kubelet makes it; read-only-root pods only) and reports its
  first 4096 bytes as ``state.terminated.message`` (``terminationMessagePolicy: File``);
- reports ``status.phase`` Running, then Succeeded or Failed with the container's exit code and a
  ``terminated`` state when the process ends, also for a pod being deleted (before it removes it);
- stops a pod being deleted (``metadata.deletionTimestamp`` set; the API double keeps it until then,
  ``tests/support/kubeapi.py``) as the kubelet does: SIGTERM to the process group, then SIGKILL after
  the pod's ``metadata.deletionGracePeriodSeconds`` (at least 2 s, the kubelet's
  ``minimumGracePeriodInSeconds``), or the shorter grace of a later DELETE counted from then (the
  kubelet restarts its kill with it), whichever comes first; then removes the pod
  from the API (a DELETE with grace 0 and the pod's uid as precondition, as the kubelet's status
  manager does), also for a pod it never started (refused, not pulled). ``Container.stop_grace_s``
  records the grace it gave. A pod removed outright (grace 0) gets its spec's grace period instead
  (the kubelet: 2 s).

``kill(name)`` is "the container died": SIGKILL of the whole process group of one pod. An image
named ``unpullable/...`` is never pulled: the container waits in ``ErrImagePull``, as it would.

**Events from gRPC errors** (``event_message``): the kubelet puts a failed call's message into a
Go format string, twice, on the way to the pod's ``FailedMount`` Event; ``go_sprintf`` is that rule.

**Workload containers** (``start_workload``, root only): a pod that uses a cachefs volume gets a
mount namespace of its own, with each volume the node plugin published (its CSI target path on the
host) bound in at the container's ``mountPath`` with the propagation its ``volumeMounts`` entry asks
for, as runc does (``tests/support/container_volumes.py``: ``None`` -> rprivate, ``HostToContainer``
-> rslave, ``Bidirectional`` -> rshared, refused for an unprivileged container as the API server
refuses it). ``Workload.run`` runs a command inside (``nsenter``). For propagation to reach a
container at all, the kubelet's root directory must be a shared mount: the kubelet makes it
``rshared`` at start-up where it is not (``share``; undone at ``stop``), so every target mounted
under it is in a peer group the containers' rslave binds follow.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL_S = 0.1
# The kubelet never gives a container less than this between SIGTERM and SIGKILL (kuberuntime's
# minimumGracePeriodInSeconds).
MIN_GRACE_S = 2.0
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` references of a container's command, as the kubelet expands them."""
    return _VAR_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


# Go's fmt: a verb is % then flags, a width (digits or *), a precision (. then digits or *), a rune.
_GO_VERB = re.compile(r"%([+\-# 0]*)(\d+|\*)?(?:\.(\d*|\*))?(.)?", re.DOTALL)


def go_sprintf(format_string: str) -> str:
    """``fmt.Sprintf(format_string)`` with no arguments, as Go renders it: ``%%`` is ``%``; any other
    verb is ``%!V(MISSING)``; a ``*`` width or precision ``%!(BADWIDTH)``/``%!(BADPREC)``; a ``%`` at
    the end ``%!(NOVERB)``."""
    def one(match: re.Match[str]) -> str:
        _, width, precision, verb = match.groups()
        if verb is None:
            return "%!(NOVERB)"
        if match.group(0) == "%%":
            return "%"
        bad = ("%!(BADWIDTH)" if width == "*" else "") + ("%!(BADPREC)" if precision == "*" else "")
        return bad + f"%!{verb}(MISSING)"
    return _GO_VERB.sub(one, format_string)


def event_message(prefix: str, details: str) -> str:
    """The message of the ``FailedMount`` Event the kubelet records for a NodePublishVolume (or
    NodeStageVolume) that failed with gRPC ``details``: the operation executor builds
    ``prefix + " failed for volume ... : rpc error: code = ... desc = " + details`` and passes it to
    ``fmt.Errorf`` as the format string (``GenerateErrorDetailed``), and the recorder's ``Eventf``
    formats that again: two passes of Go's fmt with no arguments (issue 36 saw both:
    ``http%3A`` -> ``http%!!(MISSING)A(MISSING)``)."""
    return go_sprintf(go_sprintf(f"{prefix}: rpc error: desc = {details}"))


def pod_ip() -> str:
    rng = random.SystemRandom()
    return f"127.{rng.randint(1, 254)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"

SECRETISH = ("SECRET", "TOKEN", "PASSWORD", "ACCESS_KEY")
KILL_WAIT_S = 10.0
# deploy/Dockerfile's ENTRYPOINT, less tini (the stand-in reaps its own children).
IMAGE_ENTRYPOINT = ("cachefs-csi",)
IMAGE_UID = 0  # deploy/Dockerfile has no USER line: the image runs as root unless the pod says otherwise
# What getpass.getuser() reads before the passwd database; a container runtime sets none of them.
LOGIN_VARIABLES = ("USER", "LOGNAME", "LNAME", "USERNAME")
CONTAINER_ROOT = Path(__file__).with_name("container_root.py")
CONTAINER_VOLUMES = Path(__file__).with_name("container_volumes.py")
# The values of volumeMounts[].mountPropagation the API server accepts (None is the default).
PROPAGATIONS = ("None", "HostToContainer", "Bidirectional")
# A command run in a workload container (nsenter + a short program) answers within this.
WORKLOAD_RUN_S = 20.0


def runtime_environ(base: dict[str, str], uid: int) -> dict[str, str]:
    """The environment a container runtime gives a process of ``uid``: HOME from passwd, else "/"."""
    import pwd

    env = {k: v for k, v in base.items() if k not in LOGIN_VARIABLES and k != "HOME"}
    try:
        env["HOME"] = pwd.getpwuid(uid).pw_dir
    except KeyError:
        env["HOME"] = "/"
    return env
# Each API call is bounded, as a real kubelet's are: a call the API double leaves unanswered costs one
# round (a status report is tried again), not the kubelet's stop, which waits for its thread.
API_TIMEOUT_S = 5.0
STATUS_ATTEMPTS = 3


def _deletion_grace(pod: Any, container: Container) -> float:
    """How long the kubelet lets the container of ``pod``, being deleted, run after SIGTERM: the pod's
    deletionGracePeriodSeconds, else its spec's grace (a pod removed outright), at least MIN_GRACE_S."""
    grace = pod.metadata.deletion_grace_period_seconds if pod is not None else None
    return max(MIN_GRACE_S, float(grace if grace is not None else container.grace_s))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    name: str
    uid: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    grace_s: float
    env: dict[str, str] = field(repr=False)
    termination_log: Path | None = None  # the host file bound at terminationMessagePath
    reported: bool = False
    deleted: bool = False
    stop_grace_s: float | None = None  # the grace its deletion gave it (SIGTERM to SIGKILL)
    sigterm_at: float | None = None  # time.monotonic() of the SIGTERM
    kill_at: float = math.inf  # time.monotonic() of the SIGKILL, once it is being stopped


@dataclass
class Workload:
    """A workload pod's container: a process in a mount namespace of its own (``start_workload``)."""

    name: str
    proc: subprocess.Popen[bytes]
    root: Path  # where the container's paths start, seen from inside its namespace

    def path(self, inside: str) -> str:
        return str(self.root) + "/" + inside.lstrip("/")

    def run(self, *argv: str, timeout_s: float = WORKLOAD_RUN_S) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the container's mount namespace; a ``{}`` in it is the container's root."""
        argv = tuple(arg.replace("{}", str(self.root)) for arg in argv)
        return subprocess.run(["nsenter", f"--target={self.proc.pid}", "--mount", "--", *argv],
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def read(self, inside: str) -> bytes | str:
        """The bytes of file ``inside`` as the container reads them, or the error it gets (strerror)."""
        code = ("import sys\ntry:\n    sys.stdout.write(open(sys.argv[1], 'rb').read().hex())\n"
                "except OSError as exc:\n    sys.stdout.write('!' + exc.strerror)")
        result = self.run(sys.executable, "-c", code, self.path(inside))
        out = result.stdout.strip()
        if result.returncode != 0:
            return f"exit {result.returncode}: {result.stderr.strip()[-200:]}"
        return out[1:] if out.startswith("!") else bytes.fromhex(out)

    def mountinfo(self, inside: str) -> list[str]:
        """The lines of the container's mount table at ``inside`` (a stack: one line per layer)."""
        where = self.path(inside)
        result = self.run("cat", "/proc/self/mountinfo")
        return [line for line in result.stdout.splitlines() if line.split()[4] == where]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=KILL_WAIT_S)


class Kubelet:
    def __init__(self, core: Any, node: str, namespace: str, workdir: Path, base_env: dict[str, str]) -> None:
        self.core = core
        self.node = node
        self.namespace = namespace
        self.workdir = workdir
        self.base_env = base_env
        self.containers: dict[str, Container] = {}  # by pod uid
        self.refused: dict[str, str] = {}  # pod name -> why
        self.waiting: dict[str, str] = {}  # pod uid -> the Secret its container waits for
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{node}", daemon=True)
        self.setpriv = shutil.which("setpriv")
        self.unshare = shutil.which("unshare") if os.geteuid() == 0 else None
        self.workloads: list[Workload] = []
        self.shared: list[Path] = []  # directories this kubelet made shared mounts (undone at stop)

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> Kubelet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=API_TIMEOUT_S + 1)  # at most one API call in flight, bounded
        with self._lock:
            containers = list(self.containers.values())
        for container in containers:
            self._terminate(container, grace_s=2.0)
        for workload in self.workloads:
            workload.stop()
        for path in reversed(self.shared):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=KILL_WAIT_S, check=False)

    # -- workload containers ------------------------------------------------------------------------
    def share(self, root: Path) -> None:
        """Make ``root`` (where the pods' volumes are published) an rshared mount, as the kubelet does
        with its root directory when it is not shared already (a bind of it onto itself first)."""
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(root), str(root)], check=True, capture_output=True, timeout=10)
        self.shared.append(root)
        subprocess.run(["mount", "--make-rshared", str(root)], check=True, capture_output=True, timeout=10)

    def start_workload(self, pod: dict[str, Any], targets: dict[str, Path]) -> Workload:
        """Run ``pod``'s container (a manifest as applied) with each CSI volume of ``targets`` (volume
        name -> the target path the node plugin published it at) bound at its ``mountPath``, with the
        ``mountPropagation`` the manifest asks for. Refuses what the API server refuses."""
        assert self.unshare is not None, "workload containers need root (a mount namespace each)"
        name = pod["metadata"]["name"]
        (container,) = pod["spec"]["containers"]
        privileged = bool((container.get("securityContext") or {}).get("privileged"))
        root = self.workdir / "rootfs" / name
        spec = []
        for mount in container.get("volumeMounts") or []:
            propagation = mount.get("mountPropagation", "None")
            assert propagation in PROPAGATIONS, f"Unsupported value: {propagation!r}: supported values: {PROPAGATIONS}"
            assert propagation != "Bidirectional" or privileged, (
                "Bidirectional mount propagation is available only to privileged containers")
            source = targets[mount["name"]]
            spec.append([str(source), str(root) + mount["mountPath"], propagation, bool(mount.get("readOnly"))])
        root.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([self.unshare, "--mount", "--propagation", "slave", "--", sys.executable,
                                 str(CONTAINER_VOLUMES), json.dumps(spec)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready.strip() == b"ready", f"container {name} did not start: {proc.stderr.read() if proc.stderr else ''}"
        workload = Workload(name, proc, root)
        self.workloads.append(workload)
        return workload

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as exc:  # the API double is going away; keep trying until stopped
                print(f"kubelet stand-in: {exc!r}", file=sys.stderr)
            self._stop.wait(POLL_S)

    # -- test helpers -------------------------------------------------------------------------------
    def running(self, pod: str) -> Container | None:
        with self._lock:
            for container in self.containers.values():
                if container.name == pod and container.proc.poll() is None:
                    return container
        return None

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> int:
        """The container of ``pod`` dies: ``sig`` to its whole process group; returns the pid."""
        container = self.running(pod)
        assert container is not None, f"no running container for pod {pod}"
        os.killpg(container.proc.pid, sig)
        return container.proc.pid

    # -- one round ----------------------------------------------------------------------------------
    def _sync(self) -> None:
        pods = [p for p in self.core.list_namespaced_pod(self.namespace, _request_timeout=API_TIMEOUT_S).items if p.spec.node_name == self.node]
        present = {p.metadata.uid: p for p in pods if p.metadata.deletion_timestamp is None}
        deleting = {p.metadata.uid: p for p in pods if p.metadata.deletion_timestamp is not None}
        for uid, pod in present.items():
            with self._lock:
                known = uid in self.containers
            if not known and pod.metadata.name not in self.refused and not (pod.status and pod.status.phase in (
                    "Succeeded", "Failed")):
                self._start(pod)
        with self._lock:
            containers = dict(self.containers)
        for container in containers.values():
            pod = deleting.get(container.uid)
            grace = _deletion_grace(pod, container)
            if container.uid not in present and not container.deleted:
                container.deleted = True
                container.stop_grace_s = grace
                threading.Thread(target=self._terminate, args=(container, grace), daemon=True).start()
            elif pod is not None and container.sigterm_at is not None and grace < (container.stop_grace_s or 0):
                container.stop_grace_s = grace  # a later DELETE shortened it: the kubelet kills anew
                container.kill_at = min(container.kill_at, time.monotonic() + grace)
            elif container.proc.poll() is not None and not container.reported and not container.deleted:
                self._report_exit(container)
        for uid, pod in deleting.items():  # stopped (or never started here): the kubelet's last step
            known = containers.get(uid)
            if known is None or (known.deleted and known.proc.poll() is not None):
                if known is not None and not known.reported:
                    self._report_exit(known)  # its terminal status first, as the kubelet's status manager
                self._remove(pod)

    def _remove(self, pod: Any) -> None:
        """Delete a pod whose container has stopped with grace 0: the API removes it."""
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, _request_timeout=API_TIMEOUT_S,
                                            body={"gracePeriodSeconds": 0, "preconditions": {"uid": pod.metadata.uid}})
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise

    def _refuse(self, pod: Any, why: str) -> None:
        self.refused[pod.metadata.name] = why
        self._patch_status(pod.metadata.name, {"phase": "Failed", "reason": "Refused", "message": why})

    def _start(self, pod: Any) -> None:
        spec = pod.spec
        (container,) = spec.containers
        if container.image.startswith("unpullable/"):
            self.refused[pod.metadata.name] = "ErrImagePull"
            self._patch_status(pod.metadata.name, {"phase": "Pending", "containerStatuses": [{
                "name": container.name, "image": container.image, "imageID": "", "ready": False, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull", "message": f"pull access denied for {container.image}"}},
            }]})
            return None
        security = container.security_context
        if security is None or security.privileged or security.allow_privilege_escalation is not False:
            return self._refuse(pod, "a pod here must be unprivileged, without privilege escalation")
        host = {v.name: v.host_path.path for v in spec.volumes or [] if v.host_path is not None}
        scratch = {v.name for v in spec.volumes or [] if v.empty_dir is not None}
        binds: list[tuple[str, str]] = []
        for mount in container.volume_mounts or []:
            if mount.name in scratch:
                backing = self.workdir / "volumes" / pod.metadata.uid / mount.name
                backing.mkdir(parents=True, exist_ok=True)
                backing.chmod(0o777)  # as the kubelet makes an emptyDir: any uid of the pod may write it
                binds.append((str(backing), mount.mount_path))
            elif host.get(mount.name) != mount.mount_path:
                return self._refuse(pod, f"volume {mount.name} is not a hostPath mounted at its own path")
            else:
                binds.append((mount.mount_path, mount.mount_path))
        env: dict[str, str] = {}
        ip = pod_ip()
        fields = {"status.podIP": ip, "metadata.name": pod.metadata.name,
                  "metadata.namespace": pod.metadata.namespace, "spec.nodeName": self.node}
        for var in container.env or []:
            if var.value is not None:
                if any(word in var.name.upper() for word in SECRETISH):
                    return self._refuse(pod, f"variable {var.name} is a literal value in the pod spec")
                env[var.name] = var.value
                continue
            if var.value_from.field_ref is not None:
                path = var.value_from.field_ref.field_path
                if path not in fields:
                    return self._refuse(pod, f"variable {var.name}: fieldRef {path} is not supported here")
                env[var.name] = fields[path]
                continue
            ref = var.value_from.secret_key_ref
            try:
                secret = self.core.read_namespaced_secret(ref.name, self.namespace, _request_timeout=API_TIMEOUT_S)
            except Exception:
                # CreateContainerConfigError, as the kubelet reports it: try again next round.
                if self.waiting.get(pod.metadata.uid) != ref.name:
                    self.waiting[pod.metadata.uid] = ref.name
                    self._patch_status(pod.metadata.name, {"phase": "Pending", "containerStatuses": [{
                        "name": container.name, "image": container.image, "imageID": "", "ready": False,
                        "restartCount": 0, "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                 "message": f'secret "{ref.name}" not found'}}}]})
                return None
            env[var.name] = base64.b64decode(secret.data[ref.key]).decode()
        command = [expand(arg, env) for arg in list(container.command or IMAGE_ENTRYPOINT) + list(container.args or [])]
        if command[0] == "cachefs":
            command[:1] = [sys.executable, "-m", "cachefs"]
        elif "/" not in command[0] and (script := Path(sys.executable).with_name(command[0])).is_file():
            command[:1] = [str(script)]
        security_pod = spec.security_context
        user, group = IMAGE_UID, None
        for level in (security_pod, security):
            if level is not None and level.run_as_user is not None:
                user = level.run_as_user
            if level is not None and level.run_as_group is not None:
                group = level.run_as_group
        if self.setpriv is not None:
            wrap = [self.setpriv, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs"]
            if user != 0:
                wrap += [f"--reuid={user}", f"--regid={group if group is not None else user}", "--clear-groups"]
            command = wrap + command
        termination_log = None
        if container.termination_message_path and security.read_only_root_filesystem and self.unshare is not None:
            termination_log = self.workdir / "termination" / pod.metadata.uid
            termination_log.parent.mkdir(parents=True, exist_ok=True)
            termination_log.write_bytes(b"")
            termination_log.chmod(0o666)  # as the kubelet makes it: a container of any uid writes it
            binds.append((str(termination_log), container.termination_message_path))
        if security.read_only_root_filesystem and self.unshare is not None:
            command = [self.unshare, "--mount", "--propagation", "slave", "--", sys.executable, str(CONTAINER_ROOT),
                       json.dumps(binds), "--", *command]
        log_path = self.workdir / f"{pod.metadata.name}-{pod.metadata.uid[:8]}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/",
                                    env={**runtime_environ(self.base_env, user), **env}, start_new_session=True)
        with self._lock:
            self.containers[pod.metadata.uid] = Container(pod.metadata.name, pod.metadata.uid, proc, log_path,
                                                          float(spec.termination_grace_period_seconds or 30), env,
                                                          termination_log)
        self._patch_status(pod.metadata.name, {
            "phase": "Running", "hostIP": "127.0.0.1", "podIP": ip, "startTime": _now(),
            "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "local",
                                   "ready": True, "restartCount": 0, "started": True,
                                   "state": {"running": {"startedAt": _now()}}}],
        })

    def _report_exit(self, container: Container) -> None:
        code = container.proc.returncode
        exit_code = 128 - code if code < 0 else code  # killed by a signal: 128 + its number
        container.reported = True
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                      "finishedAt": _now()}
        if container.termination_log is not None:
            try:
                message = container.termination_log.read_bytes()[:4096].decode(errors="replace")
            except OSError:
                message = ""
            if message:
                terminated["message"] = message
        self._patch_status(container.name, {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [{"name": "cachefs", "image": "local", "imageID": "local", "ready": False,
                                   "restartCount": 0, "started": False,
                                   "state": {"terminated": terminated}}],
        })

    def _terminate(self, container: Container, grace_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL at ``container.kill_at`` (``grace_s`` from now, or sooner once shortened)."""
        if container.proc.poll() is not None:
            return
        try:
            os.killpg(container.proc.pid, signal.SIGTERM)
            now = time.monotonic()
            container.sigterm_at = container.sigterm_at or now
            container.kill_at = min(container.kill_at, now + (grace_s if grace_s is not None else container.grace_s))
            while container.proc.poll() is None and time.monotonic() < container.kill_at:
                time.sleep(POLL_S)
            if container.proc.poll() is None:
                os.killpg(container.proc.pid, signal.SIGKILL)
                container.proc.wait(timeout=KILL_WAIT_S)
        except ProcessLookupError:
            pass

    def _patch_status(self, name: str, status: dict[str, Any]) -> None:
        for _ in range(STATUS_ATTEMPTS):
            if self._stop.is_set():
                return
            try:
                self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status},
                                                      _content_type="application/merge-patch+json",
                                                      _request_timeout=API_TIMEOUT_S)
                return
            except Exception as exc:
                if getattr(exc, "status", None) == 404:
                    return  # the pod was deleted meanwhile

    def wait_gone(self, pod: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.running(pod) is not None:
            assert time.monotonic() < deadline, f"the container of {pod} is still running"
            time.sleep(POLL_S)
