"""The cache-management commands: ``prefetch``, ``snapshot``, ``unpin`` and ``evict``.

Each finds the mount's daemon from the mountpoint alone (``cachefs.client``), turns the paths a user
typed into paths relative to the mount root (a path means what it means in a shell: relative to the
working directory, or absolute; one outside the mount is refused, naming it), and asks the daemon,
which does the work (``cachefs.daemon.prefetch``). Manifest lines are relative to the mount root.

``prefetch MOUNT`` with neither PATH nor ``--manifest`` warms the whole mount, recursively, as
``juicefs warmup`` and Alluxio's ``load`` do for a directory; a PATH that is a directory still needs
``--recursive``, so a typo cannot start fetching a whole tree.

``prefetch MOUNT --order FILE`` does not warm: it announces a read order (one path per line, in
the order a job will open them; lines relative to the mount root, or absolute) for the daemon to
fetch ahead of the reader and to rank eviction by (``cachefs.loader``, ``cachefs.daemon.announce``).
It returns at once; ``--stream`` names the order (announcing again under the same name replaces
it, an empty file ends it). Paths that are missing or outside the mount are listed, and exit 1.

``prefetch`` starts a job in the daemon and polls it every ``POLL_INTERVAL_S``: on a terminal it
draws a progress bar (bytes, files, fetch rate, ETA) on stderr, otherwise it prints one summary
line at the end. Ctrl-C, SIGTERM and SIGHUP cancel the job in the daemon before exiting; a CLI
killed outright stops polling, and the daemon cancels the job when its lease runs out.

``--json-progress`` prints the job document as one compact JSON line at most every
``PROGRESS_LINE_INTERVAL_S`` while the job runs, and the final document as the last line: a log that
a follower reads without a terminal (the Dataset operator reads a warm-up Job's pod log this way,
``csi_driver.operator``). Each line is a whole document, so the last complete line of a log is the
latest state.

``--tier cluster`` warms the shared cluster tier instead of the disk tier (and ``--check --tier
cluster`` reports its coverage); the mount needs ``--cluster-cache``.

Exit status: 0 when everything asked for is cached on the disk tier (``--check``: is already
cached); 1 when some of it is not (failed, changed since the manifest, evicted, not cached), with
the files listed on stderr; 2 for a bad request (a missing path, a path outside the mount, an
unusable manifest, not a cachefs mount, a dataset that does not fit, the pin limit), one line on
stderr; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from cachefs.client import CONTROL_TIMEOUT_S, ControlError, UsageError, control_socket, enclosing_mount, request_json
from cachefs.loader import AnnounceError, announce
from cachefs.manifest import PREFETCH_TIERS, ManifestError, format_manifest, read_manifest
from cachefs.paths import PathError, mount_relative
from tiering.units import format_size

# How often the CLI polls a job: 5 per second keeps a progress bar fluid at the cost of a few
# hundred tiny requests a minute on the control socket (answered from memory).
POLL_INTERVAL_S = 0.2
# Lease the CLI asks for: the daemon cancels a job not polled for this long (a CLI killed by
# SIGKILL). 30 s rides out a stopped terminal (Ctrl-Z) for a while and keeps a dead CLI cheap.
JOB_LEASE_S = 30.0
# Resolving paths, snapshots and evictions list the store first: a tree of 100,000 directories is
# minutes of LISTs on a slow store. Requests that answer only after listing get this long.
LISTING_TIMEOUT_S = 600.0
# ``--json-progress``: a line every 5 s keeps a day-long warm-up's log under 20,000 lines (a few MiB)
# while a follower that reads it every 10-30 s always finds a fresh one.
PROGRESS_LINE_INTERVAL_S = 5.0
# Starting a job with a large manifest ships every entry in one request body.
START_TIMEOUT_S = 60.0
# Files listed per category (failed, changed, not cached) on stderr; the rest are counted.
MAX_LISTED_LINES = 50

EXIT_OK, EXIT_INCOMPLETE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
# The stream ``prefetch --order`` announces under unless told otherwise.
DEFAULT_ORDER_STREAM = "cli"


def _parallel(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected an integer from 1 to 1024") from None
    if not 1 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected an integer from 1 to 1024")
    return value


def _intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let options and PATHs come in any order (``prefetch MNT --recursive data``).

    Plain argparse fills a ``nargs="*"`` positional at its first chance, so a PATH after an option
    would be "unrecognized". ``parse_known_intermixed_args`` handles that, but only when called on
    the parser itself, and a subcommand's parser is called by its parent with ``parse_known_args``:
    route that call through the intermixed variant (which calls ``parse_known_args`` back itself).
    """
    base = type(parser)

    class IntermixedParser(base):  # type: ignore[valid-type, misc]
        _intermixing = False

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            if self._intermixing:
                return super().parse_known_args(args, namespace)
            self._intermixing = True
            try:
                return self.parse_known_intermixed_args(args, namespace)
            finally:
                self._intermixing = False

    parser.__class__ = IntermixedParser
    return parser


TARGET_HELP = "the mountpoint, or any path inside the mount (then also a PATH)"


def register(sub: Any) -> None:
    p = sub.add_parser("prefetch", help="warm the disk cache of a mount with files, directories or a manifest")
    p.add_argument("mountpoint", type=Path, metavar="TARGET",
                   help="the mountpoint, or any path inside the mount: alone, it is warmed with everything below it")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or directories inside the mount: absolute, or relative to the working directory "
                        "inside the mount, else to the mount root (default: TARGET, recursively: the whole mount, "
                        "recursively, for the mountpoint)")
    p.add_argument("--manifest", metavar="FILE",
                   help="file of paths, one per line, or JSON lines from 'cachefs snapshot' (- for stdin)")
    p.add_argument("--recursive", "-r", action="store_true", help="prefetch directories with everything below them")
    p.add_argument("--parallel", type=_parallel, default=None, metavar="N",
                   help="ranged GETs in flight for this prefetch (default: the mount's --max-fetches)")
    p.add_argument("--check", action="store_true", help="only report how much is cached; fetch nothing")
    p.add_argument("--pin", action="store_true", help="keep the files on the disk tier until 'cachefs unpin'")
    p.add_argument("--tier", choices=PREFETCH_TIERS, default="disk",
                   help="warm this node's disk tier (default), or the shared cluster tier only (no RAM or disk "
                        "use here; the mount needs --cluster-cache)")
    p.add_argument("--order", metavar="FILE",
                   help="announce this read order instead of warming: one path per line, in read order (- for stdin)")
    p.add_argument("--stream", default=DEFAULT_ORDER_STREAM, metavar="NAME",
                   help=f"the name of the announced order (with --order; default {DEFAULT_ORDER_STREAM!r})")
    p.add_argument("--json", action="store_true", help="print the final job document as JSON")
    p.add_argument("--json-progress", action="store_true",
                   help=f"print the job document as one JSON line every {PROGRESS_LINE_INTERVAL_S:g} s while it runs "
                        "and the final one last (for log followers)")
    p.set_defaults(handler=cmd_prefetch)
    _intermixed(p)

    s = sub.add_parser("snapshot", help="write the path, ETag and size of every file to a manifest")
    s.add_argument("mountpoint", type=Path, metavar="TARGET", help=TARGET_HELP)
    s.add_argument("path", nargs="?", default=None, metavar="PATH", help="a file or directory (default: all)")
    s.add_argument("-o", "--output", default="-", metavar="FILE", help="manifest to write (default: stdout)")
    s.set_defaults(handler=cmd_snapshot)
    _intermixed(s)

    u = sub.add_parser("unpin", help="let pinned files be evicted again")
    u.add_argument("mountpoint", type=Path, metavar="TARGET", help=TARGET_HELP)
    u.add_argument("paths", nargs="*", metavar="PATH", help="files or directories (default: everything pinned)")
    u.add_argument("--json", action="store_true", help="machine-readable output")
    u.set_defaults(handler=cmd_unpin)
    _intermixed(u)

    e = sub.add_parser("evict", help="drop cached data of files (all without PATH) from RAM and disk")
    e.add_argument("mountpoint", type=Path, metavar="TARGET", help=TARGET_HELP)
    e.add_argument("paths", nargs="*", metavar="PATH", help="files or directories (default: everything)")
    e.add_argument("--tier", choices=["all", "ram", "disk"], default="all", help="which tier(s) to drop from")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(handler=cmd_evict)
    _intermixed(e)


# ---------------------------------------------------------------------------------------- helpers
def _mountpoint(args: argparse.Namespace) -> tuple[str, str]:
    """``(mountpoint, control socket)`` of the mount holding the first argument (any path inside it,
    ``cachefs.client.enclosing_mount``); UsageError if it is not in a running cachefs mount. A first
    argument inside the mount, not its root, is also a PATH (``_targets``)."""
    mountpoint, inside = enclosing_mount(args.mountpoint)
    args.target = os.path.join(mountpoint, inside) if inside else ""
    return mountpoint, control_socket(Path(mountpoint))


def _targets(args: argparse.Namespace) -> list[str]:
    """The PATHs as typed, with the first argument first when it names a path inside the mount."""
    target = getattr(args, "target", "")
    return ([target] if target else []) + list(args.paths)


def _relative(paths: list[str], mountpoint: str, cwd: str) -> list[str]:
    """PATHs relative to the mount root. A relative PATH is taken from the working directory when that
    is inside the mount (as a shell would), else from the mount root: ``cachefs prefetch /mnt/data
    train`` typed in one's home means ``/mnt/data/train``."""
    root = os.path.normpath(os.path.join(cwd, mountpoint))
    inside = cwd == root or cwd.startswith(root.rstrip("/") + "/")
    try:
        return [mount_relative(p, mountpoint, cwd if inside or os.path.isabs(p) else root) for p in paths]
    except PathError as exc:
        raise UsageError(str(exc)) from None


def _request(socket: str, route: str, *, method: str = "GET", body: Any = None,
             timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
    try:
        return request_json(socket, route, method=method, body=body, timeout_s=timeout_s)
    except ControlError as exc:
        raise UsageError(str(exc)) from None


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


def _err(line: str) -> None:
    print(f"cachefs: {line}", file=sys.stderr)


@contextmanager
def _interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the command like Ctrl-C does: by cancelling the job first."""

    def raise_interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------- prefetch
def prefetch_body(args: argparse.Namespace, mountpoint: str, cwd: str) -> dict[str, Any]:
    """The request for ``POST /prefetch``; UsageError for anything wrong with the input.

    PATHs are taken relative to ``cwd``; manifest lines relative to the mount root.
    """
    if args.check and args.pin:
        raise UsageError("--check and --pin do not go together: --check changes nothing")
    if args.tier == "cluster" and args.pin:
        raise UsageError("--pin applies to the disk tier only: the cluster tier has no pins")
    named = _targets(args)
    paths = _relative(named, mountpoint, cwd)
    # Only the first argument named (a directory inside the mount): warm it and everything below it,
    # as a bare prefetch of the mountpoint warms the whole mount.
    recursive = args.recursive or (bool(named) and not args.paths and args.manifest is None)
    manifest: list[dict[str, Any]] = []
    name = "manifest"
    if args.manifest is not None:
        name = "<stdin>" if args.manifest == "-" else args.manifest
        try:
            entries = read_manifest(args.manifest)
        except ManifestError as exc:
            raise UsageError(str(exc)) from None
        for entry in entries:
            try:
                path = mount_relative(entry.path, mountpoint, mountpoint)
            except PathError as exc:
                raise UsageError(f"manifest {name} line {entry.line}: {exc}") from None
            item: dict[str, Any] = {"path": path, "line": entry.line}
            if entry.etag is not None:
                item["etag"] = entry.etag
            if entry.size is not None:
                item["size"] = entry.size
            manifest.append(item)
    elif not paths:
        paths, recursive = [""], True  # the whole mount, as --help says
    return {"paths": paths, "manifest": manifest, "manifest_name": name, "recursive": recursive,
            "parallel": args.parallel, "check": args.check, "pin": args.pin, "lease_s": JOB_LEASE_S,
            "tier": args.tier}


def read_order_file(name: str) -> list[str]:
    """The paths of an order file (``-``: stdin), blank lines skipped; UsageError if unreadable."""
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise UsageError(f"cannot read order file {name}: {exc.strerror or exc}") from None
    return [line for line in text.splitlines() if line.strip()]


def cmd_order(args: argparse.Namespace) -> int:
    """``prefetch MOUNT --order FILE``: announce, report, return."""
    others = [flag for flag, on in (("PATH", bool(args.paths)), ("--manifest", args.manifest is not None),
                                    ("--check", args.check), ("--pin", args.pin), ("--recursive", args.recursive),
                                    ("--tier cluster", args.tier == "cluster"))
              if on]
    if others:
        raise UsageError(f"--order does not go with {', '.join(others)}: it announces a read order, it warms nothing")
    mountpoint, _socket = _mountpoint(args)
    paths = read_order_file(args.order)
    try:
        result = announce(mountpoint, paths, stream=args.stream, cwd=mountpoint)
    except AnnounceError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json(vars(result))
    else:
        print(f"announced {result.files} files ({format_size(result.bytes)}) in read order as stream {result.stream!r}")
    _listed("missing", result.missing, result.missing_count)
    _listed("not a path in the mount", result.invalid, result.invalid_count)
    _listed("directories (not files)", result.directories, result.directories_count)
    return EXIT_OK if result.ok else EXIT_INCOMPLETE


def cmd_prefetch(args: argparse.Namespace, environ: dict[str, str]) -> int:
    if args.order is not None:
        return cmd_order(args)
    if args.json and args.json_progress:
        raise UsageError("--json and --json-progress do not go together: --json-progress prints the final document too")
    mountpoint, socket = _mountpoint(args)
    body = prefetch_body(args, mountpoint, os.getcwd())
    tty = sys.stderr.isatty() and not args.json and not args.json_progress
    with _interrupts_as_keyboard_interrupt():
        doc = _request(socket, "/prefetch", method="POST", body=body, timeout_s=START_TIMEOUT_S)
        job_id = doc["id"]
        try:
            doc = _follow(socket, job_id, tty, doc, lines=args.json_progress)
        except KeyboardInterrupt:
            try:
                doc = _request(socket, f"/prefetch/{job_id}", method="DELETE")
            except UsageError:
                pass  # the daemon is gone: there is no job left to cancel
            if args.json:
                _print_json(doc)
            elif args.json_progress:
                _print_line(doc)
            _err(f"prefetch cancelled: {format_size(doc.get('bytes_done', 0))} of "
                 f"{format_size(doc.get('bytes_total', 0))} cached; run it again to resume")
            return EXIT_INTERRUPTED
    if args.json_progress:
        _print_line(doc)
    return report(doc, as_json=args.json, quiet=args.json_progress)


def _print_line(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, sort_keys=True, separators=(",", ":")), flush=True)


def _follow(socket: str, job_id: str, tty: bool, doc: dict[str, Any], *, lines: bool = False,
            clock: Any = time.monotonic) -> dict[str, Any]:
    """Poll the job until it ends, drawing a progress bar on a terminal, or (``lines``) printing a
    JSON line every ``PROGRESS_LINE_INTERVAL_S`` (the final one is the caller's)."""
    if not tty:
        printed = None
        while doc["state"] in ("resolving", "running"):
            if lines and (printed is None or clock() - printed >= PROGRESS_LINE_INTERVAL_S):
                _print_line(doc)
                printed = clock()
            time.sleep(POLL_INTERVAL_S)
            doc = _request(socket, f"/prefetch/{job_id}")
        return doc
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TextColumn("{task.fields[files]}"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[eta]}"),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("listing", total=None, files="", rate="", eta="")
        while True:
            _update(progress, task, doc)
            if doc["state"] not in ("resolving", "running"):
                return doc
            time.sleep(POLL_INTERVAL_S)
            doc = _request(socket, f"/prefetch/{job_id}")


def _update(progress: Any, task: Any, doc: dict[str, Any]) -> None:
    if doc["state"] == "resolving" and not doc["files_total"]:
        progress.update(task, description="listing", total=None)
        return
    rate = doc["rate_bytes_per_s"]
    left = doc["bytes_total"] - doc["bytes_done"]
    eta = f"ETA {_duration(left / rate)}" if rate > 0 and left > 0 else ""
    progress.update(
        task,
        description="checking" if doc["check"] else "prefetch",
        total=doc["bytes_total"] or 1,
        completed=doc["bytes_done"] if doc["bytes_total"] else 1,
        files=f"{doc['files_done']}/{doc['files_total']} files",
        rate=f"{format_size(int(rate))}/s" if rate > 0 else "",
        eta=eta,
    )


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _listed(label: str, lines: list[str], total: int) -> None:
    for line in lines[:MAX_LISTED_LINES]:
        _err(f"{label}: {line}")
    if total > min(len(lines), MAX_LISTED_LINES):
        _err(f"{label}: ... and {total - min(len(lines), MAX_LISTED_LINES)} more")


def report(doc: dict[str, Any], *, as_json: bool = False, quiet: bool = False) -> int:
    """Print the outcome of a finished job; returns the exit status. ``quiet``: no summary line on
    stdout (``--json-progress`` printed the document; stderr still lists failures)."""
    state = doc["state"]
    if as_json:
        _print_json(doc)
    if state == "rejected":
        _err(f"error: {doc['error']}")
        return EXIT_USAGE
    if state in ("failed", "cancelled"):
        _err(f"error: prefetch {state}: {doc['error']}")
        return EXIT_INCOMPLETE
    total, cached = doc["bytes_total"], doc["bytes_cached"]
    percent = 100.0 * cached / total if total else 100.0
    where = " in the cluster tier" if doc.get("tier") == "cluster" else ""
    if doc["check"]:
        summary = (f"{percent:.1f}% cached{where}: {format_size(cached)} of {format_size(total)}, "
                   f"{doc['files_cached']} of {doc['files_total']} files complete")
    else:
        rate = doc["rate_bytes_per_s"]
        summary = (f"prefetched {doc['files_cached']} of {doc['files_total']} files, {format_size(cached)} of "
                   f"{format_size(total)} cached{where}: {format_size(doc['bytes_fetched'])} fetched, "
                   f"{format_size(doc['bytes_skipped'])} already cached, in {doc['elapsed_s']:.1f} s"
                   + (f" ({format_size(int(rate))}/s)" if rate > 0 else "")
                   + (", pinned" if doc["pin"] else ""))
    if not as_json and not quiet:
        print(f"cachefs: {summary}")
    _listed("failed", [f"{f['path']}: {f['error']}" for f in doc["failures"]], doc["failures_count"])
    changed = [
        f"{c['path']} (manifest line {c['line']}: {c['reason']}"
        + (f", ETag was {c['expected_etag']}, now {c['etag']}" if c["reason"] == "ETag differs" else "")
        + (f", size was {c['expected_size']}, now {c['size']}" if c["reason"] == "size differs" else "")
        + ")"
        for c in doc["changed"]
    ]
    _listed("changed since the manifest", changed, doc["changed_count"])
    if doc["check"]:
        _listed("not cached", doc["not_cached"], doc["not_cached_count"])
    if doc["changed_count"]:
        _err(f"error: {doc['changed_count']} file(s) changed since the manifest was written; they were not prefetched")
    return EXIT_OK if doc["ok"] else EXIT_INCOMPLETE


# ---------------------------------------------------------------------------------------- others
def cmd_snapshot(args: argparse.Namespace, environ: dict[str, str]) -> int:
    mountpoint, socket = _mountpoint(args)
    named = [args.path] if args.path is not None else [args.target] if args.target else []
    path = _relative(named, mountpoint, os.getcwd())[0] if named else ""
    doc = _request(socket, "/snapshot", method="POST", body={"path": path}, timeout_s=LISTING_TIMEOUT_S)
    files = doc["files"]
    text = format_manifest((f["path"], f["etag"], f["size"]) for f in files)
    if args.output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        _write_atomically(Path(args.output), text)
    total = sum(f["size"] for f in files)
    where = "stdout" if args.output == "-" else args.output
    skipped = f"; {doc['skipped_keys']} keys skipped (not valid file names)" if doc.get("skipped_keys") else ""
    _err(f"wrote {len(files)} files ({format_size(total)}) to {where}{skipped}")
    return EXIT_OK


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def cmd_unpin(args: argparse.Namespace, environ: dict[str, str]) -> int:
    mountpoint, socket = _mountpoint(args)
    body = {"paths": _relative(_targets(args), mountpoint, os.getcwd())}
    doc = _request(socket, "/unpin", method="POST", body=body, timeout_s=LISTING_TIMEOUT_S)
    if args.json:
        _print_json(doc)
    else:
        print(f"cachefs: unpinned {doc['files']} files ({format_size(doc['bytes'])}); "
              f"{doc['pinned_objects']} files ({format_size(doc['pinned_bytes'])}) still pinned")
    return EXIT_OK


def cmd_evict(args: argparse.Namespace, environ: dict[str, str]) -> int:
    mountpoint, socket = _mountpoint(args)
    body = {"paths": _relative(_targets(args), mountpoint, os.getcwd()), "tier": args.tier}
    doc = _request(socket, "/evict", method="POST", body=body, timeout_s=LISTING_TIMEOUT_S)
    if args.json:
        _print_json(doc)
        return EXIT_OK
    tiers = "RAM and disk" if args.tier == "all" else args.tier.upper() if args.tier == "ram" else "disk"
    files = f" of {doc['files']} files" if doc["files"] is not None else ""
    kept = ""
    if doc.get("pinned_blocks_kept"):
        kept = f"; {doc['pinned_blocks_kept']} pinned blocks kept on disk ('cachefs unpin' first)"
    elif doc.get("pinned_bytes_kept"):
        kept = f"; {format_size(doc['pinned_bytes_kept'])} of pinned blocks kept on disk ('cachefs unpin' first)"
    print(f"cachefs: dropped {doc['blocks']} blocks ({format_size(doc['bytes'])}){files} from {tiers}{kept}")
    return EXIT_OK
