"""Prometheus series of the KV transfer, built from the shared names in tandem.worker.metrics.

One `TransferTelemetry` per worker process: pass the same object to its receiver and sender
(a Prometheus registry refuses the same family twice). Without a registry, series go to a
private one that nothing exports, which is what tests and benchmarks want.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.worker import metrics as m

from .errors import REASONS
from .limits import REFUSAL_REASONS


class TransferTelemetry:
    def __init__(self, registry: CollectorRegistry | None = None, *, model: str = "", role: str = "",
                 pool: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = {m.LABEL_MODEL: model, m.LABEL_ROLE: role, m.LABEL_POOL: pool}
        self._bytes = Counter(m.KV_TRANSFER_BYTES.name, m.KV_TRANSFER_BYTES.help,
                              m.KV_TRANSFER_BYTES.labels, registry=self.registry)
        self._seconds = Histogram(m.KV_TRANSFER_SECONDS.name, m.KV_TRANSFER_SECONDS.help,
                                  m.KV_TRANSFER_SECONDS.labels, registry=self.registry,
                                  buckets=m.KV_TRANSFER_SECONDS.buckets or Histogram.DEFAULT_BUCKETS)
        self._failures = Counter(m.KV_TRANSFER_FAILURES.name, m.KV_TRANSFER_FAILURES.help,
                                 m.KV_TRANSFER_FAILURES.labels, registry=self.registry)
        self._refusals = Counter(m.KV_RECEIVER_REFUSALS.name, m.KV_RECEIVER_REFUSALS.help,
                                 m.KV_RECEIVER_REFUSALS.labels, registry=self.registry)
        self._transport = Gauge(m.KV_TRANSPORT_INFO.name, m.KV_TRANSPORT_INFO.help,
                                m.KV_TRANSPORT_INFO.labels, registry=self.registry)

    def transferred(self, transport: str, direction: str, nbytes: int, seconds: float) -> None:
        labels = {**self._labels, m.LABEL_TRANSPORT: transport, m.LABEL_DIRECTION: direction}
        self._bytes.labels(**labels).inc(nbytes)
        self._seconds.labels(**labels).observe(seconds)

    def failed(self, transport: str, reason: str) -> None:
        self._failures.labels(**self._labels, **{m.LABEL_TRANSPORT: transport, m.LABEL_REASON: reason}).inc()

    def refused(self, transport: str, reason: str) -> None:
        """A KV receiver refused or disconnected a peer over one of its limits (limits.REFUSAL_REASONS)."""
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown KV receiver refusal reason {reason!r}")
        self._refusals.labels(**self._labels, **{m.LABEL_TRANSPORT: transport, m.LABEL_REASON: reason}).inc()

    def refusals(self, transport: str, reason: str) -> float:
        """Current refusal count (for tests)."""
        value = self.registry.get_sample_value(
            m.exposed_name(m.KV_RECEIVER_REFUSALS),
            {**self._labels, m.LABEL_TRANSPORT: transport, m.LABEL_REASON: reason})
        return value or 0.0

    def selected(self, transport: str) -> None:
        """Mark `transport` as the one in use (1) and the others as not (0)."""
        for kind in ("tcp", "rdma"):
            self._transport.labels(**self._labels, **{m.LABEL_TRANSPORT: kind}).set(int(kind == transport))

    def initialise(self, transport: str, *directions: str) -> None:
        """Export this transport's series at 0 before the first transfer: a failure count for every reason
        in errors.REASONS (and, on a receiver, a refusal count for every limits.REFUSAL_REASONS), and bytes and durations for each direction (send on prefill, recv on decode)."""
        for reason in sorted(REASONS):
            self._failures.labels(**self._labels, **{m.LABEL_TRANSPORT: transport, m.LABEL_REASON: reason})
        if "recv" in directions:
            for reason in REFUSAL_REASONS:
                self._refusals.labels(**self._labels, **{m.LABEL_TRANSPORT: transport, m.LABEL_REASON: reason})
        for direction in directions:
            labels = {**self._labels, m.LABEL_TRANSPORT: transport, m.LABEL_DIRECTION: direction}
            self._bytes.labels(**labels)
            self._seconds.labels(**labels)

    def failures(self, transport: str, reason: str) -> float:
        """Current failure count (for tests and `tandem doctor`)."""
        value = self.registry.get_sample_value(
            m.exposed_name(m.KV_TRANSFER_FAILURES),
            {**self._labels, m.LABEL_TRANSPORT: transport, m.LABEL_REASON: reason})
        return value or 0.0
