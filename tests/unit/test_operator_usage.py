"""Adding up what a Dataset saved (csi_driver.operator.usage): growth per mount pod, resets, pods
that cannot be read or are gone, savings and the cost estimate (issue 26)."""

from __future__ import annotations

import pytest

from csi_driver.operator import usage as u
from csi_driver.operator.spec import SpecError, parse_spec
from csi_driver.operator.manifests import format_size

MiB = 1 << 20
A = u.MountPod(uid="uid-a", name="cachefs-mount-a", node="node-a", address="10.0.0.1:9750")
B = u.MountPod(uid="uid-b", name="cachefs-mount-b", node="node-b", address="10.0.0.2:9750")
NO_PRICES = u.Prices()


def counted(ram: int = 0, disk: int = 0, cluster: int = 0, source: int = 0, reads: int = 1) -> dict[str, int]:
    """Counters of one daemon: bytes per place, ``reads`` block requests per place that served bytes."""
    out = dict.fromkeys(u.COUNTERS, 0)
    for place, n in (("ram", ram), ("disk", disk), ("cluster", cluster), ("source", source)):
        out[f"{place}Bytes"] = n
        out[f"{place}Reads"] = reads if n else 0
    out["sourceReadBytes"] = source
    return out


def test_a_stats_document_gives_the_counters() -> None:
    doc = {"traffic": {"served_bytes": {"ram": 1, "disk": 2, "cluster": 3, "source": 4},
                       "served_blocks": {"ram": 5, "disk": 6, "cluster": 7, "source": 8},
                       "source": {"requests": 9, "read_requests": 8, "read_bytes": 10, "upload_requests": 0,
                                  "uploaded_bytes": 0},
                       "cluster_store": {"requests": 11, "read_bytes": 12, "upload_requests": 13,
                                         "uploaded_bytes": 14}}}
    got = u.counters(doc)
    assert got is not None
    assert (got["ramBytes"], got["sourceReads"], got["sourceRequests"], got["clusterStoreUploadedBytes"]) == (1, 8, 9, 14)
    assert u.counters({"tiers": {}}) is None  # an older daemon: no traffic section


def test_growth_is_added_per_pod_and_a_reset_adds_the_new_value() -> None:
    first = u.accumulate(None, [A, B], {"uid-a": counted(source=10 * MiB), "uid-b": counted(cluster=4 * MiB)},
                         NO_PRICES, "t1")
    assert first["totals"]["sourceBytes"] == 10 * MiB and first["totals"]["clusterBytes"] == 4 * MiB
    assert first["sourceBytesAvoided"] == 4 * MiB and first["sourceRequestsAvoided"] == 1
    # a grew by 6 MiB from RAM; b's daemon restarted (counters went down): its new 1 MiB is added whole.
    second = u.accumulate(first, [A, B], {"uid-a": counted(ram=6 * MiB, source=10 * MiB),
                                          "uid-b": counted(cluster=1 * MiB)}, NO_PRICES, "t2")
    assert second["totals"]["ramBytes"] == 6 * MiB and second["totals"]["sourceBytes"] == 10 * MiB
    assert second["totals"]["clusterBytes"] == 5 * MiB
    assert second["readBytes"] == 21 * MiB and second["sourceBytesAvoided"] == 11 * MiB
    assert second["localHitRatio"] == round(6 / 21, 6) and second["clusterHitRatio"] == round(5 / 21, 6)
    assert "estimatedCostAvoided" not in second
    assert [d["uid"] for d in second["daemons"]] == ["uid-a", "uid-b"] and second["unreachable"] == 0


def test_an_unreadable_pod_keeps_its_last_counters_and_a_gone_pod_keeps_its_totals() -> None:
    first = u.accumulate(None, [A, B], {"uid-a": counted(source=MiB), "uid-b": counted(disk=2 * MiB)},
                         NO_PRICES, "t1")
    dark = u.accumulate(first, [A, B], {"uid-a": counted(source=MiB), "uid-b": None}, NO_PRICES, "t2")
    assert dark["unreachable"] == 1 and dark["totals"] == first["totals"]
    assert [d for d in dark["daemons"] if d["uid"] == "uid-b"][0]["diskBytes"] == 2 * MiB
    back = u.accumulate(dark, [A, B], {"uid-a": counted(source=MiB), "uid-b": counted(disk=3 * MiB)}, NO_PRICES, "t3")
    assert back["totals"]["diskBytes"] == 3 * MiB  # only b's growth since it was last read
    gone = u.accumulate(back, [A], {"uid-a": counted(source=MiB)}, NO_PRICES, "t4")  # b's node and pod are gone
    assert gone["totals"] == back["totals"] and [d["uid"] for d in gone["daemons"]] == ["uid-a"]
    # A new mount pod on b's node: everything it counted is new.
    c = u.MountPod(uid="uid-c", name="cachefs-mount-b", node="node-b", address="10.0.0.3:9750")
    again = u.accumulate(gone, [A, c], {"uid-a": counted(source=MiB), "uid-c": counted(disk=MiB)}, NO_PRICES, "t5")
    assert again["totals"]["diskBytes"] == 4 * MiB


def test_the_cost_estimate_needs_a_price() -> None:
    prices = u.Prices(egress_per_gb=0.09, requests_per_thousand=0.4)
    got = u.accumulate(None, [A], {"uid-a": counted(ram=2 << 30, source=1 << 30, reads=1000)}, prices, "t")
    assert got["estimatedCostAvoided"] == {"amount": round(2 * 0.09 + 1000 / 1000 * 0.4, 6), "currency": "USD"}
    assert u.display(got, format_size) == {"hitRatio": "66.7%", "saved": "2.0 GiB"}
    assert u.display({}, format_size) == {"hitRatio": "-", "saved": "0 B"}


def test_a_mount_pod_is_read_at_its_ip_and_stats_port() -> None:
    pod = {"metadata": {"uid": "x", "name": "p"}, "spec": {"nodeName": "n", "containers": [
        {"ports": [{"name": "stats", "containerPort": 9123}]}]}, "status": {"phase": "Running", "podIP": "10.1.2.3"}}
    assert u.mount_pod(pod) == u.MountPod("x", "p", "n", "10.1.2.3:9123")
    assert u.mount_pod({**pod, "status": {"phase": "Pending"}}).address is None
    calls: list[str] = []
    got = u.collect([A, u.MountPod("y", "q", "n", None)], lambda addr: calls.append(addr) or {"traffic": {}})
    assert calls == ["10.0.0.1:9750"] and got["y"] is None and got["uid-a"] == dict.fromkeys(u.COUNTERS, 0)


def test_dataset_prices_override_the_operators() -> None:
    settings = parse_spec({"source": "s3://bucket/x", "warmUp": {"target": {"tier": "Node"}},
                           "pricing": {"egressPerGB": 0.05, "currency": "EUR"}})
    assert settings.prices(u.Prices(egress_per_gb=0.09, requests_per_thousand=0.4)) == u.Prices(0.05, 0.4, "EUR")
    assert not parse_spec({"source": "s3://bucket/x", "warmUp": {"target": {"tier": "Node"}}}).prices(NO_PRICES).set


@pytest.mark.parametrize(("pricing", "message"), [
    ({"egressPerGB": -1}, "spec.pricing.egressPerGB must be a price from 0 to 1000, got -1"),
    ({"requestsPerThousand": "cheap"}, "spec.pricing.requestsPerThousand must be a price"),
    ({"currency": "dollars"}, "spec.pricing.currency 'dollars' must be a currency code"),
    ({"egress": 1}, "spec.pricing: unknown key 'egress'"),
])
def test_bad_prices_are_refused_with_one_line(pricing: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"source": "s3://bucket/x", "warmUp": {"target": {"tier": "Node"}}, "pricing": pricing})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_status_field_written_is_declared_in_the_crd() -> None:
    """A real API server prunes status fields its CRD does not declare: every one the usage timer
    writes is declared, with a type."""
    from pathlib import Path

    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "components" / "datasets"
                          / "crd.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    usage = u.accumulate(None, [A], {"uid-a": counted(ram=MiB, source=MiB)}, u.Prices(0.09, 0.4), "2026-01-01T00:00:00Z")
    written = {"usage": usage, **u.display(usage, format_size)}

    def check(value: object, schema: dict, where: str) -> None:
        assert "type" in schema, f"{where}: no type"
        if isinstance(value, dict):
            assert schema["type"] == "object", where
            for key, item in value.items():
                assert key in schema.get("properties", {}), f"{where}.{key} is not declared: it would be pruned"
                check(item, schema["properties"][key], f"{where}.{key}")
        elif isinstance(value, list):
            assert schema["type"] == "array", where
            for item in value:
                check(item, schema["items"], f"{where}[]")
        else:
            expected = {str: "string", bool: "boolean", int: "integer", float: "number"}[type(value)]
            assert schema["type"] == expected or (schema["type"] == "number" and expected == "integer"), where

    check(written, status, "status")


def test_operator_flags_set_the_default_prices() -> None:
    from csi_driver.operator.main import build_parser

    args = build_parser().parse_args(["--egress-price-per-gb", "0.09", "--request-price-per-thousand", "0.4",
                                      "--currency", "EUR", "--usage-interval", "60", "--mount-namespace", "csi"])
    assert (args.egress_price_per_gb, args.request_price_per_thousand, args.currency) == (0.09, 0.4, "EUR")
    assert (args.usage_interval, args.mount_namespace) == (60.0, "csi")
    assert build_parser().parse_args([]).egress_price_per_gb is None  # no price: no estimate
    for bad in (["--egress-price-per-gb", "-1"], ["--currency", "euro"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_a_stopping_usage_tick_reads_no_more_pods_and_writes_nothing() -> None:
    """The usage timer runs in a thread kopf waits for at the operator's stop: once its ``stopped`` flag
    is set it starts no further /stats read and writes nothing (the counters only grow: the next
    operator's first collection adds the same)."""
    from types import SimpleNamespace
    from typing import Any, cast

    from csi_driver.operator.handlers import OperatorSettings, OperatorState, collect_usage
    from csi_driver.operator.kube import Kube

    running = {"metadata": {"uid": "uid-a", "name": "cachefs-mount-a"}, "spec": {"nodeName": "node-a"},
               "status": {"phase": "Running", "podIP": "10.0.0.1"}}
    reads: list[str] = []
    stopping = {"now": False}

    class MountPods:  # the one call the usage tick makes
        def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
            return [running]

    def read(address: str) -> dict[str, Any]:
        reads.append(address)
        return {"traffic": {"served_bytes": {"source": MiB}}}

    state = OperatorState(kube=cast(Kube, MountPods()), settings=OperatorSettings(read_stats=read))
    body = {"metadata": {"namespace": "ml", "name": "ds"},
            "spec": {"source": "s3://bucket/x", "warmUp": {"target": {"tier": "Node"}}}}

    stopped = SimpleNamespace(status={})
    stopping["now"] = True
    collect_usage(body, {"volumeName": "cachefs-ml.ds"}, stopped, state, lambda: stopping["now"])
    assert reads == [] and stopped.status == {}
    assert u.collect([A, B], read, lambda: True) == {"uid-a": None, "uid-b": None} and reads == []

    running_tick = SimpleNamespace(status={})
    stopping["now"] = False
    collect_usage(body, {"volumeName": "cachefs-ml.ds"}, running_tick, state, lambda: stopping["now"])
    assert reads == ["10.0.0.1:9750"] and running_tick.status["usage"]["totals"]["sourceBytes"] == MiB
