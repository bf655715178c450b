#!/usr/bin/env python3
"""Generate Tandem's Grafana dashboards with grafana-foundation-sdk.

Writes charts/tandem/dashboards/<uid>.json; the chart ships each one as a ConfigMap carrying the
Grafana sidecar label. Every PromQL string comes from hack/monitoring_config.py and the metric
definitions in tandem.worker.metrics.

    python hack/gen_dashboards.py           # rewrite the JSON files
    python hack/gen_dashboards.py --check   # exit 1 if a committed file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

try:
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DataSourceRef,
        VariableHide,
        VariableRefresh,
        VariableSort,
    )
except ModuleNotFoundError as exc:  # a dev-only dependency: say how to get it
    raise ModuleNotFoundError(
        "hack/gen_dashboards.py needs grafana-foundation-sdk: "
        "pip install 'grafana-foundation-sdk==1769699998!10.1.0'", name=exc.name) from exc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import monitoring_config as cfg

from tandem.worker import metrics as m

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "charts" / "tandem" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: Sequence[Query]
    width: int = 12
    bars: bool = False
    soft_max: float | None = None


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: Sequence[PanelSpec] = field(default_factory=tuple)


# --- selectors for the template variables ---

def worker_selector(*extra: cfg.Matcher) -> list[cfg.Matcher]:
    return [cfg.regex("namespace", "$namespace"), cfg.regex(m.LABEL_MODEL, "$model"), *extra]


def resource_selector(*extra: cfg.Matcher) -> list[cfg.Matcher]:
    """Operator series are per DisaggregatedModel (`name`), selected by the `resource` variable."""
    return [cfg.regex("namespace", "$namespace"), cfg.regex(m.LABEL_NAME, "$resource"), *extra]


def quantile(q: float, metric: m.MetricDef, group: Sequence[str], matchers: list[cfg.Matcher]) -> str:
    bucket = cfg.series(metric, "_bucket", matchers)
    return f"histogram_quantile({q:g}, sum {cfg.by(['le', *group])} (rate({bucket}[{RATE}])))"


def rate_sum(metric: m.MetricDef, group: Sequence[str], matchers: list[cfg.Matcher], suffix: str = "") -> str:
    return f"sum {cfg.by(group)} (rate({cfg.series(metric, suffix, matchers)}[{RATE}]))"


def latency_panel(title: str, metric: m.MetricDef, description: str) -> PanelSpec:
    sel = worker_selector()
    return PanelSpec(title, description, "s", [
        Query(quantile(0.5, metric, [m.LABEL_ROLE], sel), "p50 {{role}}"),
        Query(quantile(0.99, metric, [m.LABEL_ROLE], sel), "p99 {{role}}"),
    ])


def overview_rows() -> list[RowSpec]:
    sel = worker_selector()
    by_pool = [m.LABEL_POOL]
    scaled = cfg.regex(m.LABEL_POOL, cfg.SCALED_POOLS)
    return [
        RowSpec("Traffic", [
            PanelSpec("Request rate", "Finished requests per second, by pool and finish reason.", "reqps", [
                Query(rate_sum(m.REQUESTS, [m.LABEL_POOL, m.LABEL_REASON], sel), "{{pool}} {{reason}}"),
            ]),
            PanelSpec("Token throughput", "Prompt tokens prefilled and tokens generated per second.",
                      "short", [
                          Query(rate_sum(m.PROMPT_TOKENS, by_pool, sel), "prompt {{pool}}"),
                          Query(rate_sum(m.GENERATION_TOKENS, by_pool, sel), "generated {{pool}}"),
                      ]),
        ]),
        RowSpec("Latency", [
            latency_panel("Time to first token (p50 / p99)", m.TTFT,
                          "Request arrival to first token, by the role that measured it. "
                          "Governed by the prefill tier."),
            latency_panel("Inter-token latency (p50 / p99)", m.ITL,
                          "Gap between consecutive output tokens, by role. Governed by the decode tier; "
                          "in disaggregated mode p99 should stay near p50."),
        ]),
        RowSpec("Load", [
            PanelSpec("Prefill queue depth", "Requests and prompt tokens waiting for prefill, per pool "
                      "(the prefill autoscaling signal is the request count).", "short", [
                          Query(f"sum {cfg.by(by_pool)} ({cfg.series(m.PREFILL_QUEUE_REQUESTS, matchers=sel)})",
                                "requests {{pool}}"),
                          Query(f"sum {cfg.by(by_pool)} ({cfg.series(m.PREFILL_QUEUE_TOKENS, matchers=sel)})",
                                "tokens {{pool}}"),
                      ]),
            PanelSpec("KV-cache usage", "Fraction of KV blocks in use per worker (the decode autoscaling "
                      "signal), and the pool average.", "percentunit", [
                          Query(f"max {cfg.by([m.LABEL_POOL, 'instance'])} "
                                f"({cfg.series(m.KV_USAGE_RATIO, matchers=sel)})", "{{pool}} {{instance}}"),
                          Query(f"avg {cfg.by(by_pool)} ({cfg.series(m.KV_USAGE_RATIO, matchers=sel)})",
                                "{{pool}} average"),
                      ], soft_max=1.0),
            PanelSpec("Running and waiting requests", "Requests in the running batch and admitted requests "
                      "waiting for KV or a batch slot.", "short", [
                          Query(f"sum {cfg.by(by_pool)} ({cfg.series(m.RUNNING_REQUESTS, matchers=sel)})",
                                "running {{pool}}"),
                          Query(f"sum {cfg.by(by_pool)} ({cfg.series(m.WAITING_REQUESTS, matchers=sel)})",
                                "waiting {{pool}}"),
                      ], width=24),
        ]),
        RowSpec("Replicas", [
            PanelSpec("Replicas: desired, current and ready, per pool",
                      "Desired and current come from the operator's autoscaler; ready counts workers "
                      "reporting ready.", "short", [
                          Query(f"max {cfg.by(by_pool)} "
                                f"({cfg.series(m.AUTOSCALER_DESIRED, matchers=resource_selector(scaled))})",
                                "desired {{pool}}"),
                          Query(f"max {cfg.by(by_pool)} "
                                f"({cfg.series(m.AUTOSCALER_CURRENT, matchers=resource_selector(scaled))})",
                                "current {{pool}}"),
                          Query(f"sum {cfg.by(by_pool)} "
                                f"({cfg.series(m.WORKER_READY, matchers=worker_selector(scaled))})",
                                "ready {{pool}}"),
                      ], width=24),
        ]),
        RowSpec("KV transfer", [
            PanelSpec("KV transfer throughput", "Bytes per second moved between prefill and decode "
                      "(Grafana shows GB/s), by transport and direction.", "Bps", [
                          Query(rate_sum(m.KV_TRANSFER_BYTES, [m.LABEL_TRANSPORT, m.LABEL_DIRECTION], sel),
                                "{{transport}} {{direction}}"),
                      ], width=8),
            PanelSpec("KV transfer duration (p50 / p99)", "Time to move one request's KV.", "s", [
                Query(quantile(0.5, m.KV_TRANSFER_SECONDS, [m.LABEL_TRANSPORT, m.LABEL_DIRECTION], sel),
                      "p50 {{transport}} {{direction}}"),
                Query(quantile(0.99, m.KV_TRANSFER_SECONDS, [m.LABEL_TRANSPORT, m.LABEL_DIRECTION], sel),
                      "p99 {{transport}} {{direction}}"),
            ], width=8),
            PanelSpec("KV transfer failures and fallbacks", "Failed transfers by reason, and the requests "
                      "decode prefilled itself after one.", "reqps", [
                          Query(rate_sum(m.KV_TRANSFER_FAILURES, [m.LABEL_TRANSPORT, m.LABEL_REASON], sel),
                                "failed {{transport}} {{reason}}"),
                          Query(rate_sum(m.FALLBACK_PREFILLS, by_pool, sel), "fallback prefill {{pool}}"),
                          Query(rate_sum(m.MIGRATIONS, by_pool, sel), "migrated {{pool}}"),
                      ], width=8),
        ]),
        RowSpec("Prefix cache", [
            PanelSpec("Prefix-cache hit rate", "Share of prompt tokens found in the prefix cache, per pool "
                      "and per worker (the router's prefix placement is what keeps it high on every worker), "
                      "and what the router expected each worker to serve (its picture of their caches).",
                      "percentunit", [
                          Query(f"{rate_sum(m.PREFIX_CACHE_HITS, by_pool, sel)}\n/\n"
                                f"{rate_sum(m.PREFIX_CACHE_QUERIES, by_pool, sel)}", "{{pool}}"),
                          Query(f"{rate_sum(m.PREFIX_CACHE_HITS, [m.LABEL_POOL, 'instance'], sel)}\n/\n"
                                f"{rate_sum(m.PREFIX_CACHE_QUERIES, [m.LABEL_POOL, 'instance'], sel)}",
                                "{{pool}} {{instance}}"),
                          # What the router expected each worker's cache to serve, on the worker's instance
                          # label: far above the worker's own line, the router's picture is wrong.
                          Query(f"label_replace(\n{rate_sum(m.ROUTER_PREFIX_EXPECTED_HITS, ['worker'], sel)}\n/\n"
                                f"{rate_sum(m.ROUTER_PREFILL_PROMPT_TOKENS, ['worker'], sel)},\n"
                                '"instance", "$1", "worker", "https?://(.+)")', "router expects {{instance}}"),
                      ], soft_max=1.0),
            PanelSpec("Prompt tokens per worker", "Prompt tokens prefilled per second by each worker: how evenly "
                      "the router's placement spreads the prompts (--placement-balance bounds max/mean).",
                      "short", [
                          Query(rate_sum(m.PROMPT_TOKENS, [m.LABEL_POOL, 'instance'], sel), "{{pool}} {{instance}}"),
                      ]),
        ]),
    ]


def operator_rows() -> list[RowSpec]:
    sel = resource_selector()
    per_resource = ["namespace", m.LABEL_NAME]
    per_pool = [*per_resource, m.LABEL_POOL]

    def signal_panel(pool: str, title: str, unit: str) -> PanelSpec:
        pool_sel = resource_selector(cfg.eq(m.LABEL_POOL, pool))
        return PanelSpec(title, f"The {pool} pool's scaling signal against its target.", unit, [
            Query(f"max {cfg.by(per_resource)} ({cfg.series(m.AUTOSCALER_SIGNAL, matchers=pool_sel)})",
                  "signal {{namespace}}/{{name}}"),
            Query(f"max {cfg.by(per_resource)} ({cfg.series(m.AUTOSCALER_TARGET, matchers=pool_sel)})",
                  "target {{namespace}}/{{name}}"),
        ])

    return [
        RowSpec("Reconciles", [
            PanelSpec("Reconciles", "Reconcile attempts per second.", "ops", [
                Query(rate_sum(m.RECONCILES, per_resource, sel), "{{namespace}}/{{name}}"),
            ]),
            PanelSpec("Reconcile errors", "Reconcile attempts that raised, per second.", "ops", [
                Query(rate_sum(m.RECONCILE_ERRORS, per_resource, sel), "{{namespace}}/{{name}}"),
            ]),
        ]),
        RowSpec("Autoscaler", [
            signal_panel("prefill", "Prefill: queue depth vs target", "short"),
            signal_panel("decode", "Decode: KV-cache usage vs target", "percentunit"),
            PanelSpec("Replicas: desired vs current", "What the autoscaler wants and what each pool has.",
                      "short", [
                          Query(f"max {cfg.by(per_pool)} ({cfg.series(m.AUTOSCALER_DESIRED, matchers=sel)})",
                                "desired {{name}} {{pool}}"),
                          Query(f"max {cfg.by(per_pool)} ({cfg.series(m.AUTOSCALER_CURRENT, matchers=sel)})",
                                "current {{name}} {{pool}}"),
                      ]),
            PanelSpec("Scale events", "Scale changes made by the autoscaler, by direction.", "short", [
                Query(f"sum {cfg.by([*per_pool, m.LABEL_DIRECTION])} "
                      f"(increase({cfg.series(m.AUTOSCALER_SCALE_EVENTS, matchers=sel)}[{RATE}]))",
                      "{{name}} {{pool}} {{direction}}"),
            ], bars=True),
        ]),
    ]


def _panel(spec: PanelSpec) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(spec.width)
        .height(8)
        .fill_opacity(10)
        .legend(common_builders.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
                .calcs(["lastNotNull", "max"]))
    )
    if spec.bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS)
    if spec.soft_max is not None:
        panel = panel.axis_soft_min(0).axis_soft_max(spec.soft_max)
    for index, query in enumerate(spec.queries):
        panel = panel.with_target(
            prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(chr(ord("A") + index))
        )
    return panel


def _query_variable(name: str, label: str, metric: m.MetricDef, label_name: str,
                    matchers: Sequence[cfg.Matcher] = (), hidden: bool = False) -> dash.QueryVariable:
    variable = (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({cfg.series(metric, matchers=matchers)}, {label_name})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )
    return variable.hide(VariableHide.HIDE_VARIABLE) if hidden else variable


def _dashboard(uid: str, title: str, description: str, rows: list[RowSpec],
               variables: list[dash.QueryVariable]) -> dash.Dashboard:
    board = (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["tandem"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .with_variable(dash.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for variable in variables:
        board = board.with_variable(variable)
    next_id = 1  # Grafana links and edits panels by id, so each gets a stable, unique one
    for row in rows:
        board = board.with_row(dash.Row(row.title).id(next_id))
        next_id += 1
        for spec in row.panels:
            board = board.with_panel(_panel(spec).id(next_id))
            next_id += 1
    return board


def dashboards() -> dict[str, dash.Dashboard]:
    """uid -> dashboard builder."""
    in_namespace = cfg.regex("namespace", "$namespace")
    namespace = _query_variable("namespace", "Namespace", m.WORKER_READY, "namespace")
    model = _query_variable("model", "Model", m.WORKER_READY, m.LABEL_MODEL, [in_namespace])
    # The DisaggregatedModel(s) serving $model, for the operator's per-resource series.
    served_by = _query_variable("resource", "DisaggregatedModel", m.WORKER_READY, cfg.RESOURCE_TARGET_LABEL,
                                [in_namespace, cfg.regex(m.LABEL_MODEL, "$model")], hidden=True)
    op_namespace = _query_variable("namespace", "Namespace", m.RECONCILES, "namespace")
    op_resource = _query_variable("resource", "DisaggregatedModel", m.RECONCILES, m.LABEL_NAME, [in_namespace])
    return {
        "tandem-overview": _dashboard(
            "tandem-overview", "Tandem / Model overview",
            "One served model: traffic, TTFT and ITL by role, queues, KV usage, replicas, KV transfer "
            "and the prefix cache.", overview_rows(), [namespace, model, served_by]),
        "tandem-operator": _dashboard(
            "tandem-operator", "Tandem / Operator and autoscaler",
            "Reconciles and their errors, scale events, and each pool's signal against its target.",
            operator_rows(), [op_namespace, op_resource]),
    }


def render(board: dash.Dashboard) -> str:
    return json.dumps(board.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def rendered_files() -> dict[Path, str]:
    return {OUT_DIR / f"{uid}.json": render(board) for uid, board in dashboards().items()}


def stale_outputs() -> list[Path]:
    files = rendered_files()
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    extra = [path for path in OUT_DIR.glob("*.json") if path not in files]
    return stale + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_outputs()
        for path in stale:
            print(f"stale: {path.relative_to(REPO)} (run python hack/gen_dashboards.py)", file=sys.stderr)
        return 1 if stale else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for path, text in rendered_files().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
