"""The alert rules: valid for Prometheus, covering what on-call needs, and unit-tested by promtool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from chart_helpers import REPO, promtool_binary, run

RULES = REPO / "deploy" / "prometheus" / "tandem-rules.yaml"
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_rules_file() -> None:
    proc = run([promtool_binary(), "check", "rules", str(RULES)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    files = sorted(PROMTOOL_TESTS.glob("*.yaml"))
    assert len(files) >= 2
    proc = run([promtool_binary(), "test", "rules", *map(str, files)], cwd=PROMTOOL_TESTS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The same tests fail against rules whose TTFT threshold was loosened."""
    broken = RULES.read_text().replace("tandem:ttft_slo_errors:ratio_rate1h > 0.144",
                                       "tandem:ttft_slo_errors:ratio_rate1h > 0.9")
    assert broken != RULES.read_text()
    (tmp_path / "rules.yaml").write_text(broken)
    test = (PROMTOOL_TESTS / "slo_burn_test.yaml").read_text().replace(
        "../../../deploy/prometheus/tandem-rules.yaml", str(tmp_path / "rules.yaml"))
    (tmp_path / "test.yaml").write_text(test)
    proc = run([promtool_binary(), "test", "rules", str(tmp_path / "test.yaml")])
    assert proc.returncode != 0 and "TandemTTFTBudgetBurn" in proc.stdout + proc.stderr


def test_slo_burns_alert_separately_per_tier_with_fast_and_slow_windows() -> None:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for rule in alerts():
        by_name.setdefault(rule["alert"], []).append(rule)
    for name, tier in (("TandemTTFTBudgetBurn", "prefill"), ("TandemITLBudgetBurn", "decode")):
        rules = by_name[name]
        assert {r["labels"]["tier"] for r in rules} == {tier}
        assert {r["labels"]["severity"] for r in rules} == {"critical", "warning"}
    assert "tandem_time_to_first_token" not in " ".join(r["expr"] for r in by_name["TandemITLBudgetBurn"])


def test_every_required_alert_exists_with_severity_summary_and_runbook() -> None:
    names = {rule["alert"] for rule in alerts()}
    assert {"TandemTTFTBudgetBurn", "TandemITLBudgetBurn", "TandemKVTransferFailures",
            "TandemPoolScalingLimited", "TandemWorkersDown"} <= names
    docs = (REPO / "docs" / "alerts.md").read_text().lower()
    for rule in alerts():
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        anchor = rule["annotations"]["runbook_url"].split("#")[1]
        assert f"## {anchor}" in docs, f"docs/alerts.md has no section for {rule['alert']}"
