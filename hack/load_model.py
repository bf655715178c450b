#!/usr/bin/env python3
"""A load model for the autoscaler: worker metrics that follow a request trace and the pool sizes.

    hack/load_model.py serve    --trace step|mooncake|azure|FILE [--time-scale X] [--length-scale Y]
                                --replicas-file F | --deployment prefill=NS/NAME --deployment decode=NS/NAME
                                [--port P] [--model M]
    hack/load_model.py simulate --trace ... [--interval 15] [--startup 30] [--json OUT]

`serve` exposes the worker metrics (names from tandem.worker.metrics) on 127.0.0.1, one series
per simulated ready replica, as real workers would: the queue and KV gauges, worker_ready, and
the TTFT/ITL histograms. It re-reads the ready replica counts every tick, from a JSON file
({"prefill": 3, "decode": 2}) or from the Deployments' status.readyReplicas, so the autoscaler
under test closes the loop through Prometheus and the control plane. The scrape adds `namespace`
(as in Kubernetes); the series carry model, role, pool and replica.

`simulate` closes the same loop in-process, without Kubernetes or Prometheus: a decision every
--interval seconds of simulated time, pods ready --startup seconds after they are placed, at most
--capacity-* pods per pool. It prints SLO attainment and replica-seconds, on the same trace, for
static provisioning at peak (the `tandem plan` size), the cheapest static size meeting
--slo-goal, a plain HPA, the operator's timer body (tandem.operator.autoscaler_timer), the
predictive policy (tandem.operator.predictive_policy) and that policy fed the future (a bound).

The model is a fluid queue, deliberately simple: each ready prefill replica ingests
--prefill-tps prompt tokens/s (FIFO); decode admits a request when prompt+output tokens fit in
the pool's KV (--kv-tokens per replica) and generates one token per step, with
ITL = --itl-base + --itl-per-seq x (running requests per replica).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.worker import metrics as m

TRACES = Path("/work/shared/traces")
ROLES = ("prefill", "decode")


# --------------------------------------------------------------------------- traces

@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: int
    output: int


def step_trace(base_rps: float = 2.0, factor: float = 5.0, before_s: float = 120, during_s: float = 240,
               after_s: float = 420, prompt: int = 2000, output: int = 200) -> list[Request]:
    """Evenly spaced arrivals at base_rps, factor x base_rps in the middle window, base again after."""
    out: list[Request] = []
    t = 0.0
    for rate, until in ((base_rps, before_s), (base_rps * factor, before_s + during_s),
                        (base_rps, before_s + during_s + after_s)):
        while t < until:
            out.append(Request(t, prompt, output))
            t += 1.0 / rate
    return out


def load_trace(name: str, time_scale: float = 1.0, length_scale: float = 1.0,
               limit_s: float | None = None, step_shape: str | None = None) -> list[Request]:
    """`step`, `mooncake`, `azure` or a path. Arrivals are divided by time_scale (compressed when
    > 1) and token counts multiplied by length_scale; limit_s cuts the (scaled) trace.
    step_shape is "BASE_RPS,FACTOR,BEFORE_S,DURING_S,AFTER_S" for the step trace."""
    if time_scale <= 0 or length_scale <= 0:
        raise ValueError("time and length scales must be positive")
    if name == "step":
        if step_shape:
            try:
                base, factor, before, during, after = (float(x) for x in step_shape.split(","))
            except ValueError:
                raise ValueError(f"step shape wants BASE_RPS,FACTOR,BEFORE_S,DURING_S,AFTER_S, "
                                 f"got {step_shape!r}") from None
            if min(base, factor) <= 0 or min(before, during, after) < 0:
                raise ValueError(f"step shape {step_shape!r}: rates must be positive, durations non-negative")
            raw = step_trace(base, factor, before, during, after)
        else:
            raw = step_trace()
    else:
        path = {"mooncake": TRACES / "mooncake_conversation.jsonl",
                "azure": TRACES / "azure_llm_2023_code.csv"}.get(name, Path(name))
        if not path.exists():
            raise FileNotFoundError(f"trace {name!r}: no file at {path}")
        raw = list(_read_trace_file(path))
    if not raw:
        raise ValueError(f"trace {name!r} has no requests")
    start = min(r.arrival_s for r in raw)
    scaled = sorted(
        (Request((r.arrival_s - start) / time_scale, max(1, round(r.prompt * length_scale)),
                 max(1, round(r.output * length_scale))) for r in raw),
        key=lambda r: r.arrival_s)
    return [r for r in scaled if limit_s is None or r.arrival_s < limit_s]


def _read_trace_file(path: Path) -> Iterator[Request]:
    if path.suffix == ".jsonl":
        with path.open() as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    yield Request(row["timestamp"] / 1000.0, int(row["input_length"]), int(row["output_length"]))
    elif path.suffix == ".csv":
        with path.open() as f:
            for row in csv.DictReader(f):
                ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
                yield Request(ts, int(row["ContextTokens"]), int(row["GeneratedTokens"]))
    else:
        raise ValueError(f"unknown trace format {path.suffix!r} (expected .jsonl or .csv)")


# --------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class Capacity:
    prefill_tps: float = 8000.0  # prompt tokens/s per prefill replica
    kv_tokens: int = 160_000  # KV-cache tokens per decode replica
    itl_base_s: float = 0.015
    itl_per_seq_s: float = 0.0004


@dataclass
class _Running:
    ttft: float
    kv: int
    left: float  # output tokens still to generate
    itl_sum: float = 0.0
    tokens: float = 0.0


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[float] = field(default_factory=list)  # cumulative per bucket, plus +Inf last
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0.0] * (len(self.buckets) + 1)

    def observe(self, value: float, n: float = 1.0) -> None:
        for i in range(bisect.bisect_left(self.buckets, value), len(self.counts)):
            self.counts[i] += n
        self.total += value * n


@dataclass
class Snapshot:
    ready: dict[str, int]
    queue_requests: float  # whole prefill pool
    queue_tokens: float
    kv_used_ratio: float  # decode pool average, 0..1
    running: int
    waiting: int


class LoadModel:
    """The fluid model. Call step(now, dt, ready) with increasing `now`."""

    def __init__(self, trace: list[Request], capacity: Capacity = Capacity()) -> None:
        self.trace, self.cap = trace, capacity
        self._next = 0
        self.prefill: list[list[float]] = []  # [arrival, tokens left, prompt, output], FIFO
        # Prefilled, waiting for decode KV: (ttft, prompt, output, since). The wait is the gap
        # between the first token (from prefill) and the second, so it counts in the request's ITL.
        self.waiting: deque[tuple[float, int, int, float]] = deque()
        self.running: list[_Running] = []
        self.ttft = Histogram(m.TTFT.buckets or ())
        self.itl = Histogram(m.ITL.buckets or ())
        self.recent: deque[tuple[float, str, float, float]] = deque()  # (time, kind, value, weight)
        self.finished: list[tuple[float, float]] = []  # (ttft, mean itl) per request
        self.snapshot = Snapshot({r: 0 for r in ROLES}, 0, 0, 0.0, 0, 0)
        self.prefilled_tokens = 0.0  # prompt tokens processed so far (the workers' prompt-token counter)

    @property
    def done(self) -> bool:
        return self._next >= len(self.trace) and not (self.prefill or self.waiting or self.running)

    def step(self, now: float, dt: float, ready: dict[str, int]) -> Snapshot:
        while self._next < len(self.trace) and self.trace[self._next].arrival_s <= now:
            new = self.trace[self._next]
            self.prefill.append([new.arrival_s, float(new.prompt), new.prompt, new.output])
            self._next += 1
        # Each ready replica works through the queue in FIFO order, one request at a time; what
        # is left of its budget in a step goes to the next waiting request.
        idx, done = 0, False
        for _ in range(ready.get("prefill", 0)):
            budget = self.cap.prefill_tps * dt
            while budget > 0 and idx < len(self.prefill):
                req = self.prefill[idx]
                used = min(budget, req[1])
                req[1] -= used
                self.prefilled_tokens += used
                budget -= used
                if req[1] > 0:
                    break  # this replica keeps the request for the next step
                ttft = now - req[0]
                self.ttft.observe(ttft)
                self._remember(now, "ttft", ttft, 1.0)
                self.waiting.append((ttft, int(req[2]), int(req[3]), now))
                idx += 1
                done = True
            else:
                continue
            idx += 1  # the next replica starts on the next request
        if done:
            self.prefill = [req for req in self.prefill if req[1] > 0]
        n_decode = ready.get("decode", 0)
        capacity = n_decode * self.cap.kv_tokens
        used = sum(r.kv for r in self.running)
        while self.waiting and used + self.waiting[0][1] + self.waiting[0][2] <= capacity:
            ttft, prompt, output, since = self.waiting.popleft()
            self.running.append(_Running(ttft, prompt + output, output, itl_sum=now - since))
            used += prompt + output
        if self.running and n_decode > 0:
            itl = self.cap.itl_base_s + self.cap.itl_per_seq_s * len(self.running) / n_decode
            steps = dt / itl
            still = []
            for r in self.running:
                made = min(r.left, steps)
                r.left -= made
                r.tokens += made
                r.itl_sum += made * itl
                if r.left <= 1e-9:
                    self.finished.append((r.ttft, r.itl_sum / max(r.tokens, 1.0)))
                else:
                    still.append(r)
            self.itl.observe(itl, steps * len(self.running))
            self._remember(now, "itl", itl, steps * len(self.running))
            self.running = still
        self.snapshot = Snapshot(
            ready=dict(ready),
            queue_requests=float(len(self.prefill)),
            queue_tokens=float(sum(p[1] for p in self.prefill)),
            kv_used_ratio=min(1.0, sum(r.kv for r in self.running) / capacity) if capacity else 0.0,
            running=len(self.running), waiting=len(self.waiting))
        return self.snapshot

    def _remember(self, now: float, kind: str, value: float, weight: float) -> None:
        self.recent.append((now, kind, value, weight))
        while self.recent and self.recent[0][0] < now - 300:
            self.recent.popleft()

    def quantile(self, kind: str, q: float, since: float) -> float | None:
        """Weighted quantile of recent observations (what histogram_quantile over a rate window shows)."""
        obs = sorted((v, w) for t, k, v, w in self.recent if k == kind and t >= since)
        total = sum(w for _, w in obs)
        if total <= 0:
            return None
        acc = 0.0
        for v, w in obs:
            acc += w
            if acc >= q * total:
                return v
        return obs[-1][0]


# --------------------------------------------------------------------------- serving the metrics

class MetricsCollector:
    """prometheus_client collector over the model's latest snapshot, one series per ready replica."""

    def __init__(self, model: LoadModel, model_name: str) -> None:
        self.model, self.model_name = model, model_name
        self.lock = threading.Lock()

    def _labels(self, role: str, replica: str) -> list[str]:
        return [self.model_name, role, role, replica]

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        names = [*m.COMMON_LABELS, "replica"]
        with self.lock:
            snap, ttft, itl = self.model.snapshot, self.model.ttft, self.model.itl
            ready = {r: snap.ready.get(r, 0) for r in ROLES}
            gauges = {d.name: GaugeMetricFamily(d.name, d.help, labels=names)
                      for d in (m.PREFILL_QUEUE_REQUESTS, m.PREFILL_QUEUE_TOKENS, m.KV_USAGE_RATIO,
                                m.RUNNING_REQUESTS, m.WAITING_REQUESTS, m.WORKER_READY)}
            for role in ROLES:
                n = ready[role]
                for i in range(n):
                    labels = self._labels(role, f"{role}-{i}")
                    gauges[m.WORKER_READY.name].add_metric(labels, 1.0)
                    if role == "prefill":
                        gauges[m.PREFILL_QUEUE_REQUESTS.name].add_metric(labels, snap.queue_requests / n)
                        gauges[m.PREFILL_QUEUE_TOKENS.name].add_metric(labels, snap.queue_tokens / n)
                    else:
                        gauges[m.KV_USAGE_RATIO.name].add_metric(labels, snap.kv_used_ratio)
                        gauges[m.RUNNING_REQUESTS.name].add_metric(labels, snap.running / n)
                        gauges[m.WAITING_REQUESTS.name].add_metric(labels, snap.waiting / n)
            hists = []
            for d, h, role in ((m.TTFT, ttft, "prefill"), (m.ITL, itl, "decode")):
                fam = HistogramMetricFamily(d.name, d.help, labels=names)
                bounds = [*(f"{b:g}" for b in h.buckets), "+Inf"]
                fam.add_metric(self._labels(role, "model"), list(zip(bounds, h.counts, strict=True)), h.total)
                hists.append(fam)
        yield from gauges.values()
        yield from hists


def read_replicas_file(path: Path) -> dict[str, int]:
    """{"prefill": 3, "decode": 2} or {"prefill": {"ready": 3}, ...}; a missing role reads as 0."""
    data = json.loads(path.read_text())
    out = {}
    for role in ROLES:
        value = data.get(role, 0)
        out[role] = int(value.get("ready", 0) if isinstance(value, dict) else value)
        if out[role] < 0:
            raise ValueError(f"{path}: {role} replicas must be non-negative")
    return out


def kube_replicas_reader(deployments: dict[str, tuple[str, str]], kubeconfig: str | None):  # type: ignore[no-untyped-def]
    """Reads status.readyReplicas of each role's Deployment (role -> (namespace, name))."""
    from kubernetes import client, config

    config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    apps = client.AppsV1Api()

    def read() -> dict[str, int]:
        out = {}
        for role, (ns, name) in deployments.items():
            try:
                dep = apps.read_namespaced_deployment_status(name, ns)
                out[role] = int((dep.status and dep.status.ready_replicas) or 0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
                out[role] = 0
        return out
    return read


def serve(args: argparse.Namespace) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    trace = load_trace(args.trace, args.time_scale, args.length_scale, args.limit, args.step_shape)
    model = LoadModel(trace, _capacity(args))
    collector = MetricsCollector(model, args.model)
    registry = CollectorRegistry()
    registry.register(collector)
    if args.replicas_file:
        path = Path(args.replicas_file)

        def read_ready() -> dict[str, int]:
            return read_replicas_file(path)
    else:
        deployments = {}
        for item in args.deployment:
            role, _, ref = item.partition("=")
            ns, _, name = ref.partition("/")
            if role not in ROLES or not ns or not name:
                raise SystemExit(f"--deployment wants prefill=NS/NAME or decode=NS/NAME, got {item!r}")
            deployments[role] = (ns, name)
        read_ready = kube_replicas_reader(deployments, args.kubeconfig)
    server, _thread = start_http_server(args.port, addr="127.0.0.1", registry=registry)
    print(json.dumps({"port": server.server_port, "requests": len(trace)}), flush=True)
    start = time.monotonic()
    last = 0.0
    try:
        while True:
            now = time.monotonic() - start
            try:
                ready = read_ready()
            except Exception as exc:  # keep serving the last values; say why
                print(f"load_model: cannot read replicas: {exc}", file=sys.stderr, flush=True)
                ready = model.snapshot.ready
            with collector.lock:
                model.step(now, now - last, ready)
            last = now
            time.sleep(args.tick)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- closed-loop simulation

@dataclass
class SimCluster:
    """Pods per pool: placed up to capacity, ready `startup_s` after placement."""

    capacity: dict[str, int]
    startup_s: float
    pods: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROLES})  # ready-at times

    def apply(self, role: str, desired: int, now: float) -> None:
        pods = self.pods[role]
        while len(pods) > desired:  # the ReplicaSet removes not-ready pods first
            pods.remove(max(pods))
        while len(pods) < min(desired, self.capacity[role]):
            pods.append(now + self.startup_s)

    def ready(self, role: str, now: float) -> int:
        return sum(1 for t in self.pods[role] if t <= now)

    def placed(self, role: str) -> int:
        return len(self.pods[role])


class ModelSignals:
    """SignalSource reading the model as PromQL would: per ready replica, quantile over a window."""

    def __init__(self, model: LoadModel, window_s: float = 60.0) -> None:
        self.model, self.window_s, self.now = model, window_s, 0.0

    def fetch(self, pool: str, sel: Any) -> Any:
        from tandem.operator import signals as sig

        snap = self.model.snapshot
        n = snap.ready.get(pool, 0)
        values: dict[str, float] = {}
        if n > 0:
            if pool == "prefill":
                values[sig.QUEUE_REQUESTS] = snap.queue_requests / n
                values[sig.QUEUE_TOKENS] = snap.queue_tokens / n
            else:
                values[sig.KV_USAGE] = snap.kv_used_ratio
        lat = self.model.quantile("ttft" if pool == "prefill" else "itl", 0.9, self.now - self.window_s)
        if lat is not None:
            values[sig.LATENCY_P] = lat
        problems = {} if n > 0 else {"queue_requests" if pool == "prefill" else "kv_usage": "no ready replicas"}
        return sig.PoolSignals(values, problems)


def simulation_spec(args: argparse.Namespace, static: dict[str, int] | None = None, predictive: bool = False) -> Any:
    """The DisaggregatedModel the simulated operator reads. `predictive`: both pools on policy predictive
    with spec.capacityProfile from predictive_profile (down window --predict-down-window)."""
    from tandem.operator.api import DisaggregatedModelSpec

    def pool(role: str, target: dict[str, float]) -> dict[str, Any]:
        auto = {"enabled": static is None, "minReplicas": 1, "maxReplicas": args.max_replicas,
                "scaleDownStabilizationSeconds": round(args.predict_down_window if predictive else args.down_window),
                **({"policy": "predictive"} if predictive else {}), **target}
        return {"replicas": (static or {}).get(role, 1), "autoscaling": auto}

    extra: dict[str, Any] = {}
    if predictive:
        prof = predictive_profile(args)
        extra["capacityProfile"] = {"prefillTokensPerSecond": prof.prefill_tps, "kvTokens": prof.kv_tokens,
                                    "itlBaseSeconds": prof.itl_base_s, "itlPerRequestSeconds": prof.itl_per_seq_s,
                                    "startupSeconds": prof.startup_s}
    return DisaggregatedModelSpec.model_validate({
        "model": {"name": args.model, "source": {"path": "/models/sim"}},
        "prefill": pool("prefill", {"targetQueueDepth": args.target_queue}),
        "decode": pool("decode", {"targetKVUtilization": args.target_kv}),
        "slo": {"ttftMs": args.ttft_slo_ms, "itlMs": args.itl_slo_ms},
        "ratio": {"minPrefillPerDecode": args.min_ratio, "maxPrefillPerDecode": args.max_ratio},
        **extra,
    })


class ModelArrivals:
    """ArrivalSource: the values signals.arrival_queries would give, set by the simulation each tick."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def set(self, tps: float, slope: float, rps: float, mean_prompt: float, mean_output: float,
            backlog_tokens: float, decode_waiting: int, busy_tps: float | None) -> None:
        from tandem.operator import signals as sig

        self.values = {sig.ARRIVAL_PROMPT_TPS: tps, sig.ARRIVAL_PROMPT_TREND: slope, sig.ARRIVAL_REQUEST_RATE: rps,
                       sig.ARRIVAL_OUTPUT_TPS: rps * mean_output, sig.ARRIVAL_FINISHED_RATE: rps,
                       sig.ARRIVAL_BACKLOG_TOKENS: backlog_tokens, sig.ARRIVAL_DECODE_WAITING: float(decode_waiting)}
        if busy_tps is not None:
            self.values[sig.ARRIVAL_PREFILL_BUSY_TPS] = busy_tps

    def fetch_arrivals(self, namespace: str, resource: str) -> Any:
        from tandem.operator import signals as sig

        return sig.PoolSignals(dict(self.values), {})


class ArrivalWindow:
    """What a router's counters give over the signal window: arrival rates, mean lengths, trend."""

    def __init__(self, trace: list[Request], window_s: float = 60.0, buckets: int = 4, burst: bool = True) -> None:
        self.trace, self.window_s, self.buckets, self.burst = trace, window_s, buckets, burst
        self.times = [r.arrival_s for r in trace]

    def rate(self, start: float, end: float) -> tuple[float, float, float, float]:
        """(prompt tokens/s, requests/s, mean prompt, mean output) of arrivals in [start, end)."""
        lo, hi = bisect.bisect_left(self.times, start), bisect.bisect_left(self.times, end)
        reqs = self.trace[lo:hi]
        span = max(end - max(start, 0.0), 1e-9)
        if not reqs:
            return 0.0, 0.0, 0.0, 0.0
        prompt = sum(r.prompt for r in reqs)
        return prompt / span, len(reqs) / span, prompt / len(reqs), sum(r.output for r in reqs) / len(reqs)

    def load(self, now: float) -> tuple[float, float, float, float, float]:
        """(prompt tok/s, its trend per s, req/s, mean prompt, mean output) over the window."""
        from tandem.operator.predictive_policy import trend

        tps, rps, mp, mo = self.rate(now - self.window_s, now)
        step = self.window_s / self.buckets
        samples = [(now - (k + 0.5) * step, self.rate(now - (k + 1) * step, now - k * step)[0])
                   for k in range(self.buckets) if now - (k + 1) * step >= 0]
        # Size for the busiest quarter of the window, not its mean: bursts shorter than a pod
        # start cannot be followed, only provisioned for.
        peak = max([tps, *(v for _, v in samples)]) if self.burst else tps
        if tps > 0:
            rps *= peak / tps
        return peak, trend(samples), rps, mp, mo


def hpa_desired(ready: int, current: int, value: float | None, target: float, history: list[tuple[float, int]],
                now: float, down_window_s: float, tolerance: float = 0.1) -> int:
    """The Kubernetes HPA algorithm on one metric: ceil(ready x value / target) outside the
    tolerance, scale-up limited to max(4 pods, 100%) per period, scale-down to the highest
    recommendation of the stabilization window. Missing metric: hold."""
    if value is None or ready == 0:
        return current
    ratio = value / target
    rec = current if abs(ratio - 1) <= tolerance else max(1, math.ceil(ready * ratio - 1e-9))
    history.append((now, rec))
    while history and history[0][0] <= now - down_window_s:
        history.pop(0)
    if rec > current:
        return min(rec, current + max(4, current))
    return max(r for _, r in history) if rec < current else current


def predictive_profile(args: argparse.Namespace) -> Any:
    """The profile the predictive policy is given: the model's capacity, unless --profile-error skews it."""
    from tandem.operator.capacity_model import Profile

    return Profile(args.prefill_tps * args.profile_error, args.kv_tokens, args.itl_base, args.itl_per_seq,
                   args.startup, 1, "simulation")


def simulate(args: argparse.Namespace, static: dict[str, int] | None = None, policy: str = "current") -> dict[str, Any]:
    """Run the closed loop. `static` pins the pools (autoscaling off) for a baseline; otherwise
    `policy` is current (the operator's timer body, reactive), hpa (plain Kubernetes HPA on queue depth and
    KV usage), predictive (the same timer body with both pools on policy predictive: the operator's
    predictive path, fed what the arrival queries would return) or oracle (that path fed the arrivals
    one pod start + one interval ahead: a bound, not a policy)."""
    from tandem.operator.autoscaler_timer import PoolCounts, autoscale_tick

    trace = load_trace(args.trace, args.time_scale, args.length_scale, args.limit, args.step_shape)
    model = LoadModel(trace, _capacity(args))
    spec = simulation_spec(args, static, predictive=static is None and policy in ("predictive", "oracle"))
    cluster = SimCluster({"prefill": args.capacity_prefill, "decode": args.capacity_decode}, args.startup)
    desired = dict(static) if static else initial_sizes(args, trace)
    for role in ROLES:
        cluster.apply(role, desired[role], -args.startup)  # the starting pods are ready at t=0
    signals = ModelSignals(model)
    arrivals = ArrivalWindow(trace, burst=args.predict_burst)
    status: dict[str, Any] = {r: {"desiredReplicas": desired[r]} for r in ROLES}
    state: dict[str, Any] | None = None
    hpa_history: dict[str, list[tuple[float, int]]] = {r: [] for r in ROLES}
    source = ModelArrivals()
    busy, last_prefilled = True, 0.0  # the prefill queue never emptied since the last tick
    timeline: list[dict[str, Any]] = []
    replica_s = {r: 0.0 for r in ROLES}
    now, next_tick, end = 0.0, 0.0, (trace[-1].arrival_s if trace else 0.0) + args.drain
    while now <= end and not (now > trace[-1].arrival_s and model.done):
        ready = {r: cluster.ready(r, now) for r in ROLES}
        model.step(now, args.dt, ready)
        busy = busy and model.snapshot.queue_requests > ready["prefill"]
        for r in ROLES:
            replica_s[r] += cluster.placed(r) * args.dt
        if now >= next_tick:
            signals.now = now
            events: list[str] = []
            snap = model.snapshot
            counts = {r: PoolCounts(ready[r], max(desired[r] - cluster.capacity[r], 0)) for r in ROLES}
            if policy == "hpa" and static is None:
                values = {"prefill": snap.queue_requests / ready["prefill"] if ready["prefill"] else None,
                          "decode": snap.kv_used_ratio if ready["decode"] else None}
                targets = {"prefill": args.target_queue, "decode": args.target_kv}
                new = {r: min(args.max_replicas, hpa_desired(ready[r], desired[r], values[r], targets[r],
                                                             hpa_history[r], now, args.down_window)) for r in ROLES}
            else:
                if policy in ("predictive", "oracle"):
                    # What the arrival queries would return now (oracle: at the end of the window that ends
                    # when pods placed now are ready and one interval has passed: a bound no causal policy beats).
                    ahead = now + args.startup + args.interval if policy == "oracle" else now
                    tps, slope, rps, mp, mo = arrivals.load(ahead)
                    done = model.prefilled_tokens - last_prefilled
                    seen = done / (ready["prefill"] * args.interval) if busy and ready["prefill"] and now > 0 else None
                    source.set(tps, slope, rps, mp, mo, snap.queue_tokens, len(model.waiting), seen)
                result = autoscale_tick(spec=spec, status=status, namespace="sim", name="sim", counts=counts,
                                        signals=signals, clock=lambda at=now: at, state=state, arrivals=source,
                                        interval_s=args.interval)
                state = result.state
                new = dict(result.desired)
                events = [e.reason for e in result.events]
            last_prefilled, busy = model.prefilled_tokens, True
            for r, n in new.items():
                desired[r] = n
                status[r] = {"desiredReplicas": n}
                cluster.apply(r, n, now)
            timeline.append({"t": round(now, 1), "desired": dict(desired), "ready": ready,
                             "placed": {r: cluster.placed(r) for r in ROLES},
                             "queuePerReplica": round(snap.queue_requests / max(ready["prefill"], 1), 2),
                             "kvUsage": round(snap.kv_used_ratio, 3),
                             "events": events})
            next_tick += args.interval
        now += args.dt
    ok = sum(1 for ttft, itl in model.finished
             if ttft <= args.ttft_slo_ms / 1000 and itl <= args.itl_slo_ms / 1000)
    return {
        "mode": "static" if static else policy,
        "requests": len(trace), "finished": len(model.finished),
        "sloAttainment": round(ok / len(trace), 4) if trace else None,
        "replicaSeconds": {r: round(v) for r, v in replica_s.items()},
        "peak": {r: max(p["placed"][r] for p in timeline) for r in ROLES},
        "simulatedSeconds": round(now, 1),
        "timeline": timeline,
    }


def initial_sizes(args: argparse.Namespace, trace: list[Request]) -> dict[str, int]:
    """Where every autoscaled run starts: 1/1, or with --warm-start the plan for the first
    minute's load (spec replicas set from `tandem plan` for the load at deploy time)."""
    if not args.warm_start:
        return {r: 1 for r in ROLES}
    from tandem.operator.capacity_model import Slo, plan

    _, rps, mp, mo = ArrivalWindow(trace).rate(0.0, 60.0)
    if rps <= 0:
        return {r: 1 for r in ROLES}
    sized = plan(rps, mp, mo, predictive_profile(args), Slo(args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000))
    return {"prefill": min(sized.prefill, args.max_replicas), "decode": min(sized.decode, args.max_replicas)}


def peak_plan(args: argparse.Namespace) -> dict[str, int]:
    """Static provisioning at peak: what `tandem plan` sizes for the trace (its burstiest window)."""
    from tandem.operator.capacity_model import Slo, plan
    from tandem.worker.commands.plan import peak_load

    trace = load_trace(args.trace, args.time_scale, args.length_scale, args.limit, args.step_shape)
    slo = Slo(args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
    load = peak_load([(r.arrival_s, r.prompt, r.output) for r in trace], slo.ttft_s)
    sized = plan(load.rate, load.mean_prompt, load.mean_output, predictive_profile(args), slo)
    return {"prefill": min(sized.prefill, args.capacity_prefill), "decode": min(sized.decode, args.capacity_decode)}


def cheapest_static(args: argparse.Namespace, start: dict[str, int], goal: float) -> dict[str, Any] | None:
    """The static size with the fewest replica-seconds that meets `goal` attainment: the fewest
    prefill with decode generous, the fewest decode with prefill generous, then grow the pair
    until it meets the goal. None when even the pool limits do not."""
    cap = {"prefill": min(args.capacity_prefill, args.max_replicas), "decode": min(args.capacity_decode, args.max_replicas)}
    cache: dict[tuple[int, int], dict[str, Any]] = {}

    def run(p: int, d: int) -> dict[str, Any]:
        if (p, d) not in cache:
            cache[(p, d)] = simulate(args, static={"prefill": p, "decode": d})
        return cache[(p, d)]

    def meets(p: int, d: int) -> bool:
        return float(run(p, d)["sloAttainment"]) >= goal

    if not meets(cap["prefill"], cap["decode"]):
        return None

    def fewest(role: str) -> int:
        lo, hi = 1, cap[role]
        while lo < hi:
            mid = (lo + hi) // 2
            sizes = {**cap, role: mid}
            lo, hi = (lo, mid) if meets(sizes["prefill"], sizes["decode"]) else (mid + 1, hi)
        return lo

    p, d = fewest("prefill"), fewest("decode")
    candidates = [(p, d)]
    while not meets(*candidates[-1]):
        a, b = candidates[-1]
        grow = [(a + 1, b), (a, b + 1)]
        nxt = [c for c in grow if c[0] <= cap["prefill"] and c[1] <= cap["decode"]]
        # Grow the side whose run came closer to the goal with one more replica.
        candidates.append(max(nxt, key=lambda c: (float(run(*c)["sloAttainment"]), -sum(c))))
    best = run(*candidates[-1])
    return best


def _capacity(args: argparse.Namespace) -> Capacity:
    return Capacity(args.prefill_tps, args.kv_tokens, args.itl_base, args.itl_per_seq)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("serve", "simulate"):
        s = sub.add_parser(name)
        s.add_argument("--trace", default="step", help="step, mooncake, azure or a .jsonl/.csv path")
        s.add_argument("--time-scale", type=float, default=1.0, help="divide arrival times by this")
        s.add_argument("--length-scale", type=float, default=1.0, help="multiply token counts by this")
        s.add_argument("--limit", type=float, default=None, help="stop the (scaled) trace after this many s")
        s.add_argument("--step-shape", default=None,
                       help="BASE_RPS,FACTOR,BEFORE_S,DURING_S,AFTER_S for --trace step (default 2,5,120,240,420)")
        s.add_argument("--model", default="sim-model", help="value of the model label")
        s.add_argument("--prefill-tps", type=float, default=Capacity.prefill_tps)
        s.add_argument("--kv-tokens", type=int, default=Capacity.kv_tokens)
        s.add_argument("--itl-base", type=float, default=Capacity.itl_base_s)
        s.add_argument("--itl-per-seq", type=float, default=Capacity.itl_per_seq_s)
    s = sub.choices["serve"]
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--tick", type=float, default=0.25, help="real seconds between model steps")
    s.add_argument("--replicas-file", help='JSON {"prefill": N, "decode": M} re-read every tick')
    s.add_argument("--deployment", action="append", default=[], help="ROLE=NS/NAME, read readyReplicas")
    s.add_argument("--kubeconfig", default=None)
    s = sub.choices["simulate"]
    s.add_argument("--interval", type=float, default=15.0, help="autoscaler interval, simulated s")
    s.add_argument("--dt", type=float, default=0.25, help="model step, simulated s")
    s.add_argument("--startup", type=float, default=30.0, help="pod placement to ready, simulated s")
    s.add_argument("--drain", type=float, default=120.0, help="simulated s after the last arrival")
    s.add_argument("--capacity-prefill", type=int, default=32, help="pods the prefill nodes can hold")
    s.add_argument("--capacity-decode", type=int, default=64, help="pods the decode nodes can hold")
    s.add_argument("--max-replicas", type=int, default=24)
    s.add_argument("--down-window", type=int, default=300)
    s.add_argument("--target-queue", type=float, default=2.0)
    s.add_argument("--target-kv", type=float, default=0.75)
    s.add_argument("--ttft-slo-ms", type=int, default=3000)
    s.add_argument("--itl-slo-ms", type=int, default=50)
    s.add_argument("--min-ratio", type=float, default=0.25)
    s.add_argument("--max-ratio", type=float, default=4.0)
    s.add_argument("--profile-error", type=float, default=1.0,
                   help="the predictive policy's profile has prefill throughput x this (tests self-correction)")
    s.add_argument("--predict-down-window", type=float, default=120.0, help="predictive: scale-down window, s")
    s.add_argument("--predict-burst", action=argparse.BooleanOptionalAction, default=True,
                   help="predictive: size for the busiest quarter of the rate window, not its mean")
    s.add_argument("--warm-start", action="store_true",
                   help="autoscaled runs start at the plan for the first minute's load, not at 1/1")
    s.add_argument("--slo-goal", type=float, default=0.99, help="attainment the cheapest static size must reach")
    s.add_argument("--json", default=None, help="write every run, with timelines, here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        if not args.replicas_file and not args.deployment:
            raise SystemExit("serve needs --replicas-file or --deployment ROLE=NS/NAME")
        serve(args)
        return
    runs = compare(args)
    total_peak = sum(runs[0]["replicaSeconds"].values())
    rows = [("mode", "SLO attainment", "prefill replica-s", "decode replica-s", "vs static at peak", "peak P/D")]
    for run in runs:
        if run.get("unmet"):
            rows.append((run["mode"], "(none meets it)", "-", "-", "-", "-"))
            continue
        cost = sum(run["replicaSeconds"].values())
        rows.append((run["mode"], f"{run['sloAttainment']:.1%}", str(run["replicaSeconds"]["prefill"]),
                     str(run["replicaSeconds"]["decode"]), f"{cost / total_peak:.2f}",
                     f"{run['peak']['prefill']}/{run['peak']['decode']}"))
    for row in rows:
        print("  ".join(f"{c:>18}" for c in row))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every mode on one trace: static at peak, the cheapest static meeting the goal, a plain
    HPA, the operator's current (reactive) policy, the predictive policy and its oracle bound."""
    peak = peak_plan(args)
    at_peak = simulate(args, static=peak)
    at_peak["mode"] = "static at peak"
    cheapest = cheapest_static(args, peak, args.slo_goal)
    if cheapest is None:
        cheapest = {"mode": f"cheapest static >= {args.slo_goal:.0%}", "unmet": True}
    else:
        cheapest["mode"] = f"cheapest static >= {args.slo_goal:.0%}"
    runs = [at_peak, cheapest]
    for policy, label in (("hpa", "HPA (queue, KV)"), ("current", "current policy"), ("predictive", "predictive"),
                          ("oracle", "oracle (45 s ahead)")):
        run = simulate(args, policy=policy)
        run["mode"] = label
        runs.append(run)
    return runs

if __name__ == "__main__":
    main()
