"""``cachefs-operator``: run the Dataset operator (in a cluster: deploy/components/datasets).

The warm-up Jobs run ``--image``; without it, the image of this pod's ``operator`` container (the
pod named by ``$POD_NAME`` in ``$POD_NAMESPACE``, from the downward API), so an overlay that renames
the image renames the Jobs' too; outside a pod, ``DEFAULT_IMAGE``.

The kubernetes client is configured from the pod's service account (in a cluster) or from
``$KUBECONFIG``/``~/.kube/config`` (outside one); kopf logs in through the same client
(``kopf.login_via_client``), so both talk to the same API server as the same identity.

The image runs as uid 65532, which has no passwd entry, on a read-only root: nothing here may ask
for a user name or a home directory. kopf names its operator by ``getpass.getuser()`` unless it is
given an identity (issue 23: ``KeyError: 'getpwuid(): uid not found: 65532'`` in a restart loop), so
``operator_identity`` gives it one: the pod's name, else the host name and pid.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any, Mapping, Sequence, cast

import kopf
from kubernetes import client, config

from cachefs.cli.parsing import CliParser
from csi_driver.operator.handlers import (DEFAULT_IMAGE, DEFAULT_MOUNT_NAMESPACE, FOLLOW_INTERVAL_S, GATE_INTERVAL_S,
                                          USAGE_INTERVAL_S, OperatorSettings, OperatorState, build_registry)
from csi_driver.operator.spec import CURRENCY_RE, MAX_PRICE
from csi_driver.operator.usage import Prices
from csi_driver.operator.kube import Kube, KubeError

OWN_CONTAINER = "operator"  # the container of deploy/components/datasets/deployment.yaml


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"invalid interval {text!r}: expected seconds from 1 to 3600")
    return value


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_PRICE:
        raise argparse.ArgumentTypeError(f"invalid price {text!r}: expected a number from 0 to {MAX_PRICE:g}")
    return value


def _currency(text: str) -> str:
    if not CURRENCY_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid currency {text!r}: expected a code such as USD or EUR")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="cachefs-operator", description="run the cachefs Dataset operator")
    p.add_argument("--image", default=None,
                   help=f"image of the warm-up Jobs (default: this pod's own image, else {DEFAULT_IMAGE})")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="watch only this namespace (repeatable; default: the whole cluster)")
    p.add_argument("--follow-interval", type=_positive, default=FOLLOW_INTERVAL_S, metavar="S",
                   help=f"seconds between reads of warm-up progress (default {FOLLOW_INTERVAL_S:g})")
    p.add_argument("--gate-interval", type=_positive, default=GATE_INTERVAL_S, metavar="S",
                   help=f"seconds between checks of gated pods (default {GATE_INTERVAL_S:g})")
    p.add_argument("--usage-interval", type=_positive, default=USAGE_INTERVAL_S, metavar="S",
                   help=f"seconds between reads of the mount pods' stats into status.usage (default {USAGE_INTERVAL_S:g})")
    p.add_argument("--mount-namespace", default=DEFAULT_MOUNT_NAMESPACE, metavar="NS",
                   help=f"namespace of the CSI driver's mount pods (default {DEFAULT_MOUNT_NAMESPACE})")
    p.add_argument("--egress-price-per-gb", type=_price, default=None, metavar="PRICE",
                   help="what the source charges per GiB read out of it, for status.usage.estimatedCostAvoided "
                        "(a Dataset's spec.pricing overrides it; none: no estimate)")
    p.add_argument("--request-price-per-thousand", type=_price, default=None, metavar="PRICE",
                   help="what the source charges per 1000 GET requests (likewise)")
    p.add_argument("--currency", default="USD", type=_currency, help="currency of the prices (default USD)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                   help="kopf's liveness endpoint (default http://0.0.0.0:8080/healthz)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p


def _load_config() -> client.Configuration:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise SystemExit(f"cachefs-operator: no Kubernetes configuration: {exc}") from None
    return client.Configuration.get_default_copy()


def warm_up_image(kube: Kube, flag: str | None, environ: Mapping[str, str]) -> str:
    """``--image``, else this pod's own image, else ``DEFAULT_IMAGE``."""
    if flag:
        return flag
    pod, namespace = environ.get("POD_NAME"), environ.get("POD_NAMESPACE")
    if pod and namespace:
        try:
            own = kube.container_image(namespace, pod, OWN_CONTAINER)
        except KubeError as exc:
            raise SystemExit(f"cachefs-operator: {exc} (to learn the warm-up image; or pass --image)") from None
        if own:
            return own
    return DEFAULT_IMAGE


def operator_identity(environ: Mapping[str, str]) -> str:
    """kopf's id for this operator, without the passwd database: ``$POD_NAME``, else host and pid."""
    return environ.get("POD_NAME") or f"cachefs-operator@{socket.gethostname()}/{os.getpid()}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    kube = Kube(_load_config())
    image = warm_up_image(kube, args.image, os.environ)
    logging.getLogger("cachefs.operator").info("warm-up Jobs run %s", image)
    prices = Prices(egress_per_gb=args.egress_price_per_gb, requests_per_thousand=args.request_price_per_thousand,
                    currency=args.currency)
    state = OperatorState(kube=kube, settings=OperatorSettings(
        image=image, follow_interval_s=args.follow_interval, gate_interval_s=args.gate_interval,
        usage_interval_s=args.usage_interval, mount_namespace=args.mount_namespace, prices=prices))

    def login(**kwargs: Any) -> Any:
        return kopf.login_via_client(**kwargs)

    registry = build_registry(state, login=login)
    kopf.run(registry=registry, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness, standalone=True,
             identity=cast(Any, operator_identity(os.environ)))  # kopf types it as a NewType of str
    return 0
