"""The Grafana dashboard (deploy/dashboards/cachefs.json) asks only for series cachefs exports (issue 26).

Every PromQL expression of every panel, and the metric of every ``label_values`` variable, is parsed
by a real PromQL parser (promql-parser, the Rust parser Prometheus-compatible tools use), after
Grafana's own interval variables are put in as Grafana does; each metric name a selector uses must
be one the daemon (``cachefs.daemon.metrics``) or the CSI node plugin (``csi_driver.metrics``) names
in its constants, so a renamed metric fails here instead of leaving an empty panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import promql_parser
import pytest

from cachefs.daemon import metrics as daemon_metrics
from csi_driver import metrics as csi_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "dashboards" / "cachefs.json"
# Grafana's built-in interval variables, as it substitutes them before sending a query.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "6h"}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def exported() -> set[str]:
    names: set[str] = set()
    for module in (daemon_metrics, csi_metrics):
        names |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.startswith("cachefs_")}
    histograms = {daemon_metrics.STORE_REQUEST_DURATION_SECONDS}
    return names | {h + s for h in histograms for s in HISTOGRAM_SUFFIXES}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def selectors(node: Any) -> Iterator[str]:
    """The metric names of every vector selector in a parsed expression."""
    if type(node).__name__ == "VectorSelector":
        yield node.name
        return
    for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None and type(child).__module__.startswith("promql_parser"):
            yield from selectors(child)
    for arg in getattr(node, "args", None) or []:
        yield from selectors(arg)


def parse(expr: str) -> Any:
    for variable, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def test_every_expression_parses_and_names_an_exported_series() -> None:
    doc, known = dashboard(), exported()
    seen: set[str] = set()
    for title, expr in expressions(doc):
        names = set(selectors(parse(expr)))
        assert names, f"panel {title!r}: no series in {expr!r}"
        assert names <= known, f"panel {title!r} asks for series cachefs does not export: {sorted(names - known)}"
        seen |= names
    for variable in doc["templating"]["list"]:
        query = variable.get("definition")
        if query:
            match = re.fullmatch(r"label_values\((\w+), *(\w+)\)", query)
            assert match and match.group(1) in known, f"variable {variable['name']}: {query!r}"
    # What the issue asks the dashboard to show.
    for name in (daemon_metrics.VOLUME_SERVED_BYTES_TOTAL, daemon_metrics.VOLUME_AVOIDED_SOURCE_BYTES_TOTAL,
                 daemon_metrics.VOLUME_AVOIDED_SOURCE_REQUESTS_TOTAL, daemon_metrics.DIRTY_BYTES,
                 daemon_metrics.OLDEST_DIRTY_AGE_SECONDS, daemon_metrics.STORE_REACHABLE, daemon_metrics.TIER_STATE,
                 csi_metrics.MOUNTS):
        assert name in seen, f"the dashboard shows nothing of {name}"


def test_the_check_catches_a_series_nobody_exports() -> None:
    assert set(selectors(parse("sum(rate(cachefs_no_such_thing_total[$__rate_interval]))"))) == {
        "cachefs_no_such_thing_total"}
    assert "cachefs_no_such_thing_total" not in exported()
    with pytest.raises(ValueError):
        parse("sum(rate(cachefs_dirty_bytes))")  # rate of an instant vector: refused, as Prometheus does


def test_panels_have_ids_titles_and_fit_the_grid() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["title"] and 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
