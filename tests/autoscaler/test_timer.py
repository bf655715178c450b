"""The timer body: spec/status + signals + clock -> desired replicas, status, conditions, events."""

from __future__ import annotations

import math
import socket
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tandem.operator import autoscaler_timer as t
from tandem.operator import signals as sig
from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.autoscaling import PolicyError
from tandem.worker import metrics as m


class FixedSignals:
    """A SignalSource with set values per pool (the real PrometheusSignals is tested against
    real sockets in test_signals.py and against real Prometheus in test_prometheus_signals.py)."""

    def __init__(self, values: dict[str, dict[str, float]], problems: dict[str, dict[str, str]] | None = None):
        self.values, self.problems = values, problems or {}
        self.selectors: list[sig.Selector] = []

    def fetch(self, pool: str, sel: sig.Selector) -> sig.PoolSignals:
        self.selectors.append(sel)
        return sig.PoolSignals(dict(self.values.get(pool, {})), dict(self.problems.get(pool, {})))


def make_spec(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
              **extra: Any) -> DisaggregatedModelSpec:
    body: dict[str, Any] = {
        "model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}},
        "prefill": {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 16, "targetQueueDepth": 4,
                                                   **(prefill or {})}},
        "decode": {"replicas": 2, "autoscaling": {"enabled": True, "maxReplicas": 16, "targetKVUtilization": 0.5,
                                                  **(decode or {})}},
        "ratio": {"minPrefillPerDecode": 0.25, "maxPrefillPerDecode": 4},
        **extra,
    }
    return DisaggregatedModelSpec.model_validate(body)


STEADY = {"prefill": {sig.QUEUE_REQUESTS: 4.0, sig.QUEUE_TOKENS: 4000.0},
          "decode": {sig.KV_USAGE: 0.5}}
READY = {"prefill": t.PoolCounts(ready=2), "decode": t.PoolCounts(ready=2)}
T0 = 1_764_400_000.0


def tick(spec: DisaggregatedModelSpec, values: dict[str, dict[str, float]] = STEADY,
         status: dict[str, Any] | None = None, counts: dict[str, t.PoolCounts] = READY,
         state: dict[str, Any] | None = None, now: float = T0,
         source: sig.SignalSource | None = None) -> t.TickResult:
    return t.autoscale_tick(spec=spec, status=status, namespace="team-a", name="tiny", counts=counts,
                            signals=source or FixedSignals(values), clock=lambda: now, state=state)


def test_queue_above_target_scales_prefill_up_and_reports_it_everywhere() -> None:
    values = {**STEADY, "prefill": {sig.QUEUE_REQUESTS: 8.0, sig.QUEUE_TOKENS: 100.0,
                                    sig.LATENCY_P: 0.4}}
    source = FixedSignals(values)
    r = tick(make_spec(), source=source)
    assert r.desired == {"prefill": 4, "decode": 2}
    assert r.status["prefill"]["desiredReplicas"] == 4
    assert r.status["prefill"]["signal"] == 8.0
    assert r.status["prefill"]["lastScaleTime"] == "2025-11-29T07:06:40Z"
    assert "signal 8 vs target 4" in r.status["prefill"]["scaleReason"]
    assert "lastScaleTime" not in r.status["decode"]
    assert [(e.type, e.reason) for e in r.events] == [("Normal", "ScaledUp")]
    assert r.events[0].message.startswith("prefill 2 -> 4: ")
    assert [(c.type, c.status, c.reason) for c in r.conditions] == [
        ("ScalingActive", "True", "ValidMetrics"), ("ScalingLimited", "False", "DesiredWithinRange")]
    assert {s.pool for s in source.selectors} == {"prefill", "decode"}
    # Keyed on the resource, not on the served model name (another resource may serve it too).
    assert all((s.namespace, s.resource) == ("team-a", "tiny") for s in source.selectors)


def test_kv_pressure_scales_decode_and_the_ratio_band_follows() -> None:
    spec = make_spec(ratio={"minPrefillPerDecode": 0.5, "maxPrefillPerDecode": 2})
    values = {**STEADY, "decode": {sig.KV_USAGE: 1.0}}
    r = tick(spec, values, counts={"prefill": t.PoolCounts(2), "decode": t.PoolCounts(2)})
    assert r.desired == {"prefill": 2, "decode": 4}
    values = {**STEADY, "decode": {sig.KV_USAGE: 2.0}}  # over-committed: wants 8 decode
    r = tick(spec, values)
    assert r.desired["decode"] == 6, "+4 step"
    assert r.desired["prefill"] == 3, "raised to keep prefill/decode >= 0.5"
    assert any("P:D ratio band" in r for r in r.decisions["prefill"].reasons)


def test_state_carries_the_stabilization_window_across_ticks() -> None:
    spec = make_spec(prefill={"scaleDownStabilizationSeconds": 60})
    status = {"prefill": {"desiredReplicas": 6}, "decode": {"desiredReplicas": 2}}
    counts = {"prefill": t.PoolCounts(6), "decode": t.PoolCounts(2)}
    idle = {**STEADY, "prefill": {sig.QUEUE_REQUESTS: 0.0}}
    first = tick(spec, idle, status, counts, state=None, now=T0)
    assert first.desired["prefill"] == 6, "a fresh autoscaler waits one full window"
    history: list[int] = []
    state, now = first.state, T0
    for _ in range(5):
        now += 15
        r = tick(spec, idle, {**status, "prefill": {"desiredReplicas": history[-1] if history else 6}},
                 counts, state, now)
        history.append(r.desired["prefill"])
        state = r.state
    assert history == [6, 6, 6, 1, 1], "down to min once the 60 s window is full of idle readings"


def test_prometheus_down_holds_sets_the_condition_and_warns_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = sig.PrometheusSignals(f"http://127.0.0.1:{port}", timeout_s=2)
    status: dict[str, Any] = {"prefill": {"desiredReplicas": 5}, "decode": {"desiredReplicas": 3}}
    r = tick(make_spec(), status=status, source=source,
             counts={"prefill": t.PoolCounts(5), "decode": t.PoolCounts(3)})
    assert r.desired == {"prefill": 5, "decode": 3}, "never scaled towards min on missing data"
    active = r.conditions[0]
    assert (active.type, active.status, active.reason) == ("ScalingActive", "False", "MetricsUnavailable")
    assert "holding prefill at 5, decode at 3" in active.message and "ConnectionError" in active.message
    assert [(e.type, e.reason) for e in r.events] == [("Warning", "MetricsUnavailable")]
    assert r.status["prefill"]["signal"] is None
    status["conditions"] = [{"type": "ScalingActive", "status": "False"}]
    again = tick(make_spec(), status=status, source=source,
                 counts={"prefill": t.PoolCounts(5), "decode": t.PoolCounts(3)})
    assert again.events == [], "no event storm while it stays down"


def test_unschedulable_pods_scale_back_and_set_scaling_limited() -> None:
    status = {"prefill": {"desiredReplicas": 8}, "decode": {"desiredReplicas": 4}}
    counts = {"prefill": t.PoolCounts(ready=5, unschedulable=3), "decode": t.PoolCounts(4)}
    values = {**STEADY, "prefill": {sig.QUEUE_REQUESTS: 20.0}}
    r = tick(make_spec(), values, status, counts)
    assert r.desired["prefill"] == 5
    limited = r.conditions[1]
    assert (limited.status, limited.reason) == ("True", "Unschedulable")
    assert "3 prefill pods could not be scheduled" in limited.message
    assert ("Warning", "ScaledBackUnschedulable") in [(e.type, e.reason) for e in r.events]


def test_autoscaling_disabled_leaves_replicas_to_spec() -> None:
    spec = make_spec(prefill={"enabled": False}, decode={"enabled": False})
    source = FixedSignals(STEADY)
    r = tick(spec, source=source)
    assert (r.desired, r.status, r.events) == ({}, {}, [])
    assert r.conditions[0].reason == "AutoscalingDisabled"
    assert source.selectors == [], "no Prometheus queries for a resource that is not autoscaled"


def test_one_pool_disabled_is_never_touched() -> None:
    spec = make_spec(decode={"enabled": False})
    values = {"prefill": {sig.QUEUE_REQUESTS: 40.0}}
    r = tick(spec, values)
    assert set(r.desired) == {"prefill"} and set(r.status) == {"prefill"}
    assert r.desired["prefill"] == 6
    r = tick(make_spec(decode={"enabled": False}, ratio={"maxPrefillPerDecode": 1}), values)
    assert r.desired["prefill"] == 2, "decode is fixed at 2, so the band caps prefill at 2"
    assert any("prefill lowered" in x for x in r.decisions["prefill"].reasons)


def test_slo_from_spec_drives_the_guard() -> None:
    values = {"prefill": {sig.QUEUE_REQUESTS: 3.0, sig.LATENCY_P: 3.0}, "decode": {sig.KV_USAGE: 0.5}}
    r = tick(make_spec(slo={"ttftMs": 1000, "itlMs": 50}), values)
    assert r.desired["prefill"] == 6, "TTFT 3 s against 1 s: 2 ready x 3 = 6"
    assert "SLO guard" in r.status["prefill"]["scaleReason"]


@pytest.mark.parametrize(("pods", "expected"), [
    ([], 0),
    ([{"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}], 1),
    ([{"status": {"phase": "Pending"}}], 0),  # not tried yet
    ([{"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"}]}}], 0),  # placed, pulling the image
    ([{"metadata": {"deletionTimestamp": "2025-01-01T00:00:00Z"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}], 0),  # going away
    ([{"status": {"phase": "Running"}}] * 3, 0),
])
def test_count_unschedulable(pods: list[dict[str, Any]], expected: int) -> None:
    assert t.count_unschedulable(pods) == expected


def test_policy_is_read_from_the_spec() -> None:
    spec = make_spec(prefill={"minReplicas": 0, "maxReplicas": 12, "scaleUpStabilizationSeconds": 30},
                     slo={"ttftMs": 1500, "itlMs": 40})
    prefill, notes = t.policy_for(spec, "prefill")
    decode, _ = t.policy_for(spec, "decode")
    assert prefill is not None and decode is not None
    assert (prefill.min_replicas, prefill.max_replicas, prefill.target) == (1, 12, 4.0)
    assert prefill.scale_up_stabilization_s == 30 and prefill.slo_latency_s == 1.5
    assert decode.target == 0.5 and decode.slo_latency_s == 0.04
    assert notes and "minReplicas 0 is treated as 1" in notes[0]


@pytest.mark.parametrize(("ratio", "band"), [
    ({"minPrefillPerDecode": 0, "maxPrefillPerDecode": 8}, (None, 8.0)),
    ({"minPrefillPerDecode": 0.5, "maxPrefillPerDecode": 2}, (0.5, 2.0)),
])
def test_ratio_band_from_spec(ratio: dict[str, float], band: tuple[float | None, float | None]) -> None:
    got = t.ratio_band(make_spec(ratio=ratio))
    assert got is not None
    assert (got.min_prefill_per_decode, got.max_prefill_per_decode) == band


def test_an_externally_scaled_pool_is_left_to_its_owner_and_held_fixed_by_the_band() -> None:
    spec = make_spec(decode={"mode": "external"}, ratio={"maxPrefillPerDecode": 1})
    source = FixedSignals({"prefill": {sig.QUEUE_REQUESTS: 40.0}, "decode": {sig.KV_USAGE: 0.99}})
    r = t.autoscale_tick(spec=spec, status={"decode": {"desiredReplicas": 9}}, namespace="team-a", name="tiny", counts=READY,
                         signals=source, clock=lambda: T0, external={"decode": 3})
    assert set(r.desired) == {"prefill"}, "Tandem's autoscaler never writes a pool an external scaler owns"
    assert [sel.pool for sel in source.selectors] == ["prefill"], "and does not query its signals"
    assert r.desired["prefill"] == 3, "decode is at 3 (its DisaggregatedPool), so the band caps prefill at 3"


def test_metrics_are_recorded_under_the_shared_names() -> None:
    registry = CollectorRegistry()
    metrics = t.AutoscalerMetrics(registry)
    values = {**STEADY, "prefill": {sig.QUEUE_REQUESTS: 8.0}, "decode": {}}
    r = tick(make_spec(), values)
    metrics.record("team-a", "llama", r)
    labels = {"namespace": "team-a", "name": "llama", "pool": "prefill"}
    assert registry.get_sample_value(m.AUTOSCALER_DESIRED.name, labels) == 4
    assert registry.get_sample_value(m.AUTOSCALER_CURRENT.name, labels) == 2
    assert registry.get_sample_value(m.AUTOSCALER_SIGNAL.name, labels) == 8
    assert registry.get_sample_value(m.AUTOSCALER_TARGET.name, labels) == 4
    assert registry.get_sample_value(m.AUTOSCALER_MAX.name, labels) == 16
    assert registry.get_sample_value(m.exposed_name(m.AUTOSCALER_SCALE_EVENTS), {**labels, "direction": "up"}) == 1
    decode_signal = registry.get_sample_value(m.AUTOSCALER_SIGNAL.name, {**labels, "pool": "decode"})
    assert decode_signal is not None and math.isnan(decode_signal), "missing is a gap, not 0"


@pytest.mark.parametrize(("env", "message"), [
    ({"TANDEM_AUTOSCALER_INTERVAL": "0.1"}, "at least 1 s"),
    ({"TANDEM_AUTOSCALER_INTERVAL": "soon"}, "bad autoscaler setting"),
    ({"TANDEM_PROMETHEUS_URL": "prometheus:9090"}, "must start with http"),
    ({"TANDEM_AUTOSCALER_QUANTILE": "99"}, "quantile"),
])
def test_bad_settings_fail_with_a_clear_message(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        t.AutoscalerSettings.from_env(env)


def test_settings_from_env() -> None:
    s = t.AutoscalerSettings.from_env({"TANDEM_PROMETHEUS_URL": "http://127.0.0.1:9090",
                                       "TANDEM_AUTOSCALER_INTERVAL": "5"})
    assert (s.prometheus_url, s.interval_s, s.queries.quantile) == ("http://127.0.0.1:9090", 5.0, 0.9)
    assert t.AutoscalerSettings.from_env({}).interval_s == t.DEFAULT_INTERVAL_S


def test_invalid_policy_is_a_condition_not_a_crash() -> None:
    spec = make_spec(prefill={"targetQueueDepth": 4})
    object.__setattr__(spec.prefill.autoscaling, "target_queue_depth", math.nan)
    r = tick(spec)
    assert r.desired == {} and r.conditions[0].reason == "InvalidPolicy"
    assert isinstance(PolicyError("x"), ValueError)


def test_scaling_limited_names_the_limit_and_its_numbers() -> None:
    status = {"prefill": {"desiredReplicas": 14}, "decode": {"desiredReplicas": 4}}
    counts = {"prefill": t.PoolCounts(14), "decode": t.PoolCounts(4)}
    values = {**STEADY, "prefill": {sig.QUEUE_REQUESTS: 8.0}}  # wants 28, max is 16
    r = tick(make_spec(), values, status, counts)
    assert r.desired["prefill"] == 16
    limited = r.conditions[1]
    assert (limited.status, limited.reason) == ("True", "TooManyReplicas")
    assert limited.message == "prefill: capped at maxReplicas 16 (load wants 28)"


def test_default_metrics_share_the_operator_registry_and_can_be_built_twice() -> None:
    from prometheus_client import REGISTRY

    first, second = t.AutoscalerMetrics(), t.AutoscalerMetrics()  # no "duplicated timeseries"
    second.record("team-b", "shared", tick(make_spec(), {**STEADY, "prefill": {sig.QUEUE_REQUESTS: 8.0}}))
    labels = {"namespace": "team-b", "name": "shared", "pool": "prefill"}
    assert REGISTRY.get_sample_value(m.AUTOSCALER_DESIRED.name, labels) == 4
    assert first.desired is second.desired


@pytest.mark.parametrize(("deployment", "pods", "expected"), [
    ({"status": {"readyReplicas": 3}}, [], t.PoolCounts(3, 0)),
    ({"status": {}}, [], t.PoolCounts(0, 0)),  # the API omits zero counts
    (None, [], t.PoolCounts(0, 0)),  # not created yet
    ({"status": {"readyReplicas": 2}}, [{"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}], t.PoolCounts(2, 1)),
])
def test_pool_counts_from_api_objects(deployment: dict[str, Any] | None, pods: list[dict[str, Any]],
                                      expected: t.PoolCounts) -> None:
    assert t.pool_counts(deployment, pods) == expected


class BrokenSignals:
    def fetch(self, pool: str, sel: sig.Selector) -> sig.PoolSignals:
        raise RuntimeError("boom")


def test_a_signal_source_that_raises_holds_instead_of_crashing() -> None:
    r = tick(make_spec(), source=BrokenSignals())
    assert r.desired == {"prefill": 2, "decode": 2}
    assert r.conditions[0].reason == "MetricsUnavailable" and "RuntimeError: boom" in r.conditions[0].message


def test_no_ready_replica_is_reported_as_missing_data_too() -> None:
    r = tick(make_spec(), counts={"prefill": t.PoolCounts(0), "decode": t.PoolCounts(2)})
    assert r.desired["prefill"] == 2
    assert r.conditions[0].reason == "MetricsUnavailable"
    assert "prefill has no ready replicas to measure" in r.conditions[0].message
