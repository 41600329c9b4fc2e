"""``cachefs cluster gc``: keep the shared cluster tier under a size.

The cluster tier (``--cluster-cache``, ``tiering.tiers.cluster``) enforces no size itself: every node
writes to it, none owns it. This command, run anywhere with access to the cluster store (a
Kubernetes CronJob, say), lists the blocks under the cluster prefix and deletes the least recently
*written* ones (S3 LastModified) until the total is at most ``--max-size``. It needs no mount and
no daemon; a block deleted under a reader is only a miss (fetched from the source and written
again). Credentials come from the AWS chain, or the named ``--cluster-profile``, never argv.

The alternative that needs no job: an S3 lifecycle rule expiring objects under the prefix after N
days (LRU by write time too, bounded by age instead of size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from cachefs.cli.argtypes import size
from cachefs.client import UsageError
from cachefs.settings import ClusterSettings
from tiering.units import format_size

# Timeouts of the gc's store: a LIST page or a DELETE answers in milliseconds inside a cluster; these
# only bound a dead endpoint, which fails the job with one line (the CronJob retries it).
GC_CONNECT_TIMEOUT_S = 5.0
GC_READ_TIMEOUT_S = 30.0


def register(sub: Any) -> None:
    c = sub.add_parser("cluster", help="manage the shared cluster tier (--cluster-cache)")
    csub = c.add_subparsers(dest="cluster_command", required=True)  # the parent's one-line-error parser class
    gc = csub.add_parser("gc", help="delete the least recently written blocks until the tier fits a size")
    gc.add_argument("--cluster-cache", required=True, metavar="s3://BUCKET[/PREFIX]",
                    help="the cluster tier, as given to 'cachefs mount --cluster-cache'")
    gc.add_argument("--cluster-endpoint-url", default=None, metavar="URL", help="endpoint of the cluster store")
    gc.add_argument("--cluster-profile", default=None, metavar="NAME",
                    help="AWS profile with the cluster store's credentials (default: the standard chain)")
    gc.add_argument("--max-size", type=size, required=True, metavar="SIZE",
                    help="largest total size of the blocks to keep, e.g. 500GiB")
    gc.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    gc.add_argument("--json", action="store_true", help="print the report as JSON")
    gc.set_defaults(handler=cmd_cluster_gc)


def cmd_cluster_gc(args: argparse.Namespace, environ: dict[str, str]) -> int:
    try:
        settings = ClusterSettings(url=args.cluster_cache, endpoint_url=args.cluster_endpoint_url,
                                   profile=args.cluster_profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report = asyncio.run(_gc(settings, args.max_size, args.dry_run, settings.environ(environ)))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"cachefs: {settings.url}: {report['blocks']} blocks ({format_size(report['bytes'])}); {verb} "
              f"{report['deleted']} ({format_size(report['deleted_bytes'])}) to stay under "
              f"{format_size(args.max_size)}")
    return 0


async def _gc(settings: ClusterSettings, max_bytes: int, dry_run: bool, environ: dict[str, str]) -> dict[str, Any]:
    from tiering.tiers.cluster import collect_garbage
    from tiering.errors import CacheError
    from tiering.objectstore import open_object_store

    store = open_object_store(settings.url, endpoint_url=settings.endpoint_url, connect_timeout_s=GC_CONNECT_TIMEOUT_S,
                              read_timeout_s=GC_READ_TIMEOUT_S, environ=environ)
    try:
        report = await collect_garbage(store, max_bytes, dry_run=dry_run)
    except CacheError as exc:
        raise UsageError(f"cluster gc of {settings.url}: {exc}") from None
    finally:
        await store.close()
    return {"blocks": report.blocks, "bytes": report.bytes, "deleted": report.deleted,
            "deleted_bytes": report.deleted_bytes, "dry_run": dry_run}
