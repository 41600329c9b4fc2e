"""What Kubernetes adds to a CSI volume's context between CreateVolume and NodeStage/NodePublish.

The driver's tests must hand NodeStage and NodePublish the volume context a real cluster hands it,
not the one CreateVolume returned. The rules, as the real components apply them:

- **external-provisioner** calls CreateVolume with the StorageClass's ``parameters`` less its own
  ``csi.storage.k8s.io/*-secret-name``/``-namespace`` keys, plus, with ``--extra-create-metadata``
  (deploy/base sets it), ``csi.storage.k8s.io/pvc/name``, ``pvc/namespace`` and ``pv/name``.
- **external-provisioner** (kubernetes-csi/external-provisioner, v1 to v5, ``controller.go``) copies
  CreateVolume's ``volume_context`` into the new PersistentVolume's ``spec.csi.volumeAttributes``
  and adds ``storage.kubernetes.io/csiProvisionerIdentity`` = ``"<start ms>-<random>-<driver>"``
  to it. The PV's CSI source is immutable afterwards: the key stays for the volume's whole life.
- **kubelet** passes the PV's ``volumeAttributes`` unchanged to NodeStageVolume. To NodePublishVolume
  it passes them plus, when the CSIDriver says ``podInfoOnMount: true``,
  ``csi.storage.k8s.io/pod.name``, ``pod.namespace``, ``pod.uid``, ``serviceAccount.name`` and
  ``csi.storage.k8s.io/ephemeral`` ("true" for an inline volume, "false" for a PV); an inline volume
  gets its ``volumeAttributes`` from the pod spec (no provisioner key).

``create_parameters``, ``provisioned_attributes`` and ``publish_context`` apply those rules; nothing
here is cachefs code.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Mapping

from csi_driver.attributes import (K8S_EPHEMERAL, K8S_POD_NAME, K8S_POD_NAMESPACE, K8S_POD_UID,
                                   K8S_PROVISIONER_IDENTITY, K8S_SERVICE_ACCOUNT)

DRIVER_NAME = "csi.cachefs.io"


def create_parameters(storage_class_parameters: Mapping[str, str], claim: str, namespace: str,
                      volume: str) -> dict[str, str]:
    """The ``parameters`` of external-provisioner's CreateVolume for a claim of that StorageClass."""
    kept = {k: v for k, v in storage_class_parameters.items()
            if not (k.startswith("csi.storage.k8s.io/") and ("-secret-name" in k or "-secret-namespace" in k))}
    return {**kept, "csi.storage.k8s.io/pvc/name": claim, "csi.storage.k8s.io/pvc/namespace": namespace,
            "csi.storage.k8s.io/pv/name": volume}


def provisioner_identity(driver: str = DRIVER_NAME) -> str:
    """external-provisioner's identity: its start time in ms, a random number, the driver's name."""
    return f"{int(time.time() * 1000)}-{random.randrange(10_000)}-{driver}"


def provisioned_attributes(volume_context: Mapping[str, str], identity: str | None = None) -> dict[str, str]:
    """The ``volumeAttributes`` of the PersistentVolume external-provisioner creates for a CreateVolume answer."""
    return {**volume_context, K8S_PROVISIONER_IDENTITY: identity or provisioner_identity()}


def publish_context(attributes: Mapping[str, str], pod: str = "trainer-0", namespace: str = "ml", *,
                    service_account: str = "default", ephemeral: bool = False) -> dict[str, str]:
    """The ``volume_context`` of the kubelet's NodePublishVolume for ``pod`` (``podInfoOnMount: true``)."""
    return {**attributes, K8S_POD_NAME: pod, K8S_POD_NAMESPACE: namespace,
            K8S_POD_UID: str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{namespace}/{pod}")),
            K8S_SERVICE_ACCOUNT: service_account, K8S_EPHEMERAL: "true" if ephemeral else "false"}
