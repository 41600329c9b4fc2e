"""The write-back commands: ``flush`` and ``status``, and the flush ``cachefs unmount`` runs first.

``cachefs flush MOUNTPOINT [--timeout S]`` waits until everything written through the mount and
acknowledged (closed or fsync'd) is in the object store. Exit 0 when it is; 1 when something is
still pending after S seconds, listing each pending path with its stage and last error (uploads go
on in the background). Files still open with writes not yet closed or fsync'd are named in a note:
they are not flushed, since uploading them would put a half-written file in the bucket.

``cachefs status PATH...`` shows the durability stage of each path: ``writing`` (changed, not yet
closed or fsync'd), ``dirty`` (durable on local disk, waiting for upload), ``uploading``,
``deleting``, or ``clean`` (in the object store). A directory shows what is pending below it. Paths
may lie in different mounts; each daemon is asked about its own. Exit 0, or 1 if a path does not
exist. PATHs mean what they mean in a shell: ``cd /mnt/data/out && cachefs status model.pt``.

Both print one line per path on stdout (``--json``: one document) and a summary on stderr; a usage
problem (not a cachefs mount, path outside it) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cachefs.client import UsageError, call, enclosing_mount, mount_holding
from tiering.units import format_size

# `cachefs flush` waits this long by default: enough for gigabytes on a healthy link; a store that is
# down is reported (exit 1, with the reason per file) instead of waited out.
DEFAULT_FLUSH_TIMEOUT_S = 300.0
# The control request outlives the flush it asks for by this much (the daemon answers right after).
RPC_SLACK_S = 30.0
# Pending entries listed line by line; the rest are counted.
MAX_LISTED = 200

EXIT_OK, EXIT_PENDING = 0, 1


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: expected seconds, e.g. 30 or 0.5") from None
    if not 0 <= value <= 86400 or value != value:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: must be between 0 and 86400 seconds")
    return value


def register(sub: Any) -> None:
    f = sub.add_parser("flush", help="wait until everything written through a mount is in the object store")
    f.add_argument("mountpoint", type=Path, metavar="PATH", help="the mountpoint, or any path inside the mount")
    f.add_argument("--timeout", type=_seconds, default=DEFAULT_FLUSH_TIMEOUT_S, metavar="S",
                   help=f"give up after S seconds, listing what is pending (default {DEFAULT_FLUSH_TIMEOUT_S:g})")
    f.add_argument("--json", action="store_true", help="machine-readable output")
    f.set_defaults(handler=cmd_flush)

    s = sub.add_parser("status", help="durability stage of files: writing, dirty (on local disk, and in the cluster store with "
                                            "--write-durability cluster), uploading or clean (in the source)")
    s.add_argument("paths", nargs="+", metavar="PATH", help="files or directories inside cachefs mounts")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(handler=cmd_status)


# ---------------------------------------------------------------------------------------- flush
def flush_mount(mountpoint: Path, timeout_s: float) -> dict[str, Any]:
    """Ask the daemon of ``mountpoint`` to flush; its report (``ok``, ``pending``, ``elapsed_s``)."""
    return call(mountpoint, "/writeback/flush", method="POST", body={"timeout_s": timeout_s},
                timeout_s=timeout_s + RPC_SLACK_S)


def pending_line(entry: dict[str, Any]) -> str:
    """``dirty      12.0 MiB  ckpt/step-100.pt  (3 attempts, last error: ...)``"""
    size = entry.get("size")
    size_text = format_size(size) if isinstance(size, int) else "-"
    kind = "/" if entry.get("kind") == "directory" else ""
    details = []
    if entry.get("durable_in") == "cluster":
        details.append("on local disk and in the cluster store")
    elif entry.get("durable_in") == "local" and entry.get("stage") != "uploading":
        details.append("on local disk only")
    if entry.get("stage") == "uploading":
        details.append("dirty on local disk, upload in progress")
    if isinstance(entry.get("unuploaded_for_s"), (int, float)):
        details.append(f"oldest version not in the object store: {entry['unuploaded_for_s']:.0f} s old")
    if entry.get("unsynced"):
        details.append("more changes not yet closed or fsync'd")
    if entry.get("attempts"):
        details.append(f"{entry['attempts']} failed attempts")
    if entry.get("last_error"):
        details.append(f"last error: {entry['last_error']}")
    elif entry.get("error"):
        details.append(f"error: {entry['error']}")
    tail = f"  ({'; '.join(details)})" if details else ""
    return f"{entry.get('stage', '?'):<10} {size_text:>10}  {entry.get('path', '?')}{kind}{tail}"


def print_pending(pending: list[dict[str, Any]], out: Any = None) -> None:
    out = out or sys.stdout
    for entry in pending[:MAX_LISTED]:
        print(pending_line(entry), file=out)
    if len(pending) > MAX_LISTED:
        print(f"... and {len(pending) - MAX_LISTED} more", file=out)


def cmd_flush(args: argparse.Namespace, environ: dict[str, str]) -> int:
    mountpoint = mount_holding(args.mountpoint)  # any path inside the mount names it
    report = flush_mount(mountpoint, args.timeout)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return EXIT_OK if report.get("ok") else EXIT_PENDING
    pending = report.get("pending", [])
    unsynced = report.get("unsynced", [])
    if unsynced:
        names = ", ".join(str(u.get("path")) for u in unsynced[:10]) + (" ..." if len(unsynced) > 10 else "")
        print(f"cachefs: note: {len(unsynced)} files are open with writes not yet closed or fsync'd, so not "
              f"flushed: {names}", file=sys.stderr)
    if report.get("ok"):
        print(f"cachefs: {mountpoint}: everything written and closed (or fsync'd) is in the object store "
              f"({report.get('elapsed_s', 0):.1f} s)", file=sys.stderr)
        return EXIT_OK
    print_pending(pending)
    print(f"cachefs: flush of {mountpoint} did not finish within {args.timeout:g} s: {len(pending)} changes are "
          "not in the object store yet (listed above; uploads go on in the background)", file=sys.stderr)
    return EXIT_PENDING


# ---------------------------------------------------------------------------------------- status
def cmd_status(args: argparse.Namespace, environ: dict[str, str]) -> int:
    groups: dict[str, list[tuple[str, str]]] = {}
    for path in args.paths:
        mountpoint, rel = enclosing_mount(path)
        groups.setdefault(mountpoint, []).append((path, rel))
    results: list[dict[str, Any]] = []
    for mountpoint, items in groups.items():
        doc = call(Path(mountpoint), "/writeback/status", method="POST", body={"paths": [rel for _, rel in items]})
        for (typed, _rel), status in zip(items, doc.get("paths", [])):
            results.append({**status, "argument": typed, "mountpoint": mountpoint})
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        for status in results:
            line = pending_line({**status, "path": status["argument"]})
            print(line)
            for entry in status.get("pending", [])[:MAX_LISTED]:
                print("    " + pending_line(entry))
            if len(status.get("pending", [])) > MAX_LISTED:
                print(f"    ... and {len(status['pending']) - MAX_LISTED} more")
    missing = [s["argument"] for s in results if s.get("stage") in ("missing", "unknown")]
    if missing:
        print(f"cachefs: no such file or directory in the mount: {', '.join(missing)}", file=sys.stderr)
        return 1
    return EXIT_OK
