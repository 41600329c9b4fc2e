"""``cachefs-operator``: run the Dataset operator (in a cluster: deploy/components/datasets).

The kubernetes client is configured from the pod's service account (in a cluster) or from
``$KUBECONFIG``/``~/.kube/config`` (outside one); kopf logs in through the same client
(``kopf.login_via_client``), so both talk to the same API server as the same identity.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

import kopf
from kubernetes import client, config

from csi_driver.operator.handlers import (DEFAULT_IMAGE, FOLLOW_INTERVAL_S, GATE_INTERVAL_S, OperatorSettings,
                                          OperatorState, build_registry)
from csi_driver.operator.kube import Kube


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"invalid interval {text!r}: expected seconds from 1 to 3600")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachefs-operator", description="run the cachefs Dataset operator")
    p.add_argument("--image", default=DEFAULT_IMAGE, help=f"image of the warm-up Jobs (default {DEFAULT_IMAGE})")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="watch only this namespace (repeatable; default: the whole cluster)")
    p.add_argument("--follow-interval", type=_positive, default=FOLLOW_INTERVAL_S, metavar="S",
                   help=f"seconds between reads of warm-up progress (default {FOLLOW_INTERVAL_S:g})")
    p.add_argument("--gate-interval", type=_positive, default=GATE_INTERVAL_S, metavar="S",
                   help=f"seconds between checks of gated pods (default {GATE_INTERVAL_S:g})")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                   help="kopf's liveness endpoint (default http://0.0.0.0:8080/healthz)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p


def _load_config() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise SystemExit(f"cachefs-operator: no Kubernetes configuration: {exc}") from None
    return client.ApiClient()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    state = OperatorState(kube=Kube(_load_config()),
                          settings=OperatorSettings(image=args.image, follow_interval_s=args.follow_interval,
                                                    gate_interval_s=args.gate_interval))

    def login(**kwargs: Any) -> Any:
        return kopf.login_via_client(**kwargs)

    registry = build_registry(state, login=login)
    kopf.run(registry=registry, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness, standalone=True)
    return 0
