"""Prometheus collectors built from the shared definitions in tandem.worker.metrics.

Names, kinds, help and label names come only from there; this module just instantiates them
in a private registry and pre-fills the model/role/pool labels of this process. The same registry
renders, in the same scrape, vLLM's names for some of them (tandem.worker.metrics_vllm).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from tandem.worker import metrics as m
from tandem.worker.metrics_vllm import WithVllmNames, mirrors_for


class Telemetry:
    def __init__(self, model: str, role: str, pool: str, defs: tuple[m.MetricDef, ...] = m.ALL_WORKER_METRICS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._common = {m.LABEL_MODEL: model, m.LABEL_ROLE: role, m.LABEL_POOL: pool}
        self.defs = defs
        self._collectors: dict[str, MetricWrapperBase] = {}
        for d in defs:
            self._collectors[d.name] = self._make(d)
        self._scrape = WithVllmNames(self.registry, mirrors_for(role))

    def _make(self, d: m.MetricDef) -> MetricWrapperBase:
        if d.kind == "gauge":
            return Gauge(d.name, d.help, d.labels, registry=self.registry)
        if d.kind == "counter":
            return Counter(d.name, d.help, d.labels, registry=self.registry)
        if d.kind == "histogram":
            return Histogram(d.name, d.help, d.labels, registry=self.registry,
                             buckets=d.buckets or Histogram.DEFAULT_BUCKETS)
        raise ValueError(f"metric {d.name}: unsupported kind {d.kind!r}")

    def _child(self, d: m.MetricDef, extra: dict[str, str]) -> MetricWrapperBase:
        labels = {**self._common, **extra}
        return self._collectors[d.name].labels(**{k: labels[k] for k in d.labels})

    def initialise(self, d: m.MetricDef, **extra: str) -> None:
        """Export this series now, at 0, before its first event (so rate() and dashboards see 0, not no data)."""
        self._child(d, extra)

    def initialise_all(self, finish_reasons: tuple[str, ...], skip: tuple[m.MetricDef, ...] = ()) -> None:
        """Export, at 0, every series that has only the common labels (but `skip`) and
        tandem_requests_total for each of `finish_reasons`."""
        for d in self.defs:
            if d.labels == m.COMMON_LABELS and d not in skip:
                self.initialise(d)
        for reason in finish_reasons:
            self.initialise(m.REQUESTS, reason=reason)

    def set(self, d: m.MetricDef, value: float, **extra: str) -> None:
        self._child(d, extra).set(value)  # type: ignore[attr-defined]

    def inc(self, d: m.MetricDef, amount: float = 1.0, **extra: str) -> None:
        if amount > 0:
            self._child(d, extra).inc(amount)  # type: ignore[attr-defined]

    def observe(self, d: m.MetricDef, value: float, **extra: str) -> None:
        self._child(d, extra).observe(value)  # type: ignore[attr-defined]

    def render(self) -> bytes:
        return generate_latest(self._scrape)
