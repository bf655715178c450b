"""What a Grafana user gets from the committed dashboard JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tandem.worker import metrics as m

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "tandem" / "dashboards"


def load(uid: str) -> dict[str, Any]:
    board: dict[str, Any] = json.loads((DASHBOARDS / f"{uid}.json").read_text())
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(board) for t in p["targets"]]


def panel_by_title(board: dict[str, Any], fragment: str) -> dict[str, Any]:
    found = [p for p in panels(board) if fragment.lower() in p["title"].lower()]
    assert len(found) == 1, f"expected one panel titled like {fragment!r}, got {[p['title'] for p in found]}"
    return found[0]


@pytest.mark.parametrize("uid", ["tandem-overview", "tandem-operator"])
def test_dashboard_basics(uid: str) -> None:
    board = load(uid)
    assert board["uid"] == uid and board["title"].startswith("Tandem / ")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["namespace"]["type"] == "query"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], (panel["title"], target["expr"])


def test_overview_has_namespace_and_model_variables_and_every_required_panel() -> None:
    board = load("tandem-overview")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert "label_values(tandem_worker_ready" in variables["model"]["query"]
    assert variables["model"]["query"].endswith(", model)")

    def uses(fragment: str, metric: m.MetricDef) -> str:
        panel = panel_by_title(board, fragment)
        text = " ".join(t["expr"] for t in panel["targets"])
        assert metric.name in text, f"{panel['title']} does not read {metric.name}"
        return text

    uses("request rate", m.REQUESTS)
    for title, metric in (("time to first token", m.TTFT), ("inter-token", m.ITL)):
        text = uses(title, metric)
        assert "histogram_quantile(0.5, sum by (le, role)" in text
        assert "histogram_quantile(0.99, sum by (le, role)" in text
    uses("queue depth", m.PREFILL_QUEUE_REQUESTS)
    uses("kv-cache usage", m.KV_USAGE_RATIO)
    replicas = panel_by_title(board, "replicas")
    legends = {t["legendFormat"] for t in replicas["targets"]}
    assert legends == {"desired {{pool}}", "current {{pool}}", "ready {{pool}}"}
    uses("transfer throughput", m.KV_TRANSFER_BYTES)
    assert panel_by_title(board, "transfer throughput")["fieldConfig"]["defaults"]["unit"] == "Bps"
    uses("failures", m.KV_TRANSFER_FAILURES)
    hit = uses("hit rate", m.PREFIX_CACHE_HITS)
    assert m.PREFIX_CACHE_QUERIES.name in hit


def test_operator_dashboard_shows_errors_scale_events_and_signals_against_targets() -> None:
    board = load("tandem-operator")
    text = " ".join(exprs(board))
    for metric in (m.RECONCILE_ERRORS, m.AUTOSCALER_SCALE_EVENTS, m.AUTOSCALER_DESIRED, m.AUTOSCALER_CURRENT):
        assert metric.name in text
    for pool in ("Prefill", "Decode"):
        panel = panel_by_title(board, f"{pool}:")
        names = [t["expr"] for t in panel["targets"]]
        assert any(m.AUTOSCALER_SIGNAL.name in e for e in names)
        assert any(m.AUTOSCALER_TARGET.name in e for e in names)
        assert all(f'pool="{pool.lower()}"' in e for e in names)


def test_every_metric_name_in_dashboards_and_rules_exists() -> None:
    """Typos in metric names would draw empty panels: every tandem_* token must be defined."""
    known = set()
    for metric in (*m.ALL_WORKER_METRICS, *m.ROUTER_ONLY_METRICS, *m.ALL_OPERATOR_METRICS):
        exposed = m.exposed_name(metric)
        known |= {exposed} if metric.kind != "histogram" else {f"{metric.name}_{s}" for s in ("bucket", "count", "sum")}
    texts = [p.read_text() for p in DASHBOARDS.glob("*.json")]
    texts.append((DASHBOARDS.parent / "files" / "tandem-rules.yaml").read_text())
    tokens = {t for text in texts for t in re.findall(r"\btandem_[a-z0-9_]+\b", text)}
    tokens -= {"tandem_dev_model"}  # the target label holding the DisaggregatedModel name
    assert tokens, "found no metric names at all"
    unknown = sorted(tokens - known)
    assert not unknown, f"undefined metric names: {unknown}"
