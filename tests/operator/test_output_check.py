"""The OutputVerified condition: the canary query's text, result -> counts -> condition, and the status write."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator import autoscaler_run, output_check
from tandem.operator import signals as sig
from tandem.operator.conditions import ConditionValue, merge_conditions
from tandem.worker import metrics as m


def sample(result: str, value: str) -> dict[str, Any]:
    return {"metric": {"result": result}, "value": [1_764_400_000.0, value]}


def test_query_selects_the_resource_like_the_autoscaler_signals() -> None:
    q = output_check.canary_query("team-a", "tiny")
    assert q == ('sum by (result) (increase(tandem_router_canary_probes_total'
                 '{namespace="team-a",tandem_dev_model="tiny"}[30m]))')
    assert sig.Selector("team-a", "tiny", "prefill").matchers(with_pool=False) in q


def test_query_window_and_threshold_are_the_alerts() -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "hack" / "monitoring_config.py"
    spec = importlib.util.spec_from_file_location("_tandem_monitoring_config", path)
    assert spec is not None and spec.loader is not None
    cfg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = cfg  # dataclasses look their module up there
    try:
        spec.loader.exec_module(cfg)
    finally:
        del sys.modules[spec.name]
    assert (cfg.CANARY_WINDOW, cfg.CANARY_MISMATCHES) == (output_check.WINDOW, output_check.THRESHOLD)
    assert f"[{output_check.WINDOW}]" in output_check.canary_query("ns", "dm")


def test_query_escapes_and_refuses_empty_selectors() -> None:
    assert 'tandem_dev_model="a\\"b"' in output_check.canary_query("ns", 'a"b')
    with pytest.raises(sig.SignalsError):
        output_check.canary_query("", "tiny")
    with pytest.raises(sig.SignalsError):
        output_check.canary_query("ns", "tiny", window="30 minutes")


@pytest.mark.parametrize(("counts", "status", "reason", "words"), [
    (output_check.CanaryCounts(match=29, error=1), "True", "CanaryMatched", ["29 canary probes", "30m", "error 1"]),
    (output_check.CanaryCounts(match=27, mismatch=3), "False", "CanaryMismatch", ["3 canary probes", "matched 27"]),
    (output_check.CanaryCounts(mismatch=2.0), "False", "CanaryMismatch", ["2 canary probes"]),
    (output_check.CanaryCounts(match=28, mismatch=1), "Unknown", "CanaryMismatchUnconfirmed",
     ["1 canary mismatch", "fewer than 2"]),
    (output_check.CanaryCounts(skipped=30), "Unknown", "NoCanaryProbes", ["skipped 30", "--canary-interval 0"]),
    (output_check.CanaryCounts(), "Unknown", "NoCanaryProbes", ["no canary probe compared"]),
])
def test_counts_to_condition(counts: output_check.CanaryCounts, status: str, reason: str, words: list[str]) -> None:
    cond = output_check.output_condition(counts)
    assert (cond.type, cond.status, cond.reason) == ("OutputVerified", status, reason), cond
    for word in words:
        assert word in cond.message, cond.message


def test_increase_extrapolation_is_shown_readably() -> None:
    cond = output_check.output_condition(output_check.CanaryCounts(match=29.6, mismatch=2.03))
    assert cond.message.startswith("2 canary probes") and "matched 29.6" in cond.message, cond.message


def test_result_parsing() -> None:
    counts, why = output_check.counts_from_result([sample("match", "12"), sample("mismatch", "0"),
                                                   sample("skipped", "1"), sample("error", "0")])
    assert (counts, why) == (output_check.CanaryCounts(match=12, skipped=1), None)
    assert output_check.counts_from_result([]) == (None, "no canary series for this resource (no router scraped yet)")
    counts, why = output_check.counts_from_result([sample("match", "NaN")])
    assert counts is None and why is not None and "nan" in why
    counts, why = output_check.counts_from_result([{"metric": {"result": "match"}}])
    assert counts is None and why is not None and "malformed" in why


class Source:
    def __init__(self, result: list[dict[str, Any]] | Exception) -> None:
        self.result = result
        self.url = "http://prom:9090"
        self.queries: list[str] = []

    def query(self, promql: str) -> list[dict[str, Any]]:
        self.queries.append(promql)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_read_never_raises_and_says_why() -> None:
    cond = output_check.read_output_condition(sig.NoSignals(), "ns", "tiny")
    assert (cond.status, cond.reason) == ("Unknown", "MetricsUnavailable")
    assert "no Prometheus URL configured" in cond.message
    cond = output_check.read_output_condition(Source(ConnectionError("refused")), "ns", "tiny")
    assert (cond.status, cond.reason) == ("Unknown", "MetricsUnavailable")
    assert "Prometheus at http://prom:9090 failed: ConnectionError: refused" in cond.message
    cond = output_check.read_output_condition(Source([]), "ns", "tiny")
    assert (cond.status, cond.reason) == ("Unknown", "NoCanaryProbes")
    cond = output_check.read_output_condition(Source([sample("match", "oops")]), "ns", "tiny")
    assert (cond.status, cond.reason) == ("Unknown", "MetricsUnavailable")
    source = Source([sample("match", "4"), sample("mismatch", "0")])
    assert output_check.read_output_condition(source, "ns", "tiny").status == "True"
    assert source.queries == [output_check.canary_query("ns", "tiny")]


def test_prometheus_signals_query_passes_through() -> None:
    class Client:
        def custom_query(self, query: str, params: dict[str, Any] | None = None,
                         timeout: int | None = None) -> list[dict[str, Any]]:
            return [sample("match", query)]

    assert sig.PrometheusSignals("http://p:9090", client=Client()).query("up") == [sample("match", "up")]


# --- the status write (autoscaler_run.verify_output) against a fake Kube --------------------------------------

class FakeKube:
    def __init__(self, conditions: list[dict[str, Any]], generation: int = 3) -> None:
        self.body: dict[str, Any] = {"metadata": {"name": "tiny", "namespace": "ns", "uid": "u",
                                                  "generation": generation},
                                     "status": {"conditions": conditions}}
        self.patches: list[dict[str, Any]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.body

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append(status)
        self.body["status"].update(status)


READY = {"type": "Ready", "status": "True", "reason": "AllPoolsReady", "message": "",
         "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 3}
LIMITED = {"type": "ScalingLimited", "status": "False", "reason": "DesiredWithinRange", "message": "",
           "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 3}


def verify(kube: FakeKube, result: list[dict[str, Any]], events: list[tuple[str, str, str]]) -> ConditionValue | None:
    def emit(body: Any, type_: str, reason: str, message: str) -> None:
        events.append((type_, reason, message))

    return autoscaler_run.verify_output(kube, "ns", "tiny", Source(result), emit)  # type: ignore[arg-type]


def test_verify_output_merges_keeps_others_and_writes_only_changes() -> None:
    kube = FakeKube([dict(READY), dict(LIMITED)])
    events: list[tuple[str, str, str]] = []
    assert verify(kube, [sample("match", "5"), sample("mismatch", "0")], events) is not None
    conds = {c["type"]: c for c in kube.body["status"]["conditions"]}
    assert conds["Ready"] == READY and conds["ScalingLimited"] == LIMITED
    verified = conds["OutputVerified"]
    assert (verified["status"], verified["reason"], verified["observedGeneration"]) == ("True", "CanaryMatched", 3)
    assert events == [] and len(kube.patches) == 1

    verify(kube, [sample("match", "5"), sample("mismatch", "0")], events)
    assert len(kube.patches) == 1  # nothing changed: no write

    stamp = verified["lastTransitionTime"] = "2025-02-02T00:00:00Z"
    verify(kube, [sample("match", "7"), sample("mismatch", "0")], events)  # new count, same status
    assert len(kube.patches) == 2
    again = {c["type"]: c for c in kube.body["status"]["conditions"]}["OutputVerified"]
    assert again["lastTransitionTime"] == stamp and again["message"].startswith("7 canary probes")

    verify(kube, [sample("match", "7"), sample("mismatch", "3")], events)
    bad = {c["type"]: c for c in kube.body["status"]["conditions"]}["OutputVerified"]
    assert (bad["status"], bad["reason"]) == ("False", "CanaryMismatch")
    assert bad["lastTransitionTime"] != stamp
    assert events == [("Warning", "CanaryMismatch", bad["message"])]

    verify(kube, [sample("match", "30"), sample("mismatch", "0")], events)
    assert events[-1][:2] == ("Normal", "OutputVerified")


def test_verify_output_skips_a_deleted_resource() -> None:
    kube = FakeKube([])
    kube.body["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert verify(kube, [sample("match", "1")], []) is None and kube.patches == []


def test_merge_puts_output_verified_beside_the_others() -> None:
    merged = merge_conditions([READY], [output_check.output_condition(None, "x")], "2025-03-03T00:00:00Z", 4)
    assert [c["type"] for c in merged] == ["OutputVerified", "Ready"]
    assert m.CANARY_MISMATCH_THRESHOLD == output_check.THRESHOLD
