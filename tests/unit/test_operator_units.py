"""The Dataset operator's pure parts: the spec parser, the cron schedule, names, the progress reader."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from csi_driver.operator import manifests as m
from csi_driver.operator.cron import CronError, parse_cron
from csi_driver.operator.spec import TIER_NODE, SpecError, parse_spec

UTC = dt.timezone.utc
BASE = {"source": "s3://bucket/data", "warmUp": {"target": {"tier": "Node"}}}


def spec(**changes) -> dict:
    out = {**BASE}
    out.update(changes)
    return out


# ------------------------------------------------------------------------------------------ spec
def test_a_minimal_node_spec_and_its_volume_attributes() -> None:
    settings = parse_spec(spec(cache={"ramCache": "1GiB", "maxFetches": 32, "attrTtl": 60}, region="eu-west-1"))
    assert settings.volume_attributes == {"source": "s3://bucket/data", "readOnly": "true", "region": "eu-west-1",
                                          "ramCache": "1GiB", "maxFetches": "32", "attrTtl": "60"}
    assert settings.warm_up.tier == TIER_NODE and settings.warm_up.paths == () and settings.gate_timeout_s == 3600


def test_paths_are_normalised_and_dot_means_everything() -> None:
    assert parse_spec(spec(warmUp={"paths": ["a/./b/", "c//d"], "target": {"tier": "Node"}})).warm_up.paths == \
        ("a/b", "c/d")
    assert parse_spec(spec(warmUp={"paths": [".", "x"], "target": {"tier": "Node"}})).warm_up.paths == ()


@pytest.mark.parametrize("changes, message", [
    ({"source": ""}, "spec.source is required"),
    ({"source": "s3://b/x", "cache": {"clusterCache": "s3://cluster-store/"}}, "goes in spec.clusterTier"),
    ({"warmUp": {"paths": ["/etc"], "target": {"tier": "Node"}}}, "must be relative"),
    ({"warmUp": {"paths": ["a/../../b"], "target": {"tier": "Node"}}}, "leads outside the dataset"),
    ({"warmUp": {"paths": ["a"], "manifest": {"configMapRef": {"name": "m"}}, "target": {"tier": "Node"}}},
     "paths and manifest do not go together"),
    ({"warmUp": {"target": {"tier": "Cluster"}}, "clusterTier": {"cache": "s3://cluster-store/"}, "region": "EU"},
     "not an AWS region"),
    ({"warmUp": {"target": {"tier": "Cluster", "nodeSelector": {"a": "b"}}}, "clusterTier": {"cache": "s3://cluster-store/"}},
     "applies to tier Node only"),
    ({"warmUp": {"target": {"tier": "Cluster"}, "pin": True}, "clusterTier": {"cache": "s3://cluster-store/"}},
     "the cluster tier has no pins"),
    ({"warmUp": {"target": {"tier": "Node"}, "schedule": {"policy": "Cron"}}}, "cron is required"),
    ({"warmUp": {"target": {"tier": "Node"}, "schedule": {"cron": "* * * * *"}}}, "needs policy Cron"),
    ({"warmUp": {"target": {"tier": "Node", "nodeSelector": {"bad key!": "x"}}}}, "not a label key"),
    ({"gate": {"timeoutSeconds": 10**9}}, "spec.gate.timeoutSeconds must be a whole number"),
    ({"cache": {"ramCache": "lots"}}, "'cache.ramCache'"),
    ({"clusterTier": {"cache": "s3://cluster-store/", "timeout": 0}, "warmUp": {"target": {"tier": "Cluster"}}}, "--cluster-timeout 0 must be more than 0"),
    ({"secretRef": {"name": "Not_A_Name"}}, "is not a Secret name"),
    # Refused by the CRD's schema before the operator sees them (tests/csi/test_operator.py); the
    # operator checks them too, for a cluster with an older or edited CRD.
    ({"source": "file:///etc"}, "must be an s3:// URL"),
    ({"endpointUrl": "http://user:pw@host"}, "must not contain user info"),
])
def test_bad_specs_are_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec(**changes))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_secret_in_an_endpoint_url_is_never_quoted() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec(endpointUrl="https://AKIAXXXX:topsecret@s3.example.com"))
    assert "topsecret" not in str(caught.value) and "AKIA" not in str(caught.value)


# ------------------------------------------------------------------------------------------- cron
def test_cron_reads_names_ranges_and_steps_as_cron_does() -> None:
    """croniter (issue 26): month and day names, ranges of names, steps, 7 as Sunday."""
    weekdays = parse_cron("0 9 * * mon-fri")
    monday, saturday = dt.datetime(2026, 3, 2, 9, 0, tzinfo=UTC), dt.datetime(2026, 3, 7, 9, 0, tzinfo=UTC)
    assert weekdays.matches(monday) and not weekdays.matches(saturday)
    assert weekdays.next_after(dt.datetime(2026, 3, 6, 9, 0, tzinfo=UTC)) == dt.datetime(2026, 3, 9, 9, 0, tzinfo=UTC)
    quarter = parse_cron("*/15 3,4 1-7 * *")
    assert [quarter.matches(dt.datetime(2026, 3, 2, 3, m, tzinfo=UTC)) for m in (0, 15, 20, 45)] == [True, True, False, True]
    assert parse_cron("0 0 * jan,jul *").matches(dt.datetime(2026, 7, 1, tzinfo=UTC))
    assert parse_cron("0 0 * * 7").matches(dt.datetime(2026, 3, 1, tzinfo=UTC))  # 7 is Sunday too
    assert parse_cron("10-50/20 * * * *").next_after(dt.datetime(2026, 3, 1, 0, 31, tzinfo=UTC)).minute == 50


def test_cron_in_a_time_zone_follows_its_wall_clock() -> None:
    paris = parse_cron("0 3 * * *", "Europe/Paris")
    # 03:00 in Paris is 02:00 UTC in winter and 01:00 UTC in summer.
    assert paris.matches(dt.datetime(2026, 1, 15, 2, 0, tzinfo=UTC))
    assert paris.matches(dt.datetime(2026, 7, 15, 1, 0, tzinfo=UTC))
    assert not paris.due(dt.datetime(2026, 7, 15, 0, 0, tzinfo=UTC), dt.datetime(2026, 7, 15, 0, 59, tzinfo=UTC))
    assert paris.due(dt.datetime(2026, 7, 15, 0, 0, tzinfo=UTC), dt.datetime(2026, 7, 15, 1, 0, tzinfo=UTC))
    settings = parse_spec({"source": "s3://bucket/p", "warmUp": {"target": {"tier": "Node"}, "schedule": {
        "policy": "Cron", "cron": "0 3 * * *", "timeZone": "Europe/Paris"}}})
    assert settings.warm_up.cron == paris


@pytest.mark.parametrize(("text", "zone", "message"), [
    ("* * * *", None, "must have five fields"),
    ("0 0 * * * 2026", None, "must have five fields"),
    ("60 * * * *", None, "'60 * * * *' is not valid"),
    ("* 24 * * *", None, "is not valid"),
    ("*/0 * * * *", None, "is not valid"),
    ("0 0 * * funday", None, "is not valid"),
    ("0 0 31 2 *", None, "never fires"),
    ("@daily", None, "must have five fields"),
    ("0 3 * * *", "Mars/Olympus", "'Mars/Olympus' is not an IANA time zone name"),
])
def test_bad_cron_is_refused_with_one_line(text: str, zone: str | None, message: str) -> None:
    with pytest.raises(CronError) as err:
        parse_cron(text, zone)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cron_due() -> None:
    daily = parse_cron("0 3 * * *")
    last = dt.datetime(2026, 3, 1, 3, 0, 10, tzinfo=UTC)
    assert not daily.due(last, dt.datetime(2026, 3, 2, 2, 59, tzinfo=UTC))
    assert daily.due(last, dt.datetime(2026, 3, 2, 3, 0, tzinfo=UTC))
    assert not daily.due(last, last + dt.timedelta(seconds=40))  # the minute it started in is not counted again
    # Vixie cron: with both day fields restricted, either matches (the 13th, or any Friday).
    odd = parse_cron("0 0 13 * 5")
    assert odd.matches(dt.datetime(2026, 3, 13, 0, 0, tzinfo=UTC)) and odd.matches(dt.datetime(2026, 3, 6, tzinfo=UTC))
    assert not odd.matches(dt.datetime(2026, 3, 7, tzinfo=UTC))


@given(st.integers(0, 59), st.integers(0, 23), st.datetimes(min_value=dt.datetime(2020, 1, 1),
                                                            max_value=dt.datetime(2030, 1, 1)))
def test_a_daily_schedule_is_due_within_a_day_and_not_before_its_minute(minute: int, hour: int,
                                                                         start: dt.datetime) -> None:
    cron = parse_cron(f"{minute} {hour} * * *")
    since = start.replace(tzinfo=UTC)
    fire = since.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if fire <= since:
        fire += dt.timedelta(days=1)
    assert cron.due(since, fire)
    assert not cron.due(since, fire - dt.timedelta(seconds=1)) or fire - dt.timedelta(seconds=1) < since


# -------------------------------------------------------------------------------- names, progress
def test_names_fit_kubernetes_limits() -> None:
    long = "d" * 253
    assert len(m.pv_name("n" * 63, long)) <= 253
    assert len(m.job_name(long, 12345, node="node-" + "x" * 200)) <= 63
    assert m.job_name(long, 1) != m.job_name(long, 2)
    assert m.job_name("ds", 1, node="a") != m.job_name("ds", 1, node="b")
    assert m.pv_name("ml", long) != m.pv_name("ml", long[:-1] + "e")
    assert m.pv_name("team-a", "data") != m.pv_name("team", "a-data")  # issue 34


def test_last_document_skips_cut_and_foreign_lines() -> None:
    log = '{"bytes_total": 10, "bytes_cached": 5}\n{"bytes_total": 10, "bytes_cach'
    assert m.last_document(log) == {"bytes_total": 10, "bytes_cached": 5}
    assert m.last_document("cachefs: error: no such mount\n") is None
    assert m.last_document('{"bytes_total": 1}\ncachefs: failed: x\n') == {"bytes_total": 1}


def test_totals_report_the_least_cached_target() -> None:
    tiers = [m.tier_entry("j1", "a", "Succeeded", {"bytes_total": 100, "bytes_cached": 100}, TIER_NODE),
             m.tier_entry("j2", "b", "Running", {"bytes_total": 100, "bytes_cached": 25}, TIER_NODE),
             m.tier_entry("j3", "c", "Pending", None, TIER_NODE)]
    assert m.totals(tiers) == {"totalBytes": 100, "cachedBytes": 25, "cachedPercent": 25.0, "cached": "25.0%",
                               "size": "100 B"}
    assert m.totals([]) == {}
    assert m.format_size(3 * 2**30) == "3.0 GiB"


def test_a_manifest_warm_up_mounts_its_config_map_and_passes_the_file() -> None:
    settings = parse_spec(spec(warmUp={"manifest": {"configMapRef": {"name": "train-v3", "key": "train.jsonl"}},
                                       "target": {"tier": "Node"}, "parallel": 8}))
    body = {"metadata": {"name": "ds", "namespace": "ml", "uid": "u1"}}
    job = m.warm_up_job(body, settings, run=3, image="img:1", node="n1")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["cachefs", "prefetch", "/data", "--manifest", f"{m.MANIFEST_DIR}/train.jsonl",
                                    "--parallel", "8", "--json-progress"]
    assert {"name": "manifest", "configMap": {"name": "train-v3"}} in pod["volumes"]
    assert {"name": "manifest", "mountPath": m.MANIFEST_DIR, "readOnly": True} in container["volumeMounts"]
    assert pod["automountServiceAccountToken"] is False
    assert m.DATASET_LABEL not in job["metadata"]["labels"]  # warm-up pods are never gated
