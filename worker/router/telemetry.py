"""The router's metrics, labelled with the name of the model it serves.

Without `--model-name` the router learns that name from its workers' /info, so it may not know
it when the first events happen. Those events can only be refusals (a request needs the model's
name to get past the model check), and the label cannot change once a series exists: a series
with model="" (or a placeholder) would stay on /metrics beside the real one for the life of the
process, and dashboards select on `model`. So until the name is known there is no registry at
all: /metrics has no tandem series, and the few counts that happen are kept here and added to
the real series the moment the name is learned. Every series is exported at 0 from then on, so
PromQL's rate() over them works before their first event; the per-prefill-worker series (label
`worker`) from the first scrape after the router learned of that worker.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from tandem.worker import metrics as m
from tandem.worker.server.telemetry import Telemetry

ROUTER_METRICS = (m.TTFT, m.ITL, m.E2E, m.PROMPT_TOKENS, m.GENERATION_TOKENS, m.REQUESTS, m.MIGRATIONS,
                  m.CONTROL_AUTH_FAILURES,
                  m.ROUTER_AUTH_FAILURES, m.ROUTER_OVERLOADED, m.ROUTER_ACTIVE_REQUESTS, m.ROUTER_QUEUED_REQUESTS,
                  m.ROUTER_CANARY_PROBES, m.ROUTER_PREFILL_PROMPT_TOKENS, m.ROUTER_PREFIX_EXPECTED_HITS)
PER_WORKER = (m.ROUTER_PREFILL_PROMPT_TOKENS, m.ROUTER_PREFIX_EXPECTED_HITS)  # label `worker`: a prefill worker
# tandem_requests_total reasons on the router: the finish reason of a request that produced tokens,
# or `error` for every request that did not finish (refused with a 4xx/5xx, deadline, lost worker).
FINISH_REASONS = ("stop", "length", "error")
AUTH_FAILURE_REASONS = ("missing", "invalid")  # tandem_router_auth_failures_total (auth.ApiKeyMiddleware)
OVERLOAD_REASONS = ("queue_full", "queue_timeout")  # tandem_router_overloaded_requests_total (limits)
CANARY_RESULTS = ("match", "mismatch", "skipped", "error")  # tandem_router_canary_probes_total (canary.py)


class RouterTelemetry:
    def __init__(self, model_name: str | None) -> None:
        self._t: Telemetry | None = None
        self.model: str | None = None
        self._early_counts: dict[tuple[m.MetricDef, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        if model_name:
            self.bind(model_name)

    def bind(self, model_name: str) -> None:
        """Create the series for this model (once; later calls do nothing) and add what came before."""
        if self._t is not None or not model_name:
            return
        t = Telemetry(model_name, "router", "router", ROUTER_METRICS)
        t.initialise_all(FINISH_REASONS)
        for reason in m.CONTROL_AUTH_REASONS:  # /workers without the worker control token
            t.initialise(m.CONTROL_AUTH_FAILURES, reason=reason)
        for d, reasons in ((m.ROUTER_AUTH_FAILURES, AUTH_FAILURE_REASONS), (m.ROUTER_OVERLOADED, OVERLOAD_REASONS)):
            for reason in reasons:
                t.initialise(d, reason=reason)
        for result in CANARY_RESULTS:
            t.initialise(m.ROUTER_CANARY_PROBES, result=result)
        for (d, extra), amount in self._early_counts.items():
            t.inc(d, amount, **dict(extra))
        self._early_counts.clear()
        self._t, self.model = t, model_name

    def inc(self, d: m.MetricDef, amount: float = 1.0, **extra: str) -> None:
        if self._t is not None:
            self._t.inc(d, amount, **extra)
        elif amount > 0:
            self._early_counts[(d, tuple(sorted(extra.items())))] += amount

    def set(self, d: m.MetricDef, value: float, **extra: str) -> None:
        # Gauges are set when /metrics is rendered: before the name is known there is nothing to render.
        if self._t is not None:
            self._t.set(d, value, **extra)

    def observe(self, d: m.MetricDef, value: float, **extra: str) -> None:
        # Latencies exist only for requests that passed the model check, which binds the name first.
        if self._t is not None:
            self._t.observe(d, value, **extra)

    def prefilled(self, worker: str, prompt_tokens: int, expected_hit_tokens: int) -> None:
        """A prefill this router placed on `worker` answered; the router expected `expected_hit_tokens` of
        its `prompt_tokens` in that worker's prefix cache (placement.Placement.expected_hit_tokens)."""
        self.initialise_workers([worker])  # both series, even while the expected hits are 0
        self.inc(m.ROUTER_PREFILL_PROMPT_TOKENS, prompt_tokens, worker=worker)
        self.inc(m.ROUTER_PREFIX_EXPECTED_HITS, expected_hit_tokens, worker=worker)

    def initialise_workers(self, urls: Iterable[str]) -> None:
        """Export the per-worker series of these prefill workers, at 0 until their first prefill."""
        if self._t is not None:
            for url in urls:
                for d in PER_WORKER:
                    self._t.initialise(d, worker=url)

    def render(self) -> bytes:
        return self._t.render() if self._t is not None else b""

