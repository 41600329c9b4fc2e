"""``cachefs-csi``: the CSI driver's entry point (flags, logging, the gRPC server on a unix socket).

    cachefs-csi --endpoint unix:///csi/csi.sock --node-id NODE [--mode node|controller|all]
                [--cache-root DIR] [--state-dir DIR] [--run-root DIR] [--mount-mode process|pod]
                [--metrics-addr HOST:PORT] [--log-level LEVEL] [--max-volumes N]
                [--namespace NS] [--node-name NODE] [--mount-pod-image IMAGE] [--kubeconfig PATH]
                [--mount-pod-priority-class NAME] [--mount-pod-service-account NAME]
                [--allowed-endpoints URLS] [--allowed-buckets BUCKETS] [--cluster-store-endpoint URLS]
                [--max-ram-cache SIZE] [--max-mount-pod-memory Q] [--max-mount-pod-cpu Q] [--max-stop-timeout S]

``--mode node`` runs in the node DaemonSet (Identity + Node), ``--mode controller`` next to the
external-provisioner (Identity + Controller), ``--mode all`` both (for tests and single-node
clusters). Like the ``cachefs`` CLI, this is the only place that reads argv and the environment;
everything below receives settings objects. The environment (``AWS_*``) is the base of every mount
and every controller call; a volume's Secret overrides its credentials.

SIGTERM or SIGINT stops the server, letting calls in flight finish for a few seconds. Mounts are
left alone: they belong to the pods using them. The plugin mounts each volume itself (it opens
``/dev/fuse`` and mounts it) and hands the FUSE fd over a unix socket to the daemon that serves it
(``csi_driver.handover``), which needs no privilege. ``--mount-mode process`` runs each daemon as a
host process in its own session, so it outlives the plugin process; ``--mount-mode pod`` (the
DaemonSet's) runs it in a mount pod through the Kubernetes API (``csi_driver.mountpods``), so it
outlives the plugin's container too. At start-up the node plugin takes up the volumes staged by its
previous run from its records (``--state-dir``) and the mount table (``NodeOps.adopt``), and in pod
mode adopts its node's mount pods and deletes strays (``podwatch.take_over``). See deploy/README.md
for what survives what.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from cachefs.cli.parsing import CliParser
from csi_driver import DRIVER_NAME
from csi_driver.errors import CsiError
from csi_driver.redact import RedactingFormatter

if TYPE_CHECKING:
    from csi_driver.launchers import DaemonLauncher
    from csi_driver.mounter import Mounter
    from csi_driver.mountpods import PodLauncher
    from csi_driver.trust import VolumeCaps

log = logging.getLogger("csi_driver")

MODES = ("node", "controller", "all")
# Where the daemons run. `process`: host processes in their own sessions (ProcessLauncher). `pod`:
# one mount pod per volume per node through the Kubernetes API (csi_driver.mountpods.PodLauncher).
# In both, the plugin mounts and hands the FUSE fd to the daemon (csi_driver.handover). `process`
# stays the CLI's default: it needs no API server (local runs, the FlexVolume shim's nodes); the
# manifests in deploy/ ask for `pod`.
MOUNT_MODES = ("process", "pod")
DEFAULT_CACHE_ROOT = Path("/var/cache/cachefs-csi")
# The node plugin's container in deploy/base/node-daemonset.yaml: its image is the mount pods'.
PLUGIN_CONTAINER = "cachefs-csi"
# The daemons' run directories (handover and control sockets, pid records): on tmpfs, gone at a
# reboot like the mounts. /run/cachefs is where a root `cachefs mount` puts its control socket, and
# the host path the DaemonSet and deploy/examples/training-job-prefetch.yaml already share.
DEFAULT_RUN_ROOT = Path("/run/cachefs")
# The uid mount pods run their daemons as unless --daemon-uid says otherwise: nobody. A daemon needs
# no privilege (the plugin mounts and hands it the FUSE fd), and as root a compromised daemon would
# own every file the hostPaths it sees reach; the image runs as any uid (deploy/Dockerfile).
DEFAULT_MOUNT_POD_UID = 65534
# gRPC worker threads. Each publish blocks a thread for the whole mount (up to ~2 minutes on a
# slow store); the kubelet runs a handful of volume operations at once, the provisioner a few more.
GRPC_WORKERS = 16
# How long calls in flight may finish after SIGTERM before the server is torn down.
STOP_GRACE_S = 10.0
NOISY_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "grpc")


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="cachefs-csi", description=f"CSI driver {DRIVER_NAME} for cachefs mounts.")
    p.add_argument("--endpoint", required=True, help="gRPC endpoint, unix:///path/to/csi.sock")
    p.add_argument("--node-id", default="", help="this node's name (required in node and all modes)")
    p.add_argument("--mode", choices=MODES, default="all", help="which CSI services to serve (default all)")
    p.add_argument("--cache-root", type=Path, default=DEFAULT_CACHE_ROOT,
                   help=f"node directory for the volumes' caches (default {DEFAULT_CACHE_ROOT})")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="node directory for the staged volumes' records (default CACHE_ROOT/staged); "
                        "keep it on the host so a restarted plugin finds them")
    p.add_argument("--run-root", type=Path, default=DEFAULT_RUN_ROOT,
                   help=f"host directory for the daemons' sockets and records (default {DEFAULT_RUN_ROOT}); "
                        "unix socket paths must stay short, so keep it short")
    p.add_argument("--mount-mode", choices=MOUNT_MODES, default="process",
                   help="where the FUSE daemons run: process (default: host processes that outlive the plugin "
                        "process) or pod (one mount pod per volume per node, outliving the plugin's container)")
    pods = p.add_argument_group("mount pods (--mount-mode pod)")
    pods.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", ""),
                      help="the driver's namespace, where mount pods and their Secrets live (default $POD_NAMESPACE)")
    pods.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                      help="this node's Kubernetes name, the mount pods' nodeName (default $NODE_NAME, else --node-id)")
    pods.add_argument("--pod-name", default=os.environ.get("POD_NAME", ""),
                      help="the plugin's own pod (default $POD_NAME): its image is the mount pods' default")
    pods.add_argument("--mount-pod-image", default="", metavar="IMAGE",
                      help="the image of the mount pods (default: the image of this pod's cachefs-csi container)")
    pods.add_argument("--mount-pod-priority-class", default="", metavar="NAME",
                      help="priorityClassName of the mount pods (default: none)")
    pods.add_argument("--mount-pod-service-account", default="", metavar="NAME",
                      help="serviceAccountName of the mount pods, for a volume without a Secret that uses the "
                           "pod's own cloud identity (default: none, no token)")
    pods.add_argument("--cluster-store-secret", default="", metavar="NAME",
                      help="a Secret in the driver's namespace with the shared cluster store's credentials "
                           "(key 'credentials', an AWS credentials file with a profile 'cluster') and the "
                           "cluster key (key 'key'): mounted into the mount pods of volumes with clusterCache, "
                           "never taken from a volume's Secret (docs/security.md, 'Multi-tenant clusters')")
    pods.add_argument("--daemon-uid", type=int, default=None, metavar="UID",
                      help=f"uid (and gid) the daemons run as: their cache slots and run directories are "
                           f"chowned to it (default in pod mode: {DEFAULT_MOUNT_POD_UID}; 0: root)")
    pods.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", ""), metavar="PATH",
                      help="reach the API server with this kubeconfig (default: the pod's in-cluster service account)")
    pods.add_argument("--mount-pod-watch-seconds", type=int, default=0, help=argparse.SUPPRESS)  # tests only
    trust = p.add_argument_group("what volumes may ask (csi_driver.trust; the defaults are the safe ones)")
    trust.add_argument("--allow-node-identity", action="store_true",
                       help="let volumes without a Secret use this plugin's cloud identity (IRSA, Pod Identity, "
                            "instance profile); inline ephemeral volumes always need a Secret")
    trust.add_argument("--allowed-endpoints", default="", metavar="URLS",
                       help="comma-separated http(s)://host[:port][/path/] a volume's endpointUrl and "
                            "clusterEndpointUrl may name (that origin, at or below that path), 'aws' for the default "
                            "AWS endpoint (default: any but loopback, link-local and the cluster store)")
    trust.add_argument("--allowed-buckets", default="", metavar="BUCKETS",
                       help="comma-separated buckets a volume may mount (default: any)")
    trust.add_argument("--allow-local-endpoints", action="store_true",
                       help="without --allowed-endpoints, let volumes name loopback and link-local addresses "
                            "(a one-node cluster whose store runs on the node; never where pod authors are untrusted)")
    trust.add_argument("--cluster-store-endpoint", default="", metavar="URLS",
                       help="the cluster store's endpoint(s): a volume may name it only "
                            "as its clusterEndpointUrl, never as its source's endpointUrl")
    trust.add_argument("--max-ram-cache", default="", metavar="SIZE",
                       help="the largest ramCache a volume may ask for, e.g. 8GiB (default: no cap)")
    trust.add_argument("--max-mount-pod-memory", default="", metavar="QUANTITY",
                       help="the largest mountPodMemoryRequest/Limit, and mount pod memory limit (ramCache + the "
                            "daemon's 320Mi), a volume may ask for, e.g. 10Gi (default: no cap)")
    trust.add_argument("--max-mount-pod-cpu", default="", metavar="QUANTITY",
                       help="the largest mountPodCPURequest/Limit a volume may ask for, e.g. 4; also the CPU limit "
                            "of mount pods whose volume sets none (default: no cap, no CPU limit)")
    trust.add_argument("--max-stop-timeout", default="", metavar="SECONDS",
                       help="the largest stopTimeout a volume may ask for (it sets its mount pod's grace period; "
                            "default: no cap)")
    pods.add_argument("--cache-sweep-seconds", type=_sweep_seconds, default=None, metavar="S",
                      help="remove the node caches of volumes no PersistentVolume names any more, every S seconds "
                           "(default 600; 0 disables; needs the API, as mount pods do: csi_driver.janitor)")
    p.add_argument("--max-volumes", type=int, default=0, metavar="N",
                   help="volumes the node accepts, reported to the scheduler (default 0: no limit)")
    p.add_argument("--metrics-addr", default=None, metavar="HOST:PORT",
                   help="serve Prometheus /metrics (the driver's and every mount's) here, e.g. 127.0.0.1:9810 "
                        "(the DaemonSet: the pod's own address; port 0: a free one, named in the log)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--driver-name", default=DRIVER_NAME, help=argparse.SUPPRESS)  # tests only
    return p


def socket_path(endpoint: str) -> Path:
    """``unix:///csi/csi.sock`` (or ``unix:/csi/csi.sock``) -> ``/csi/csi.sock``."""
    if not endpoint.startswith("unix:"):
        raise ValueError(f"endpoint {endpoint!r} must be a unix socket: unix:///path/to/csi.sock")
    path = endpoint[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]
    if not path.startswith("/"):
        raise ValueError(f"endpoint {endpoint!r} must name an absolute socket path")
    return Path(path)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in NOISY_LOGGERS:  # client libraries log signed headers at DEBUG
        logging.getLogger(name).setLevel(logging.WARNING)


def daemon_user(args: argparse.Namespace) -> int | None:
    """The uid daemons run as: ``--daemon-uid``, else ``DEFAULT_MOUNT_POD_UID`` for mount pods and the
    plugin's own (root) for daemons it runs as its children. None: root, nothing to chown."""
    uid = args.daemon_uid
    if uid is None:
        uid = DEFAULT_MOUNT_POD_UID if args.mount_mode == "pod" else 0
    if uid < 0:
        raise ValueError(f"--daemon-uid must not be negative, got {uid}")
    return uid or None


def build_mounter(mount_mode: str, run_root: Path, environ: dict[str, str], log_level: str,
                  pod_launcher: DaemonLauncher | None = None, daemon_uid: int | None = None) -> Mounter:
    """The node plugin's ``Mounter``: it mounts each volume itself and hands the FUSE fd to a daemon
    that the mode's launcher runs (``csi_driver.handover``). The daemons' run directories (handover
    and control sockets, pid records) live under ``run_root``, on the host."""
    from csi_driver.handover import HandoverMounter
    from csi_driver.launchers import ProcessLauncher

    launcher: DaemonLauncher
    if mount_mode == "process":
        launcher = ProcessLauncher(run_root, environ=environ)
    elif pod_launcher is not None:
        launcher = pod_launcher
    else:
        raise ValueError(f"mount mode {mount_mode!r} needs its launcher")
    return HandoverMounter(launcher, run_root, environ=environ, log_level=log_level, daemon_uid=daemon_uid,
                           daemon_gid=daemon_uid)


def _sweep_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 86400, got {text!r}")
    return value


def volume_caps(args: argparse.Namespace) -> VolumeCaps:
    """The ``--max-*`` flags; ValueError naming a bad one."""
    from cachefs import admin
    from csi_driver.attributes import cpu_milli, memory_bytes
    from csi_driver.trust import VolumeCaps

    def parsed(flag: str, text: str, parse: Callable[[str, str], Any]) -> Any:
        if not text:
            return None
        try:
            return parse(flag, text)
        except (ValueError, CsiError) as exc:
            raise ValueError(f"{flag} {text!r}: {exc}") from None

    def seconds(flag: str, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0 <= value <= 86400:
            raise ValueError("expected seconds from 0 to 86400")
        return value

    def quantity(parse: Callable[[str, str, str], int]) -> Callable[[str, str], int]:
        return lambda flag, text: parse(flag, text, "it")

    return VolumeCaps(max_ram_cache_bytes=parsed("--max-ram-cache", args.max_ram_cache, lambda f, t: admin.parse_size(t)),
                      max_mount_pod_memory_bytes=parsed("--max-mount-pod-memory", args.max_mount_pod_memory,
                                                        quantity(memory_bytes)),
                      max_mount_pod_cpu_milli=parsed("--max-mount-pod-cpu", args.max_mount_pod_cpu, quantity(cpu_milli)),
                      max_stop_timeout_s=parsed("--max-stop-timeout", args.max_stop_timeout, seconds))


def build_pod_launcher(args: argparse.Namespace) -> PodLauncher:
    """The mount pods' launcher from the flags; ValueError naming a missing flag."""
    from csi_driver.mountpods import WATCH_S, MountPodSettings, PodLauncher, api_client, own_image

    node_name = args.node_name or args.node_id
    if not args.namespace:
        raise ValueError("--mount-mode pod needs --namespace (or $POD_NAMESPACE): where the mount pods live")
    if not args.mount_pod_image and not args.pod_name:
        raise ValueError("--mount-mode pod needs --mount-pod-image (or --pod-name/$POD_NAME to use this pod's image)")
    try:
        api = api_client(args.kubeconfig or None)
        image = args.mount_pod_image or own_image(api, args.namespace, args.pod_name, PLUGIN_CONTAINER)
    except CsiError as exc:
        raise ValueError(str(exc)) from None
    settings = MountPodSettings(namespace=args.namespace, node_name=node_name, image=image,
                                priority_class=args.mount_pod_priority_class,
                                service_account=args.mount_pod_service_account,
                                cluster_store_secret=args.cluster_store_secret,
                                default_cpu_limit=(f"{caps.max_mount_pod_cpu_milli}m"
                                                   if (caps := volume_caps(args)).max_mount_pod_cpu_milli else ""))
    return PodLauncher(settings, api, watch_s=args.mount_pod_watch_seconds or WATCH_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        sock = socket_path(args.endpoint)
    except ValueError as exc:
        print(f"cachefs-csi: error: {exc}", file=sys.stderr)
        return 2
    serve_node = args.mode in ("node", "all")
    serve_controller = args.mode in ("controller", "all")
    if serve_node and not args.node_id:
        print("cachefs-csi: error: --node-id is required in node mode", file=sys.stderr)
        return 2
    if args.max_volumes < 0:
        print("cachefs-csi: error: --max-volumes must not be negative", file=sys.stderr)
        return 2

    from csi_driver.controller import CachefsBucketAdmin, ControllerOps
    from csi_driver.node import NodeOps, NodeSettings
    from csi_driver.server import DriverInfo, build_server, package_version
    from csi_driver.trust import VolumeTrust

    environ = dict(os.environ)
    try:
        trust = VolumeTrust.from_flags(args.allow_node_identity, args.allowed_endpoints, args.allowed_buckets,
                                       args.cluster_store_endpoint, volume_caps(args), args.allow_local_endpoints)
    except ValueError as exc:
        print(f"cachefs-csi: error: {exc}", file=sys.stderr)
        return 2
    node = None
    if serve_node:
        cache_root = Path(os.path.abspath(args.cache_root))
        try:
            cache_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            print(f"cachefs-csi: error: cache root {cache_root}: {exc.strerror}", file=sys.stderr)
            return 2
        state_dir = Path(os.path.abspath(args.state_dir)) if args.state_dir else None
        pod_launcher = None
        run_root = Path(os.path.abspath(args.run_root))
        try:
            run_root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if args.mount_mode == "pod":
                pod_launcher = build_pod_launcher(args)
            # Daemons inherit the plugin's identity only where the admin allows it (csi_driver.trust).
            mounter = build_mounter(args.mount_mode, run_root, trust.daemon_environ(environ), args.log_level,
                                    pod_launcher, daemon_user(args))
        except OSError as exc:
            print(f"cachefs-csi: error: run root {run_root}: {exc.strerror}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"cachefs-csi: error: {exc}", file=sys.stderr)
            return 2
        node = NodeOps(NodeSettings(args.node_id, cache_root, args.max_volumes, state_dir, trust), mounter)
        node.adopt()
        if pod_launcher is not None:
            from csi_driver.podwatch import take_over

            take_over(pod_launcher, node, run_root)  # adopt, delete strays, watch (retried while the API is away)
            from csi_driver.janitor import CACHE_SWEEP_INTERVAL_S, CacheJanitor, persistent_volume_handles

            sweep_s = CACHE_SWEEP_INTERVAL_S if args.cache_sweep_seconds is None else args.cache_sweep_seconds
            if sweep_s > 0:
                core, driver_name = pod_launcher.core, args.driver_name
                CacheJanitor(node, lambda: persistent_volume_handles(core, driver_name), driver_name).start(sweep_s)
    controller = ControllerOps(CachefsBucketAdmin(), environ) if serve_controller else None
    info = DriverInfo(name=args.driver_name, version=package_version(),
                      serves_controller=serve_controller, serves_node=serve_node)
    server = build_server(info=info, node=node, controller=controller, max_workers=GRPC_WORKERS)

    try:
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)  # a socket left by a previous run of the plugin
    except OSError as exc:
        print(f"cachefs-csi: error: cannot prepare {sock}: {exc.strerror}", file=sys.stderr)
        return 2
    if server.add_insecure_port(f"unix:{sock}") == 0:
        print(f"cachefs-csi: error: cannot listen on {sock}", file=sys.stderr)
        return 2
    metrics_server = None
    if args.metrics_addr:
        from csi_driver import metrics

        host, _, port = args.metrics_addr.rpartition(":")
        if not port.isdigit() or not 0 <= int(port) < 65536:
            print(f"cachefs-csi: error: --metrics-addr {args.metrics_addr!r}: expected HOST:PORT", file=sys.stderr)
            return 2
        lookup = metrics.volume_lookup(node.settings.cache_root) if node is not None else (lambda target: None)
        bound_node = node

        def binds() -> dict[str, str]:  # the pods' binds of staged volumes, counted by state
            return bound_node.bound_targets() if bound_node is not None else {}

        try:
            metrics_server = metrics.serve(args.metrics_addr, lambda: metrics.cachefs_targets(lookup), binds)
        except OSError as exc:
            print(f"cachefs-csi: error: cannot serve metrics on {args.metrics_addr}: {exc.strerror}", file=sys.stderr)
            return 2
        # The port bound (port 0 asks the kernel for a free one; this line names it).
        log.info("serving metrics on %s:%d", host, metrics_server.server_address[1])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    log.info("%s %s serving %s on %s (node id %r, cache root %s)", info.name, info.version, args.mode, sock,
             args.node_id, args.cache_root if serve_node else "-")
    stop.wait()
    log.info("stopping: letting calls in flight finish for up to %g s", STOP_GRACE_S)
    server.stop(STOP_GRACE_S).wait()
    if metrics_server is not None:
        metrics_server.shutdown()
    sock.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
