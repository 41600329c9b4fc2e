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
cluster store's from the chain or ``--cluster-profile``, never argv; the cluster key from
``--cluster-key-file`` (or ``CACHEFS_CLUSTER_KEY_FILE``), as the mounts had it. Only records and
leases written with that key are replayed or obeyed; a journal object that fails its check is
reported (exit 3) and left where it is (``tiering.writeback.recovery``).
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
from cachefs.cli.mount import cluster_key_file
from cachefs.client import UsageError
from cachefs.settings import ClusterSettings, source_hash

# Timeouts of the recoverer's stores: a request inside the cluster answers in milliseconds; a PUT to
# the source of a large staged file may take a while, so reads get a minute (botocore retries too).
RECOVER_CONNECT_TIMEOUT_S = 5.0
RECOVER_READ_TIMEOUT_S = 60.0
# Exit statuses a periodic Job can act on (docs/durability.md, "Exit status"): 0 done or nothing to
# do; EXIT_RETRY when a journal could not be taken now but may be later (a live lease of a recoverer,
# or of a writer named with --prefix; another recoverer won; the lease was lost while recovering):
# 75 is sysexits' EX_TEMPFAIL, "try again later"; EXIT_DAMAGE when a record or its data failed its
# check (unreadable, missing, corrupt): someone must look. Damage wins over retry.
EXIT_RETRY = 75
EXIT_DAMAGE = 3

# The variable ``cachefs mount`` reads --cluster-key-file from (cachefs.cli.environment), read here too.
KEY_FILE_VARIABLE = "CACHEFS_CLUSTER_KEY_FILE"


class StoreUnreachable(Exception):
    """The source or the cluster store could not be reached: a retry later may succeed."""


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
    r.add_argument("--cluster-key-file", default=None, metavar="FILE",
                   help="the cluster key the mounts had (default: $CACHEFS_CLUSTER_KEY_FILE): only records, data "
                        "and leases written with it are replayed or obeyed")
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
                                  profile=args.cluster_profile,
                                  key_file=cluster_key_file(args.cluster_key_file or environ.get(KEY_FILE_VARIABLE)))
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
    try:
        reports = asyncio.run(_recover(args, environ, cluster, endpoint, volume))
    except StoreUnreachable as exc:
        print(f"cachefs: recover of {args.source}: {exc}; nothing was changed, run it again later", file=sys.stderr)
        return EXIT_RETRY
    if args.json:
        print(json.dumps(reports, indent=2, sort_keys=True))
    else:
        for report in reports:
            print(_line(report))
        if not reports:
            print(f"cachefs: no write-back journal of {args.source} in {cluster.url}", file=sys.stderr)
    if args.list:
        return 0
    return exit_status(reports, named=args.prefix is not None)


def exit_status(reports: list[dict[str, Any]], *, named: bool) -> int:
    """0, EXIT_RETRY or EXIT_DAMAGE for the reports of one run (see their constants). ``named``: the
    journal was named with --prefix, so a live writer's lease means "not yet" rather than "not lost"."""
    if any(r.get("failed") or r.get("forged") for r in reports):
        return EXIT_DAMAGE  # data that failed its check, or journal objects not written with the key
    for r in reports:
        if r["state"] in ("recovered", "already"):
            continue
        if r["state"] == "held" and not named and r.get("holder_role") == "writer":
            continue  # --expired: a live writer's journal is not a lost node's
        return EXIT_RETRY
    return 0


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
    if report["forged"]:
        text += (f"; NOT REPLAYED, left in place: {len(report['forged'])} journal objects fail their check "
                 f"(not written with the cluster key): {', '.join(report['forged'][:10])}")
    if report.get("never_acknowledged"):
        text += (f"; note: skipped what was never acknowledged (the writer died sending it): "
                 f"{', '.join(report['never_acknowledged'])}")
    return text


async def _recover(args: argparse.Namespace, environ: dict[str, str], cluster_settings: ClusterSettings,
                   endpoint: str | None, volume: str) -> list[dict[str, Any]]:
    import logging
    import time

    from tiering.errors import CacheError, ObjectStoreUnavailableError
    from tiering.objectstore import open_object_store
    from tiering.clusterkey import ClusterKey
    from tiering.writeback.durable import JournalKeys, conditional, read_lease
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
        assert cluster_settings.key_file is not None
        key = ClusterKey.from_file(cluster_settings.key_file)
        owner = f"recover:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        prefixes = [args.prefix] if args.prefix is not None else await list_writers(ccluster, volume)
        out: list[dict[str, Any]] = []
        for prefix in prefixes:
            if args.list:
                lease = await read_lease(ccluster, prefix, JournalKeys.of(key).leases)
                state = "no lease" if lease is None else (
                    f"{lease.role} {lease.owner}, expires in {lease.expires_in(time.time()):.0f} s")
                out.append({"prefix": prefix, "lease": state})
                continue
            report = await recover_prefix(csource, ccluster, prefix, key=key, owner=owner, wait_s=args.wait,
                                          assume_dead=args.assume_dead)
            out.append(asdict(report))
        return out
    except ObjectStoreUnavailableError as exc:
        raise StoreUnreachable(str(exc)) from None
    except CacheError as exc:
        raise UsageError(f"recover of {args.source}: {exc}") from None
    finally:
        await source.close()
        await cluster.close()
