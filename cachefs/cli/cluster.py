"""``cachefs cluster gc``: keep the shared cluster tier under a size; ``cachefs cluster init``: make its bucket.

The cluster tier (``--cluster-cache``, ``tiering.tiers.cluster``) enforces no size itself: every node
writes to it, none owns it. This command, run anywhere with access to the cluster store (a
Kubernetes CronJob, say), lists the blocks under the cluster prefix and deletes the least recently
*written* ones (S3 LastModified) until the total is at most ``--max-size``. It needs no mount and
no daemon; a block deleted under a reader is only a miss (fetched from the source and written
again). Credentials come from the AWS chain, or the named ``--cluster-profile``, never argv.

The alternative that needs no job: an S3 lifecycle rule expiring objects under the prefix after N
days (LRU by write time too, bounded by age instead of size).

``cachefs cluster init`` creates the cluster tier's bucket (a mount refuses a cluster store without
it), waiting for a store that is still starting: ``--tries`` attempts ``--interval`` seconds apart,
each bounded; a bucket that exists already is success, so running it again is harmless. It is the
command of deploy/components/cluster-store's bucket Job, and needs only what the image installs
(its own S3 client), nothing from the test extras (issue 36: the Job's script needed
boto3, which the image does not have).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from cachefs.cli.argtypes import size
from cachefs.client import UsageError
from cachefs.settings import ClusterSettings
from tiering.units import format_size

# Timeouts of the gc's store: a LIST page or a DELETE answers in milliseconds inside a cluster; these
# only bound a dead endpoint, which fails the job with one line (the CronJob retries it).
GC_CONNECT_TIMEOUT_S = 5.0
GC_READ_TIMEOUT_S = 30.0
# cluster init: a store being scheduled and started answers within minutes; 60 tries 5 s apart (with
# each try bounded by the gc's timeouts) fail a Job that will not succeed within about 6 minutes.
INIT_TRIES = 60
INIT_INTERVAL_S = 5.0


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
    init = csub.add_parser("init", help="create the cluster tier's bucket, waiting for the store to answer")
    init.add_argument("--cluster-cache", required=True, metavar="s3://BUCKET[/PREFIX]",
                      help="the cluster tier, as given to 'cachefs mount --cluster-cache'")
    init.add_argument("--cluster-endpoint-url", default=None, metavar="URL", help="endpoint of the cluster store")
    init.add_argument("--cluster-profile", default=None, metavar="NAME",
                      help="AWS profile with the cluster store's credentials (default: the standard chain)")
    init.add_argument("--tries", type=int, default=INIT_TRIES, metavar="N",
                      help=f"attempts while the store does not answer (default {INIT_TRIES})")
    init.add_argument("--interval", type=float, default=INIT_INTERVAL_S, metavar="SECONDS",
                      help=f"pause between attempts (default {INIT_INTERVAL_S:g})")
    init.set_defaults(handler=cmd_cluster_init)


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


def cmd_cluster_init(args: argparse.Namespace, environ: dict[str, str]) -> int:
    try:
        settings = ClusterSettings(url=args.cluster_cache, endpoint_url=args.cluster_endpoint_url,
                                   profile=args.cluster_profile)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.tries < 1 or not args.interval >= 0:
        raise UsageError("--tries must be at least 1 and --interval not negative")
    bucket = settings.url.removeprefix("s3://").split("/", 1)[0]
    return asyncio.run(_init(settings, bucket, args.tries, args.interval, settings.environ(environ)))


async def _init(settings: ClusterSettings, bucket: str, tries: int, interval_s: float, environ: dict[str, str]) -> int:
    from tiering.errors import CacheError
    from tiering.objectstore import open_object_store
    from tiering.objectstore.s3 import S3ObjectStore

    store = open_object_store(f"s3://{bucket}", endpoint_url=settings.endpoint_url,
                              connect_timeout_s=GC_CONNECT_TIMEOUT_S, read_timeout_s=GC_READ_TIMEOUT_S, environ=environ)
    assert isinstance(store, S3ObjectStore)  # ClusterSettings takes s3:// only
    why = "not tried"
    try:
        for attempt in range(1, tries + 1):
            try:
                made = await store.create_bucket()
                print(f"cachefs: bucket {bucket} {'created' if made else 'exists'}", flush=True)
                return 0
            except CacheError as exc:
                why = str(exc).splitlines()[0][:300]
            print(f"cachefs: try {attempt} of {tries}: {why}", flush=True)
            if attempt < tries:
                await asyncio.sleep(interval_s)
    finally:
        await store.close()
    print(f"cachefs: error: cluster init: bucket {bucket} at {settings.endpoint_url or 'the default endpoint'} not "
          f"created after {tries} tries: {why}", file=sys.stderr)
    return 1
