"""`tandem operator` on the command line (the contract the Helm chart relies on)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tandem.operator.kube import _path
from tandem.worker.cli import main


def test_help_lists_the_contract_options() -> None:
    result = CliRunner().invoke(main, ["operator", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--namespace", "--metrics-port", "--health-port", "--prometheus-url", "--autoscale-interval",
                   "--kubeconfig"):
        assert option in result.output


def test_one_port_for_health_and_metrics_is_refused_naming_both(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    result = CliRunner().invoke(main, ["operator", "--kubeconfig", str(kubeconfig), "--metrics-port", "9000",
                                       "--health-port", "9000"])
    assert result.exit_code == 2
    assert "--metrics-port and --health-port are both 9000" in result.output


def test_missing_kubeconfig_is_a_clear_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["operator", "--kubeconfig", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "nope" in result.output and "does not exist" in result.output


@pytest.mark.parametrize(("api_version", "kind", "name", "sub", "expected"), [
    ("apps/v1", "Deployment", "a", "", "/apis/apps/v1/namespaces/ns/deployments/a"),
    ("v1", "Service", None, "", "/api/v1/namespaces/ns/services"),
    ("tandem.dev/v1alpha1", "DisaggregatedModel", "m", "status",
     "/apis/tandem.dev/v1alpha1/namespaces/ns/disaggregatedmodels/m/status"),
])
def test_api_paths(api_version: str, kind: str, name: str | None, sub: str, expected: str) -> None:
    assert _path(api_version, kind, "ns", name, sub) == expected


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="does not manage ConfigMap"):
        _path("v1", "ConfigMap", "ns")


@pytest.mark.parametrize(("namespaces", "exact"), [
    ((), False), (("team-a",), True), (("team-a", "b2"), True), (("team-*",), False), (("!kube-system",), False),
    (("team-a,team-b",), False),
])
def test_kopf_scanning_is_off_only_for_exact_namespace_names(namespaces: tuple[str, ...], exact: bool) -> None:
    from tandem.operator.main import exact_namespaces

    assert exact_namespaces(namespaces) is exact


def test_kopf_logs_in_with_the_kubeconfig_flag_not_the_environment(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import kopf

    from tandem.operator import main as operator_main

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://flag.example:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "flag-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(operator_main, "_kubeconfig", str(kubeconfig))
    info = operator_main.login(settings=kopf.OperatorSettings())
    assert (info.server, info.scheme, info.token, info.insecure) == (
        "https://flag.example:6443", "Bearer", "flag-token", True)
