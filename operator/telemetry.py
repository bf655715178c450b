"""Prometheus collectors for the operator, built from the shared names in tandem.worker.metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from tandem.worker import metrics

_collectors: dict[str, Counter | Gauge] = {}


def operator_metric(definition: metrics.MetricDef) -> Counter | Gauge:
    """The process-wide collector for one of metrics.ALL_OPERATOR_METRICS (created on first use)."""
    if definition not in metrics.ALL_OPERATOR_METRICS:
        raise ValueError(f"{definition.name} is not an operator metric")
    if definition.name not in _collectors:
        kind = {"counter": Counter, "gauge": Gauge}[definition.kind]
        _collectors[definition.name] = kind(definition.name, definition.help, list(definition.labels))
    return _collectors[definition.name]


def count_reconcile(namespace: str, name: str, failed: bool) -> None:
    operator_metric(metrics.RECONCILES).labels(namespace, name).inc()
    # Touch the error series even on success, so it exists at 0 (a dashboard shows 0, not "No data").
    errors = operator_metric(metrics.RECONCILE_ERRORS).labels(namespace, name)
    if failed:
        errors.inc()
