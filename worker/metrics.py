"""Every metric name and label Tandem exports, in one place.

Workers and the router register their collectors from here; the autoscaler's PromQL, the
Grafana dashboards and the alert rules are generated from the same names, so a rename here
shows up everywhere (and a typo fails a test rather than an on-call shift).

This module imports only prometheus_client, so the operator and generators can use the names
without pulling in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "tandem"

# Labels carried by every worker/router series. `pool` is the Deployment-level pool name
# (prefill/decode/router, or `local` under `tandem serve`), `role` the engine role.
LABEL_MODEL = "model"
LABEL_ROLE = "role"
LABEL_POOL = "pool"
COMMON_LABELS = (LABEL_MODEL, LABEL_ROLE, LABEL_POOL)
# Extra labels on specific families.
LABEL_TRANSPORT = "transport"
LABEL_REASON = "reason"
LABEL_DIRECTION = "direction"  # send | recv
LABEL_WORKER = "worker"  # a prefill worker's URL as the router reaches it (router series only)
# Not set by the process: the scrape adds it from the pod label tandem.dev/model (the DisaggregatedModel's
# name; the chart's PodMonitor podTargetLabels, or a kubernetes_sd labelmap). It tells apart two resources
# that serve the same model name in one namespace, which `model` cannot.
LABEL_RESOURCE = "tandem_dev_model"


@dataclass(frozen=True)
class MetricDef:
    name: str  # full exposition name without _total/_bucket suffixes
    kind: str  # gauge | counter | histogram | info
    help: str
    labels: tuple[str, ...] = COMMON_LABELS
    buckets: tuple[float, ...] | None = None


LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# --- queue and scheduler state (gauges) ---
PREFILL_QUEUE_REQUESTS = MetricDef(
    f"{PREFIX}_prefill_queue_requests", "gauge",
    "Requests waiting for or in prefill on this worker (the prefill autoscaling signal).")
PREFILL_QUEUE_TOKENS = MetricDef(
    f"{PREFIX}_prefill_queue_tokens", "gauge",
    "Prompt tokens not yet prefilled on this worker.")
RUNNING_REQUESTS = MetricDef(
    f"{PREFIX}_running_requests", "gauge", "Requests in the running batch.")
WAITING_REQUESTS = MetricDef(
    f"{PREFIX}_waiting_requests", "gauge", "Requests admitted but waiting for KV or a batch slot.")
KV_USAGE_RATIO = MetricDef(
    f"{PREFIX}_kv_cache_usage_ratio", "gauge",
    "Fraction of KV-cache blocks in use, 0..1 (the decode autoscaling signal).")
KV_FREE_BLOCKS = MetricDef(f"{PREFIX}_kv_cache_free_blocks", "gauge", "Free KV-cache blocks.")
KV_TOTAL_BLOCKS = MetricDef(f"{PREFIX}_kv_cache_total_blocks", "gauge", "KV-cache blocks in the pool.")

# --- latency (histograms, seconds) ---
TTFT = MetricDef(f"{PREFIX}_time_to_first_token_seconds", "histogram",
                 "Time from request arrival to its first token.", buckets=LATENCY_BUCKETS)
ITL = MetricDef(f"{PREFIX}_inter_token_latency_seconds", "histogram",
                "Time between consecutive output tokens of a request.", buckets=ITL_BUCKETS)
E2E = MetricDef(f"{PREFIX}_e2e_request_latency_seconds", "histogram",
                "Time from request arrival to its last token.", buckets=LATENCY_BUCKETS)

# --- token and request counters ---
PROMPT_TOKENS = MetricDef(f"{PREFIX}_prompt_tokens", "counter", "Prompt tokens processed.")
GENERATION_TOKENS = MetricDef(f"{PREFIX}_generation_tokens", "counter", "Tokens generated.")
REQUESTS = MetricDef(f"{PREFIX}_requests", "counter", "Finished requests, by finish reason.",
                     labels=(*COMMON_LABELS, LABEL_REASON))
PREFIX_CACHE_QUERIES = MetricDef(f"{PREFIX}_prefix_cache_queries", "counter",
                                 "Prompt tokens looked up in the prefix cache.")
PREFIX_CACHE_HITS = MetricDef(f"{PREFIX}_prefix_cache_hits", "counter",
                              "Prompt tokens found in the prefix cache.")
PREEMPTIONS = MetricDef(f"{PREFIX}_preemptions", "counter",
                        "Requests preempted for lack of KV blocks (freed, to be recomputed later).")

# --- KV transfer ---
KV_TRANSFER_BYTES = MetricDef(f"{PREFIX}_kv_transfer_bytes", "counter", "KV bytes moved between workers.",
                              labels=(*COMMON_LABELS, LABEL_TRANSPORT, LABEL_DIRECTION))
KV_TRANSFER_SECONDS = MetricDef(f"{PREFIX}_kv_transfer_seconds", "histogram",
                                "Duration of one request's KV transfer.",
                                labels=(*COMMON_LABELS, LABEL_TRANSPORT, LABEL_DIRECTION),
                                buckets=TRANSFER_BUCKETS)
KV_TRANSFER_FAILURES = MetricDef(f"{PREFIX}_kv_transfer_failures", "counter",
                                 "KV transfers that failed or timed out, by reason.",
                                 labels=(*COMMON_LABELS, LABEL_TRANSPORT, LABEL_REASON))
KV_TRANSPORT_INFO = MetricDef(f"{PREFIX}_kv_transport", "gauge",
                              "1 for the KV transport this worker selected (auto picks rdma or tcp).",
                              labels=(*COMMON_LABELS, LABEL_TRANSPORT))
KV_RECEIVER_REFUSALS = MetricDef(
    f"{PREFIX}_kv_receiver_refusals", "counter",
    "Peers a KV receiver refused or disconnected for going over one of its limits, by reason "
    "(too_many_sessions|peer_sessions|peer_connections|bytes_in_flight|dropped).",
    labels=(*COMMON_LABELS, LABEL_TRANSPORT, LABEL_REASON))
FALLBACK_PREFILLS = MetricDef(f"{PREFIX}_fallback_prefills", "counter",
                              "Requests prefilled locally on decode after a failed KV transfer.")
MIGRATIONS = MetricDef(f"{PREFIX}_migrations", "counter",
                       "Requests moved to another decode worker mid-stream (router).")

# --- router edge (the router only) ---
ROUTER_AUTH_FAILURES = MetricDef(f"{PREFIX}_router_auth_failures", "counter",
                                 "Requests refused with 401: no API key (reason missing) or a wrong one (invalid).",
                                 labels=(*COMMON_LABELS, LABEL_REASON))
ROUTER_OVERLOADED = MetricDef(f"{PREFIX}_router_overloaded_requests", "counter",
                              "Requests refused with 429 because the router was full: every place taken "
                              "(queue_full) or no running slot freed in time (queue_timeout).",
                              labels=(*COMMON_LABELS, LABEL_REASON))
ROUTER_ACTIVE_REQUESTS = MetricDef(f"{PREFIX}_router_active_requests", "gauge",
                                   "Requests holding one of the router's running slots (--max-concurrent-requests).")
ROUTER_CANARY_PROBES = MetricDef(
    f"{PREFIX}_router_canary_probes", "counter",
    "The router's output canary (router/canary.py): one greedy probe prefilled locally and disaggregated on the "
    "same decode worker, by result (match|mismatch|skipped|error). A mismatch means wrong output without an error.",
    labels=(*COMMON_LABELS, "result"))
# When the canary's mismatches count as wrong output: at least this many in this window. Shared by the alert
# TandemOutputMismatch (hack/monitoring_config.py) and the operator's OutputVerified condition
# (operator/output_check.py). One could be a near-tie flipped by a different batch shape on a GPU; a wrong KV
# path mismatches on every probe.
CANARY_MISMATCH_WINDOW = "30m"
CANARY_MISMATCH_THRESHOLD = 2
# The router's picture of each prefill worker's prefix cache (router/prefix_index.py), per worker and counted
# when a prefill answers: hit rate = expected hits / prompt tokens. Against the worker's own
# tandem_prefix_cache_hits_total (what its cache really served) it shows whether the picture is right.
ROUTER_PREFILL_PROMPT_TOKENS = MetricDef(
    f"{PREFIX}_router_prefill_prompt_tokens", "counter",
    "Prompt tokens of the prefills this router placed, by the prefill worker that computed them.",
    labels=(*COMMON_LABELS, LABEL_WORKER))
ROUTER_PREFIX_EXPECTED_HITS = MetricDef(
    f"{PREFIX}_router_prefix_expected_hit_tokens", "counter",
    "Prompt tokens of those prefills the router expected that worker's prefix cache to serve (its picture of the "
    "cache when it placed them: whole blocks, never a prompt's last token, as the engine looks up).",
    labels=(*COMMON_LABELS, LABEL_WORKER))
ROUTER_QUEUED_REQUESTS = MetricDef(f"{PREFIX}_router_queued_requests", "gauge",
                                   "Admitted requests not yet holding a running slot: reading their body, being "
                                   "tokenized or waiting (--max-queued-requests).")

# --- worker health ---
WORKER_READY = MetricDef(f"{PREFIX}_worker_ready", "gauge", "1 when the worker accepts requests.")

# --- worker control credential (worker/server/control_auth.py) ---
CONTROL_AUTH_FAILURES = MetricDef(
    f"{PREFIX}_control_auth_failures", "counter",
    "Calls refused with 401 for a missing or wrong worker control token (the worker's control routes, "
    "the router's /workers), by reason (missing|invalid).",
    labels=(*COMMON_LABELS, LABEL_REASON))
CONTROL_AUTH_REASONS = ("missing", "invalid")

ALL_WORKER_METRICS = (
    PREFILL_QUEUE_REQUESTS, PREFILL_QUEUE_TOKENS, RUNNING_REQUESTS, WAITING_REQUESTS,
    KV_USAGE_RATIO, KV_FREE_BLOCKS, KV_TOTAL_BLOCKS, TTFT, ITL, E2E, PROMPT_TOKENS,
    GENERATION_TOKENS, REQUESTS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREEMPTIONS, KV_TRANSFER_BYTES,
    KV_TRANSFER_SECONDS, KV_TRANSFER_FAILURES, KV_RECEIVER_REFUSALS, KV_TRANSPORT_INFO, FALLBACK_PREFILLS, MIGRATIONS,
    WORKER_READY, CONTROL_AUTH_FAILURES,
)

# Series only the router exports (it exports some of the above too: TTFT, tokens, requests, migrations). For the
# dashboards and rules they come from the same scrape as the workers': the model's pods.
ROUTER_ONLY_METRICS = (
    ROUTER_AUTH_FAILURES, ROUTER_OVERLOADED, ROUTER_ACTIVE_REQUESTS, ROUTER_QUEUED_REQUESTS, ROUTER_CANARY_PROBES,
    ROUTER_PREFILL_PROMPT_TOKENS, ROUTER_PREFIX_EXPECTED_HITS,
)

# --- operator / autoscaler (label `pool` is prefill|decode, `namespace` and `name` the resource) ---
LABEL_NAMESPACE = "namespace"
LABEL_NAME = "name"
OPERATOR_LABELS = (LABEL_NAMESPACE, LABEL_NAME, LABEL_POOL)
AUTOSCALER_DESIRED = MetricDef(f"{PREFIX}_autoscaler_desired_replicas", "gauge",
                               "Replicas the autoscaler wants for a pool.", labels=OPERATOR_LABELS)
AUTOSCALER_CURRENT = MetricDef(f"{PREFIX}_autoscaler_current_replicas", "gauge",
                               "Replicas a pool has now.", labels=OPERATOR_LABELS)
AUTOSCALER_SIGNAL = MetricDef(f"{PREFIX}_autoscaler_signal", "gauge",
                              "The pool's scaling signal (queue depth or KV usage).", labels=OPERATOR_LABELS)
AUTOSCALER_TARGET = MetricDef(f"{PREFIX}_autoscaler_target", "gauge",
                              "The pool's target for its signal.", labels=OPERATOR_LABELS)
AUTOSCALER_MAX = MetricDef(f"{PREFIX}_autoscaler_max_replicas", "gauge",
                           "The pool's maxReplicas (so alerts can tell a pool at its ceiling).",
                           labels=OPERATOR_LABELS)
AUTOSCALER_SCALE_EVENTS = MetricDef(f"{PREFIX}_autoscaler_scale_events", "counter",
                                    "Scale changes made by the autoscaler.",
                                    labels=(*OPERATOR_LABELS, "direction"))
RECONCILE_ERRORS = MetricDef(f"{PREFIX}_operator_reconcile_errors", "counter",
                             "Reconcile attempts that raised.", labels=(LABEL_NAMESPACE, LABEL_NAME))
RECONCILES = MetricDef(f"{PREFIX}_operator_reconciles", "counter",
                       "Reconcile attempts.", labels=(LABEL_NAMESPACE, LABEL_NAME))

ALL_OPERATOR_METRICS = (
    AUTOSCALER_DESIRED, AUTOSCALER_CURRENT, AUTOSCALER_SIGNAL, AUTOSCALER_TARGET, AUTOSCALER_MAX,
    AUTOSCALER_SCALE_EVENTS, RECONCILE_ERRORS, RECONCILES,
)


def exposed_name(metric: MetricDef) -> str:
    """Name as it appears in PromQL: counters get _total (prometheus_client adds it)."""
    return f"{metric.name}_total" if metric.kind == "counter" else metric.name
