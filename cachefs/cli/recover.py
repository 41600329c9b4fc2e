"""``cachefs recover``: finish the uploads of a lost node's write-back journal (``--write-durability cluster``).

A mount with ``--write-durability cluster`` keeps a copy of its pending writes in the cluster store
under ``writeback/<volume>/<node>/<incarnation>/`` (``tiering.writeback.durable``; the replay is ``tiering.writeback.recovery``). When the node is
gone for good, this command, run anywhere with the source's and the cluster store's credentials (by
hand, or as a Kubernetes Job), takes the lease on such a journal, replays it in order into the
source (writes, renames as a put and a delete, deletes, directory markers), never overwriting an
object rewritten in the source since, and removes the copies. It needs no mount and no daemon.

``--prefix P`` names one journal (as ``cachefs recover --list`` prints them); ``--expired`` takes
every journal of the source whose writer's lease has run out. ``--wait S`` waits up to S seconds for
a named journal's lease to run out; ``--assume-dead`` takes it at once: only for a node known to be
gone (a live writer would be fenced at its next lease renewal, see docs/durability.md).

The volume is named as the mount names it, from the source URL and its endpoint, so give SOURCE
and ``--endpoint-url`` as the mount had them. Credentials: the source's from the AWS chain, the
cluster store's from the chain or ``--cluster-profile``, never argv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import sys
from dataclasses import asdict
from typing import Any

from cachefs.cli.argtypes import seconds
from cachefs.client import UsageError
from cachefs.settings import ClusterSettings, source_hash

# Timeouts of the recoverer's stores: a request inside the cluster answers in milliseconds; a PUT to
# the source of a large staged file may take a while, so reads get a minute (botocore retries too).
RECOVER_CONNECT_TIMEOUT_S = 5.0
RECOVER_READ_TIMEOUT_S = 60.0
# Exit status when some journal could not be recovered now (a live lease, another recoverer, data
# that failed its check): the Job is retried, or the operator looks.
EXIT_INCOMPLETE = 3


def register(sub: Any) -> None:
    r = sub.add_parser("recover", help="finish the uploads of a lost node's write-back journal "
                                       "(--write-durability cluster)")
    r.add_argument("source", metavar="SOURCE", help="the source the mount had, e.g. s3://bucket/prefix")
    r.add_argument("--endpoint-url", default=None, metavar="URL", help="the source's endpoint, as the mount had it")
    r.add_argument("--cluster-cache", required=True, metavar="s3://BUCKET[/PREFIX]",
                   help="the cluster tier, as given to 'cachefs mount --cluster-cache'")
    r.add_argument("--cluster-endpoint-url", default=None, metavar="URL", help="endpoint of the cluster store")
    r.add_argument("--cluster-profile", default=None, metavar="NAME",
                   help="AWS profile with the cluster store's credentials (default: the standard chain)")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefix", default=None, metavar="PREFIX", help="the journal to recover (see --list)")
    which.add_argument("--expired", action="store_true", help="every journal of SOURCE whose lease has run out")
    which.add_argument("--list", action="store_true", help="list the journals of SOURCE and their leases")
    r.add_argument("--wait", type=seconds, default=0.0, metavar="S",
                   help="with --prefix: wait up to S seconds for its lease to run out")
    r.add_argument("--assume-dead", action="store_true",
                   help="with --prefix: take the journal without waiting for its lease (the node is known gone)")
    r.add_argument("--json", action="store_true", help="print the reports as JSON")
    r.set_defaults(handler=cmd_recover)


def cmd_recover(args: argparse.Namespace, environ: dict[str, str]) -> int:
    if (args.wait or args.assume_dead) and args.prefix is None:
        raise UsageError("--wait and --assume-dead apply to --prefix only")
    try:
        cluster = ClusterSettings(url=args.cluster_cache, endpoint_url=args.cluster_endpoint_url,
                                  profile=args.cluster_profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from tiering.objectstore.s3 import configured_endpoint_url

    try:  # the endpoint the mount's identity names (cachefs.cli.mount._endpoint_url)
        endpoint = args.endpoint_url or configured_endpoint_url(environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    volume = source_hash(args.source, endpoint)
    if args.prefix is not None and not args.prefix.startswith(f"writeback/{volume}/"):
        raise UsageError(f"--prefix {args.prefix!r} is not a journal of {args.source} (expected "
                         f"writeback/{volume}/NODE/INCARNATION/; see --list)")
    reports = asyncio.run(_recover(args, environ, cluster, endpoint, volume))
    if args.json:
        print(json.dumps(reports, indent=2, sort_keys=True))
    else:
        for report in reports:
            print(_line(report))
        if not reports:
            print(f"cachefs: no write-back journal of {args.source} in {cluster.url}", file=sys.stderr)
    if args.list:
        return 0
    bad = [r for r in reports if r.get("failed") or (r["state"] not in ("recovered", "already")
                                                      and (args.prefix is not None or r["state"] != "held"))]
    return EXIT_INCOMPLETE if bad else 0


def _line(report: dict[str, Any]) -> str:
    prefix = report["prefix"]
    if "lease" in report:  # --list
        return f"{prefix}  {report['lease']}"
    if report["state"] != "recovered":
        return f"cachefs: {prefix}: not recovered: {report['state']} ({report['detail']})"
    text = (f"cachefs: recovered {prefix}: {len(report['uploaded'])} files uploaded, {len(report['deleted'])} "
            f"deleted, {report['markers']} directory markers")
    if report["kept_newer"]:
        text += f"; left the newer version in the source of: {', '.join(report['kept_newer'])}"
    if report["failed"]:
        text += f"; FAILED (data unusable, see the log): {', '.join(report['failed'])}"
    return text


async def _recover(args: argparse.Namespace, environ: dict[str, str], cluster_settings: ClusterSettings,
                   endpoint: str | None, volume: str) -> list[dict[str, Any]]:
    import logging
    import time

    from tiering.errors import CacheError
    from tiering.objectstore import open_object_store
    from tiering.writeback.durable import conditional, read_lease
    from tiering.writeback.recovery import list_writers, recover_prefix

    logging.basicConfig(level=logging.WARNING, format="cachefs: %(message)s", stream=sys.stderr)
    try:
        source = open_object_store(args.source, endpoint_url=endpoint, connect_timeout_s=RECOVER_CONNECT_TIMEOUT_S,
                                   read_timeout_s=RECOVER_READ_TIMEOUT_S, environ=environ)
        cluster = open_object_store(cluster_settings.url, endpoint_url=cluster_settings.endpoint_url,
                                    connect_timeout_s=RECOVER_CONNECT_TIMEOUT_S, read_timeout_s=RECOVER_READ_TIMEOUT_S,
                                    environ=cluster_settings.environ(environ))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        csource, ccluster = conditional(source), conditional(cluster)
        if csource is None or ccluster is None:
            raise UsageError(f"recover needs S3 stores with conditional writes; {args.source} is not one")
        owner = f"recover:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        prefixes = [args.prefix] if args.prefix is not None else await list_writers(ccluster, volume)
        out: list[dict[str, Any]] = []
        for prefix in prefixes:
            if args.list:
                lease = await read_lease(ccluster, prefix)
                state = "no lease" if lease is None else (
                    f"{lease.role} {lease.owner}, expires in {lease.expires_in(time.time()):.0f} s")
                out.append({"prefix": prefix, "lease": state})
                continue
            report = await recover_prefix(csource, ccluster, prefix, owner=owner, wait_s=args.wait,
                                          assume_dead=args.assume_dead)
            out.append(asdict(report))
        return out
    except CacheError as exc:
        raise UsageError(f"recover of {args.source}: {exc}") from None
    finally:
        await source.close()
        await cluster.close()
