"""The committed generated files are what the generators produce now."""

from __future__ import annotations

from pathlib import Path

import gen_alerts
import gen_dashboards
import sync_chart_rbac


def test_committed_dashboards_are_fresh() -> None:
    stale = gen_dashboards.stale_outputs()
    assert not stale, f"stale dashboards {stale}: run python hack/gen_dashboards.py"


def test_committed_rules_are_fresh_in_both_places() -> None:
    stale = gen_alerts.stale_outputs()
    assert not stale, f"stale rules {stale}: run python hack/gen_alerts.py"


REPO = Path(__file__).resolve().parents[2]


def test_chart_crds_are_identical_to_repo_crds() -> None:
    # hack/gen_crd.py writes both copies; Helm installs only the chart's and never upgrades it.
    source = {p.name: p.read_bytes() for p in sorted((REPO / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((REPO / "charts" / "tandem" / "crds").glob("*.yaml"))}
    assert source, "crds/ holds no CRD: run python hack/gen_crd.py"
    assert chart == source, "charts/tandem/crds/ differs from crds/: run python hack/gen_crd.py"


def test_chart_rbac_rules_are_the_operators() -> None:
    assert not sync_chart_rbac.is_stale(), "run python hack/sync_chart_rbac.py"


def test_check_modes_exit_zero_when_fresh() -> None:
    assert gen_dashboards.main(["--check"]) == 0
    assert gen_alerts.main(["--check"]) == 0
    assert sync_chart_rbac.main(["--check"]) == 0
