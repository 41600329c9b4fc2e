"""A Dataset's spec, parsed into frozen settings, or ``SpecError`` with one line naming the problem.

The CRD's schema refuses what a schema can (types, patterns, enums, bounds); this module checks the
rest before anything is created: the volume attributes the spec turns into go through the CSI
driver's own parser (``attributes.parse_volume_attributes``), so a Dataset the driver would refuse
at mount time is refused here; warm-up paths stay inside the dataset; the combinations make sense
(a cluster-tier warm-up needs a cluster tier; pins are for disk tiers); the cron schedule parses.
Specs that reach the operator without the API server's schema check (a test, an old CRD) get the
same answers, since every field read here is checked here too.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from csi_driver import attributes
from csi_driver.errors import CsiError
from csi_driver.operator.cron import Cron, CronError, parse_cron
from csi_driver.operator.usage import Prices

TIER_CLUSTER, TIER_NODE = "Cluster", "Node"
POLICY_ONCE, POLICY_CRON = "Once", "Cron"
# What the CRD defaults to, repeated for specs that did not pass through the API server's defaulting.
DEFAULT_CAPACITY = "1Ti"
DEFAULT_GATE_TIMEOUT_S = 3600  # an hour: a warm-up of a few TiB at cluster bandwidth, then train anyway
DEFAULT_ACTIVE_DEADLINE_S = 86400  # a day: the Job is killed, the run reported failed
MAX_GATE_TIMEOUT_S = 7 * 86400
MAX_WARMUP_PATHS = 256
# A price per GB or per thousand requests above this is a typo (a unit mixed up), not a tariff.
MAX_PRICE = 1000.0
CURRENCY_RE = re.compile(r"[A-Z]{3}")  # an ISO 4217 code
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_KEY_RE = re.compile(r"[-._a-zA-Z0-9]{1,253}")
_CAPACITY_RE = re.compile(r"[0-9]+(Ki|Mi|Gi|Ti|Pi)?")
_LABEL_VALUE_RE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_LABEL_KEY_RE = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


class SpecError(ValueError):
    """A Dataset spec that cannot be served; the message is one line, naming the field."""


@dataclass(frozen=True)
class WarmUpSettings:
    paths: tuple[str, ...] = ()  # relative to the dataset root, normalised; () = everything
    manifest_config_map: str | None = None
    manifest_key: str = "manifest"
    tier: str = TIER_CLUSTER
    node_selector: Mapping[str, str] = field(default_factory=dict)
    policy: str = POLICY_ONCE
    cron: Cron | None = None
    pin: bool = False
    parallel: int | None = None
    active_deadline_s: int = DEFAULT_ACTIVE_DEADLINE_S


@dataclass(frozen=True)
class DatasetSettings:
    volume_attributes: Mapping[str, str]  # the PV's spec.csi.volumeAttributes, accepted by the driver
    secret_name: str | None
    capacity: str
    warm_up: WarmUpSettings
    gate_timeout_s: int
    # spec.pricing: what the source charges, for the estimate of the cost avoided (None: the operator's)
    egress_per_gb: float | None = None
    requests_per_thousand: float | None = None
    currency: str | None = None

    def prices(self, default: Prices) -> Prices:
        """The Dataset's prices, each one falling back to the operator's."""
        return Prices(egress_per_gb=self.egress_per_gb if self.egress_per_gb is not None else default.egress_per_gb,
                      requests_per_thousand=(self.requests_per_thousand if self.requests_per_thousand is not None
                                             else default.requests_per_thousand),
                      currency=self.currency or default.currency)


def _mapping(spec: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}{key} must be an object")
    return value


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"{where} must be a whole number from {low} to {high}, got {value!r}")
    return value


def _warm_path(path: Any, index: int) -> str:
    where = f"spec.warmUp.paths[{index}]"
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 1024:
        raise SpecError(f"{where} must be a non-empty path of at most 1024 characters")
    if path.startswith("/"):
        raise SpecError(f"{where} {path!r} must be relative to the dataset's root, not absolute")
    normal = posixpath.normpath(path)
    if normal == ".." or normal.startswith("../"):
        raise SpecError(f"{where} {path!r} leads outside the dataset")
    return "" if normal == "." else normal


# The driver's messages name volume attributes; a Dataset's author wrote spec fields.
_FIELD_OF_ATTRIBUTE = {
    f"'{attributes.ATTR_CLUSTER_CACHE}'": "'clusterTier.cache'",
    f"'{attributes.ATTR_CLUSTER_ENDPOINT_URL}'": "'clusterTier.endpointUrl'",
    f"'{attributes.ATTR_CLUSTER_TIMEOUT}'": "'clusterTier.timeout'",
    **{f"'{key}'": f"'cache.{key}'" for key in (attributes.ATTR_RAM_CACHE, attributes.ATTR_DISK_CACHE,
                                                attributes.ATTR_BLOCK_SIZE, attributes.ATTR_READAHEAD,
                                                attributes.ATTR_MAX_FETCHES, attributes.ATTR_ATTR_TTL,
                                                attributes.ATTR_DIR_TTL, attributes.ATTR_DIRECT_IO,
                                                attributes.ATTR_FUSE_THREADS)},
}


# The keys of spec.cache: the CSI driver's cache attributes a read-only Dataset volume can use (no
# write-back keys; the cluster tier has spec.clusterTier). The CRD declares exactly these (a test checks).
DATASET_CACHE_KEYS = (attributes.ATTR_RAM_CACHE, attributes.ATTR_DISK_CACHE, attributes.ATTR_BLOCK_SIZE,
                      attributes.ATTR_READAHEAD, attributes.ATTR_MAX_FETCHES, attributes.ATTR_ATTR_TTL,
                      attributes.ATTR_DIR_TTL, attributes.ATTR_DIRECT_IO, attributes.ATTR_FUSE_THREADS)


def _spec_names(message: str) -> str:
    message = message.replace("volume attributes", "fields").replace("volume attribute", "field")
    for attribute, spec_field in _FIELD_OF_ATTRIBUTE.items():
        message = message.replace(attribute, spec_field)
    return message


def volume_attributes(spec: Mapping[str, Any]) -> dict[str, str]:
    """The CSI volume attributes of a Dataset (the driver's names; every value a string)."""
    attrs: dict[str, str] = {attributes.ATTR_SOURCE: str(spec.get("source", "")), attributes.ATTR_READ_ONLY: "true"}
    for key, attr in (("endpointUrl", attributes.ATTR_ENDPOINT_URL), ("region", attributes.ATTR_REGION)):
        if spec.get(key):
            attrs[attr] = str(spec[key])
    for key, value in _mapping(spec, "cache", "spec.").items():
        attrs[str(key)] = str(value).lower() if isinstance(value, bool) else str(value)
    cluster = _mapping(spec, "clusterTier", "spec.")
    for key, attr in (("cache", attributes.ATTR_CLUSTER_CACHE), ("endpointUrl", attributes.ATTR_CLUSTER_ENDPOINT_URL),
                      ("timeout", attributes.ATTR_CLUSTER_TIMEOUT)):
        if cluster.get(key) is not None:
            attrs[attr] = str(cluster[key])
    return attrs


def parse_spec(spec: Mapping[str, Any]) -> DatasetSettings:
    """``DatasetSettings`` for a Dataset's spec; ``SpecError`` for the first problem found."""
    if not isinstance(spec, Mapping) or not spec.get("source"):
        raise SpecError("spec.source is required (s3://bucket[/prefix])")
    cache = _mapping(spec, "cache", "spec.")
    unknown = sorted(set(cache) - set(DATASET_CACHE_KEYS))
    if unknown:
        raise SpecError(f"spec.cache: unknown key {unknown[0]!r} (known: {', '.join(DATASET_CACHE_KEYS)}; "
                        "the cluster tier goes in spec.clusterTier)")
    attrs = volume_attributes(spec)
    try:
        volume = attributes.parse_volume_attributes(attrs)
    except CsiError as exc:
        raise SpecError(f"spec: {_spec_names(exc.message)}") from None

    secret = _mapping(spec, "secretRef", "spec.").get("name")
    if secret is not None and not (isinstance(secret, str) and _NAME_RE.fullmatch(secret)):
        raise SpecError(f"spec.secretRef.name {secret!r} is not a Secret name")
    capacity = spec.get("capacity", DEFAULT_CAPACITY)
    if not isinstance(capacity, str) or not _CAPACITY_RE.fullmatch(capacity):
        raise SpecError(f"spec.capacity {capacity!r} must be a quantity such as 500Gi or 2Ti")
    gate = _mapping(spec, "gate", "spec.")
    gate_timeout = _int(gate.get("timeoutSeconds", DEFAULT_GATE_TIMEOUT_S), "spec.gate.timeoutSeconds", 0,
                        MAX_GATE_TIMEOUT_S)
    warm_up = _parse_warm_up(_mapping(spec, "warmUp", "spec."), has_cluster_tier=volume.cache.cluster_cache is not None)
    pricing = _mapping(spec, "pricing", "spec.")
    unknown = sorted(set(pricing) - {"egressPerGB", "requestsPerThousand", "currency"})
    if unknown:
        raise SpecError(f"spec.pricing: unknown key {unknown[0]!r} (known: egressPerGB, requestsPerThousand, currency)")
    egress, requests = (_price(pricing.get(k), f"spec.pricing.{k}") for k in ("egressPerGB", "requestsPerThousand"))
    currency = pricing.get("currency")
    if currency is not None and not (isinstance(currency, str) and CURRENCY_RE.fullmatch(currency)):
        raise SpecError(f"spec.pricing.currency {currency!r} must be a currency code such as USD or EUR")
    return DatasetSettings(volume_attributes=attrs, secret_name=secret, capacity=capacity, warm_up=warm_up,
                           gate_timeout_s=gate_timeout, egress_per_gb=egress, requests_per_thousand=requests,
                           currency=currency)


def _price(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_PRICE:
        raise SpecError(f"{where} must be a price from 0 to {MAX_PRICE:g}, got {value!r}")
    return float(value)


def _parse_warm_up(warm: Mapping[str, Any], *, has_cluster_tier: bool) -> WarmUpSettings:
    raw_paths = warm.get("paths") or []
    if not isinstance(raw_paths, list) or len(raw_paths) > MAX_WARMUP_PATHS:
        raise SpecError(f"spec.warmUp.paths must be a list of at most {MAX_WARMUP_PATHS} paths")
    paths = tuple(_warm_path(p, i) for i, p in enumerate(raw_paths))
    if "" in paths:
        paths = ()  # "." is the whole dataset
    manifest = _mapping(warm, "manifest", "spec.warmUp.")
    config_map = key = None
    if manifest:
        ref = _mapping(manifest, "configMapRef", "spec.warmUp.manifest.")
        config_map, key = ref.get("name"), ref.get("key", "manifest")
        if not (isinstance(config_map, str) and _NAME_RE.fullmatch(config_map)):
            raise SpecError(f"spec.warmUp.manifest.configMapRef.name {config_map!r} is not a ConfigMap name")
        if not (isinstance(key, str) and _KEY_RE.fullmatch(key)):
            raise SpecError(f"spec.warmUp.manifest.configMapRef.key {key!r} is not a ConfigMap key")
        if paths:
            raise SpecError("spec.warmUp: paths and manifest do not go together (prefetch takes one or the other)")
    target = _mapping(warm, "target", "spec.warmUp.")
    tier = target.get("tier", TIER_CLUSTER)
    if tier not in (TIER_CLUSTER, TIER_NODE):
        raise SpecError(f"spec.warmUp.target.tier must be {TIER_CLUSTER} or {TIER_NODE}, got {tier!r}")
    selector = dict(_mapping(target, "nodeSelector", "spec.warmUp.target."))
    for k, v in selector.items():
        if not (isinstance(k, str) and _LABEL_KEY_RE.fullmatch(k) and isinstance(v, str) and _LABEL_VALUE_RE.fullmatch(v)):
            raise SpecError(f"spec.warmUp.target.nodeSelector: {k!r}: {v!r} is not a label key and value")
    if tier == TIER_CLUSTER and not has_cluster_tier:
        raise SpecError("spec.warmUp.target.tier Cluster needs spec.clusterTier (or warm the nodes: tier Node)")
    if tier == TIER_CLUSTER and selector:
        raise SpecError("spec.warmUp.target.nodeSelector applies to tier Node only")
    pin = warm.get("pin", False)
    if not isinstance(pin, bool):
        raise SpecError("spec.warmUp.pin must be true or false")
    if pin and tier != TIER_NODE:
        raise SpecError("spec.warmUp.pin applies to tier Node only: the cluster tier has no pins")
    schedule = _mapping(warm, "schedule", "spec.warmUp.")
    policy = schedule.get("policy", POLICY_ONCE)
    cron = None
    if policy == POLICY_CRON:
        text = schedule.get("cron")
        if not isinstance(text, str) or not text.strip():
            raise SpecError("spec.warmUp.schedule.cron is required with policy Cron (e.g. '0 3 * * *')")
        zone = schedule.get("timeZone")
        if zone is not None and not (isinstance(zone, str) and zone):
            raise SpecError("spec.warmUp.schedule.timeZone must be an IANA time zone name (e.g. Europe/Paris)")
        try:
            cron = parse_cron(text, zone)
        except CronError as exc:
            raise SpecError(f"spec.warmUp.schedule: {exc}") from None
    elif policy != POLICY_ONCE:
        raise SpecError(f"spec.warmUp.schedule.policy must be {POLICY_ONCE} or {POLICY_CRON}, got {policy!r}")
    elif schedule.get("cron") or schedule.get("timeZone"):
        raise SpecError(f"spec.warmUp.schedule.{'cron' if schedule.get('cron') else 'timeZone'} needs policy Cron")
    parallel = warm.get("parallel")
    return WarmUpSettings(
        paths=paths, manifest_config_map=config_map, manifest_key=key or "manifest", tier=tier,
        node_selector=selector, policy=policy, cron=cron, pin=pin,
        parallel=_int(parallel, "spec.warmUp.parallel", 1, 1024) if parallel is not None else None,
        active_deadline_s=_int(warm.get("activeDeadlineSeconds", DEFAULT_ACTIVE_DEADLINE_S),
                               "spec.warmUp.activeDeadlineSeconds", 60, 604800),
    )
