"""Every PromQL expression Tandem ships, read back from the generated files.

The dashboards (charts/tandem/dashboards/*.json) and the rules (deploy/prometheus/tandem-rules.yaml)
are what users load, so the inventory reads those files rather than the generators. Tests use it
to check each expression parses (promtool) and, against a real Prometheus scraping real workers,
that it returns data.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tandem.worker import metrics as m

REPO = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = REPO / "charts" / "tandem" / "dashboards"
RULES_FILE = REPO / "deploy" / "prometheus" / "tandem-rules.yaml"

_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$", re.S)
_METRIC_TOKEN = re.compile(r"\btandem_[a-z0-9_]+\b")
_RECORD_TOKEN = re.compile(r"\btandem:[a-z0-9_]+:[a-z0-9_]+\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")
_OPERATOR_NAMES = {metric.name for metric in m.ALL_OPERATOR_METRICS}
_WORKER_NAMES = {metric.name for metric in (*m.ALL_WORKER_METRICS, *m.ROUTER_ONLY_METRICS)}  # the model's pods


@dataclass(frozen=True)
class PromQL:
    source: str  # file and where in it, for error messages
    kind: str  # panel | variable | record | alert
    expr: str  # as written, Grafana variables included

    def metric_names(self) -> set[str]:
        """Base names (no _total/_bucket/...) of the tandem_ metrics the expression reads."""
        names = set()
        for token in _METRIC_TOKEN.findall(self.expr):
            for suffix in _SUFFIXES:
                if token.endswith(suffix) and token[: -len(suffix)] in _OPERATOR_NAMES | _WORKER_NAMES:
                    token = token[: -len(suffix)]
                    break
            names.add(token)
        return names

    def recorded_names(self) -> set[str]:
        """Recording-rule names (level:metric:operations) the expression reads."""
        return set(_RECORD_TOKEN.findall(self.expr))

    def needs(self, records: dict[str, set[str]] | None = None) -> set[str]:
        """Which components (worker, operator) must be scraped for the expression to return data.

        `records` maps recording-rule names to their own needs (see `record_needs`).
        """
        parts = set()
        for name in self.metric_names():
            if name in _OPERATOR_NAMES:
                parts.add("operator")
            elif name in _WORKER_NAMES:
                parts.add("worker")
        for record in self.recorded_names():
            parts |= (records or {}).get(record, set())
        return parts


def record_needs(queries: list[PromQL]) -> dict[str, set[str]]:
    """Recording-rule name -> the components its expression reads."""
    return {q.source.rsplit(" ", 1)[1]: q.needs() for q in queries if q.kind == "record"}


def dashboard_queries(path: Path) -> list[PromQL]:
    board: dict[str, Any] = json.loads(path.read_text())
    found = []
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text.strip())
        # label_values(selector, label) is Grafana's; the selector is the PromQL part.
        expr = match.group("selector") if match else text
        found.append(PromQL(f"{path.name} variable ${variable['name']}", "variable", expr))
    for panel in board.get("panels", []):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append(PromQL(f"{path.name} panel {panel['title']!r} {target.get('refId', '')}",
                                    "panel", target["expr"]))
    return found


def rule_queries(path: Path = RULES_FILE) -> list[PromQL]:
    document = yaml.safe_load(path.read_text())
    found = []
    for group in document["groups"]:
        for rule in group["rules"]:
            kind = "record" if "record" in rule else "alert"
            name = rule.get("record") or rule["alert"]
            found.append(PromQL(f"{path.name} {group['name']} {name}", kind, rule["expr"]))
    return found


def all_queries() -> list[PromQL]:
    queries = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        queries.extend(dashboard_queries(path))
    queries.extend(rule_queries())
    return queries


def render(expr: str, variables: dict[str, str] | None = None, rate_interval: str = "1m") -> str:
    """Replace Grafana's variables so Prometheus can run the expression.

    Unset template variables become `.*` (Grafana's "All"), `$__rate_interval` the given window.
    """
    values = {"__rate_interval": rate_interval, "__interval": rate_interval, **(variables or {})}

    def substitute(match: re.Match[str]) -> str:
        return values.get(match.group(1) or match.group(2), ".*")

    # Names start with a letter or _, so label_replace's "$1" is left alone.
    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", substitute, expr)


def _exposed_names() -> set[str]:
    names = set()
    for metric in (*m.ALL_WORKER_METRICS, *m.ROUTER_ONLY_METRICS, *m.ALL_OPERATOR_METRICS):
        if metric.kind == "histogram":
            names |= {f"{metric.name}{suffix}" for suffix in ("_bucket", "_count", "_sum")}
        else:
            names.add(m.exposed_name(metric))
    return names


_SELECTOR = re.compile(r"\b(tandem_[a-z0-9_]+)(\{[^}]*\})?")


def selectors(expr: str) -> list[str]:
    """The metric selectors (`name{matchers}`) inside an expression, in order, without repeats.

    Running each on its own tells a label mismatch (empty selector) from a healthy expression
    that is empty only because nothing is wrong (an alert that does not fire).
    """
    known = _exposed_names()
    found: list[str] = []
    for match in _SELECTOR.finditer(expr):
        if match.group(1) in known and match.group(0) not in found:
            found.append(match.group(0))
    return found
