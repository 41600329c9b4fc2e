"""``kubectl drain``'s pod selection, replayed against the API double: which pods it evicts, and which
make it refuse the whole drain.

kubectl cannot run against the double itself (kmock's discovery document is not one kubectl accepts),
so its rules are written down here, from kubectl's ``pkg/drain`` (``filters.go``, ``drain.go``) and its
documentation, and applied to the pods the double lists for the node (``labelSelector`` = the
``--pod-selector``, as kubectl asks the API server; the node by ``spec.nodeName``, which kubectl asks
for as a field selector):

1. a pod that ``--pod-selector`` does not match is not considered at all;
2. a mirror pod (annotation ``kubernetes.io/config.mirror``) is skipped;
3. a pod already being deleted (``deletionTimestamp``) for longer than ``--skip-wait-for-delete-timeout``
   is skipped (not modelled: the tests' pods are not being deleted);
4. a pod controlled by a DaemonSet: with ``--ignore-daemonsets`` skipped with a warning, without it
   the drain refuses ("cannot delete DaemonSet-managed Pods");
5. a pod that has finished (``status.phase`` Succeeded or Failed) is deleted whatever rules 6-7 say;
6. a pod with no controller (no ``ownerReferences`` entry with ``controller: true``): the drain refuses
   ("cannot delete Pods that declare no controller") unless ``--force``;
7. a pod with an ``emptyDir`` volume (local storage): the drain refuses ("cannot delete Pods with local
   storage") unless ``--delete-emptydir-data``.

A refusal stops the drain before any pod is evicted, as kubectl does.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from typing import Any

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


@dataclass
class DrainPlan:
    evicted: list[str] = field(default_factory=list)  # namespace/name
    skipped: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # namespace/name -> kubectl's reason

    @property
    def ok(self) -> bool:
        return not self.refused


def parse_drain(command: str) -> tuple[str, argparse.Namespace]:
    """The node and the flags of a ``kubectl drain NODE ...`` command line."""
    words = shlex.split(command)
    assert words[:2] == ["kubectl", "drain"], command
    parser = argparse.ArgumentParser(prog="kubectl drain", exit_on_error=False)
    parser.add_argument("node")
    parser.add_argument("--ignore-daemonsets", action="store_true")
    parser.add_argument("--delete-emptydir-data", action="store_true")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--pod-selector", default="")
    parser.add_argument("--grace-period", type=int, default=-1)
    parser.add_argument("--timeout", default="0s")
    args = parser.parse_args(words[2:])
    return args.node, args


def _controller(pod: Any) -> Any | None:
    for owner in pod.metadata.owner_references or []:
        if owner.controller:
            return owner
    return None


def plan(core: Any, command: str) -> DrainPlan:
    """What ``command`` (a ``kubectl drain`` line) does to the pods the API double holds."""
    node, args = parse_drain(command)
    listed = core.list_pod_for_all_namespaces(label_selector=args.pod_selector or None).items
    out = DrainPlan()
    for pod in listed:
        if pod.spec.node_name != node:
            continue
        name = f"{pod.metadata.namespace}/{pod.metadata.name}"
        if MIRROR_ANNOTATION in (pod.metadata.annotations or {}):
            out.skipped.append(name)
            continue
        controller = _controller(pod)
        if controller is not None and controller.kind == "DaemonSet":
            if args.ignore_daemonsets:
                out.skipped.append(name)
            else:
                out.refused[name] = "cannot delete DaemonSet-managed Pods (use --ignore-daemonsets to ignore)"
            continue
        finished = pod.status is not None and pod.status.phase in ("Succeeded", "Failed")
        if not finished and controller is None and not args.force:
            out.refused[name] = "cannot delete Pods that declare no controller (use --force to override)"
            continue
        if not finished and any(v.empty_dir is not None for v in pod.spec.volumes or []) and not args.delete_emptydir_data:
            out.refused[name] = "cannot delete Pods with local storage (use --delete-emptydir-data to override)"
            continue
        out.evicted.append(name)
    if out.refused:
        out.evicted = []
    return out
