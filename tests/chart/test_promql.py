"""Every PromQL expression in the dashboards and rules is found, and every one parses."""

from __future__ import annotations

import json
from pathlib import Path

import promql_inventory as inventory
import yaml
from chart_helpers import promtool_binary, run


def parse_errors(exprs: list[str], tmp_path: Path) -> str:
    """promtool's complaints about the expressions (empty when all parse), via a rules file."""
    rules = [{"record": f"tandem:check:{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    proc = run([promtool_binary(), "check", "rules", str(path)])
    return "" if proc.returncode == 0 else proc.stdout + proc.stderr


def test_inventory_finds_every_panel_query_variable_and_rule() -> None:
    queries = inventory.all_queries()
    expected_panels = 0
    for path in inventory.DASHBOARD_DIR.glob("*.json"):
        board = json.loads(path.read_text())
        expected_panels += sum(len(p.get("targets", [])) for p in board["panels"])
    rules = yaml.safe_load(inventory.RULES_FILE.read_text())["groups"]
    expected_rules = sum(len(g["rules"]) for g in rules)
    kinds = [q.kind for q in queries]
    assert kinds.count("panel") == expected_panels > 0
    assert kinds.count("record") + kinds.count("alert") == expected_rules > 0
    assert kinds.count("variable") >= 4


def test_every_expression_parses(tmp_path: Path) -> None:
    exprs = [inventory.render(q.expr) for q in inventory.all_queries()]
    assert parse_errors(exprs, tmp_path) == ""


def test_the_parse_check_does_catch_a_typo(tmp_path: Path) -> None:
    assert "parse error" in parse_errors(["sum by (pool (rate(tandem_requests_total[1m]))"], tmp_path)


def test_render_substitutes_grafana_variables_but_not_regex_groups() -> None:
    expr = 'label_replace(x{namespace=~"$namespace", model=~"${model}"}[$__rate_interval], "n", "$1", "m", "(.+)")'
    rendered = inventory.render(expr, {"model": "m1"})
    assert rendered == 'label_replace(x{namespace=~".*", model=~"m1"}[1m], "n", "$1", "m", "(.+)")'


def test_each_query_knows_which_components_it_needs() -> None:
    queries = inventory.all_queries()
    records = inventory.record_needs(queries)
    needs = {q.source: q.needs(records) for q in queries}
    assert all(needs.values()), [s for s, n in needs.items() if not n]
    burn = [q for q in queries if "TandemTTFTBudgetBurn" in q.source]
    assert burn and all(q.needs(records) == {"worker"} for q in burn)
    down = [q for q in queries if "TandemWorkersDown" in q.source]
    assert down and down[0].needs(records) == {"worker", "operator"}


def test_selectors_lists_each_metric_selector_once_and_ignores_label_names() -> None:
    expr = ('sum(label_replace(tandem_worker_ready{pool="decode"}, "name", "$1", "tandem_dev_model", "(.+)"))'
            ' - sum(tandem_worker_ready{pool="decode"}) + rate(tandem_requests_total[5m])')
    assert inventory.selectors(expr) == ['tandem_worker_ready{pool="decode"}', "tandem_requests_total"]
