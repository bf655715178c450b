"""The chart as helm renders it: lint-clean, least-privilege RBAC, a locked-down operator pod,
and monitors that match the pods the operator really creates."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, KUBE_VERSION, REPO, Manifest, by_kind, helm_binary, promtool_binary, run

from tandem.operator import builders, rbac

Render = Callable[..., list[Manifest]]
MONITORING = ("prometheusRule.enabled=true", "metrics.serviceMonitor.enabled=true",
              "metrics.workers.podMonitor.enabled=true")
NAMESPACED = ("operator.watchNamespaces={team-a,team-b}",)


@pytest.mark.parametrize("values", [(), NAMESPACED + MONITORING], ids=["defaults", "namespaced-monitoring"])
def test_helm_lint_is_clean(values: tuple[str, ...]) -> None:
    argv = [helm_binary(), "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]
    for value in values:
        argv += ["--set", value]
    proc = run(argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def operator_container(docs: list[Manifest]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def test_default_render_objects(render: Render) -> None:
    kinds = sorted(doc["kind"] for doc in render())
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap", "Deployment",
                     "Service", "ServiceAccount"]


def test_operator_pod_runs_non_root_read_only_with_probes_and_metrics_port(render: Render) -> None:
    docs = render()
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    container = operator_container(docs)
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["command"] == ["tandem"]
    assert container["args"][0] == "operator"
    assert "--metrics-port=8080" in container["args"] and "--health-port=8081" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--namespace")]
    assert pod["serviceAccountName"] == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]


def test_cluster_role_is_exactly_the_operators_own_rule_list(render: Render) -> None:
    (role,) = by_kind(render(), "ClusterRole")
    assert role["rules"] == rbac.cluster_role_rules()
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
    keys = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert ("", "nodes") not in keys
    # Secrets: only the kvTransfer.secure keypair, fetched by name and created when missing; never
    # listed or watched (no bulk reads of other Secrets) and never updated.
    assert [r["verbs"] for r in role["rules"] if "secrets" in r["resources"]] == [["get", "create"]]


def test_extra_rules_are_appended(render: Render) -> None:
    extra = ("rbac.extraRules[0].apiGroups[0]=example.com", "rbac.extraRules[0].resources[0]=widgets",
             "rbac.extraRules[0].verbs[0]=get")
    (role,) = by_kind(render(*extra), "ClusterRole")
    assert role["rules"] == [*rbac.cluster_role_rules(),
                             {"apiGroups": ["example.com"], "resources": ["widgets"], "verbs": ["get"]}]


def test_operator_may_grant_exactly_what_the_router_role_it_creates_needs(render: Render) -> None:
    """Kubernetes refuses to let the operator create a Role granting more than it holds."""
    (role,) = by_kind(render(), "ClusterRole")
    held = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    owner = builders.Owner(name="m", namespace="ns", uid="u")
    router_role = next(doc for doc in builders.router_access(owner) if doc["kind"] == "Role")
    for rule in router_role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= held.get((group, resource), set()), (group, resource)


def test_namespace_scoped_mode_uses_roles_in_each_namespace_only(render: Render) -> None:
    docs = render(*NAMESPACED)
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    # The same rules minus those on cluster-scoped resources, which a Role cannot grant.
    cluster_scoped = {"customresourcedefinitions", "namespaces", "nodes", "persistentvolumes"}
    expected = [r for r in rbac.cluster_role_rules() if not cluster_scoped & set(r["resources"])]
    assert expected, "no namespaced rules at all"
    assert all(r["rules"] == expected for r in roles)
    for binding in by_kind(docs, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == "tandem-system"
    args = operator_container(docs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_worker_podmonitor_selects_the_pods_the_operator_builds(render: Render) -> None:
    (monitor,) = by_kind(render(*MONITORING), "PodMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    owner = builders.Owner(name="m", namespace="ns", uid="u")
    for component in ("prefill", "decode", "router"):
        pod_labels = builders.labels(owner, component)
        assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
        (expression,) = spec["selector"]["matchExpressions"]
        assert pod_labels[expression["key"]] in expression["values"]
    # The port name the worker containers declare, and the label joining workers to resources.
    assert spec["podMetricsEndpoints"][0]["port"] == "http"
    assert spec["podTargetLabels"] == ["tandem.dev/model"]
    assert builders.labels(owner, "decode")["tandem.dev/model"] == "m"


def test_operator_servicemonitor_keeps_the_operators_own_namespace_label(render: Render) -> None:
    docs = render(*MONITORING)
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (service,) = by_kind(docs, "Service")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def test_prometheusrule_carries_the_generated_rules(render: Render, tmp_path: Any) -> None:
    (rule,) = by_kind(render(*MONITORING), "PrometheusRule")
    generated = yaml.safe_load((REPO / "deploy" / "prometheus" / "tandem-rules.yaml").read_text())
    assert rule["spec"]["groups"] == generated["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    proc = run([promtool_binary(), "check", "rules", str(tmp_path / "rules.yaml")])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheusrule_can_drop_alerts_and_add_labels_without_overriding_severity(render: Render) -> None:
    docs = render("prometheusRule.enabled=true", "prometheusRule.disabledAlerts={TandemWorkerNotReady}",
                  "prometheusRule.additionalAlertLabels.team=inference",
                  "prometheusRule.additionalAlertLabels.severity=info")
    (rule,) = by_kind(docs, "PrometheusRule")
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    alerts = [r for r in rules if "alert" in r]
    assert "TandemWorkerNotReady" not in {r["alert"] for r in alerts}
    assert "TandemWorkersDown" in {r["alert"] for r in alerts}
    assert all(r["labels"]["team"] == "inference" for r in alerts)
    assert all(r["labels"]["severity"] in ("critical", "warning") for r in alerts)
    assert all("labels" not in r for r in rules if "record" in r)


def test_dashboards_ship_as_configmaps_with_the_sidecar_label(render: Render) -> None:
    configmaps = by_kind(render(), "ConfigMap")
    shipped = {}
    for configmap in configmaps:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        for key, text in configmap["data"].items():
            shipped[key] = json.loads(text)
    files = {p.name: json.loads(p.read_text()) for p in (CHART / "dashboards").glob("*.json")}
    assert shipped == files and len(files) == 2
    custom = by_kind(render("dashboards.label=my_dash", "dashboards.labelValue=yes",
                            "dashboards.namespace=grafana"), "ConfigMap")
    assert all(c["metadata"]["labels"]["my_dash"] == "yes" for c in custom)
    assert all(c["metadata"]["namespace"] == "grafana" for c in custom)
    assert not by_kind(render("dashboards.enabled=false"), "ConfigMap")


def test_chart_installs_the_repo_crd(render: Render) -> None:
    crds = by_kind(render(include_crds=True), "CustomResourceDefinition")
    repo = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.yaml"))]
    assert crds == repo and crds[0]["spec"]["group"] == "tandem.dev"


def test_servicemonitor_without_its_service_fails_with_a_clear_message() -> None:
    argv = [helm_binary(), "template", "t", str(CHART), "--kube-version", KUBE_VERSION,
            "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"]
    proc = run(argv)
    assert proc.returncode != 0 and "needs metrics.service.enabled" in proc.stderr


def test_operator_pod_template_carries_the_standard_labels_and_the_selector_is_unchanged(render: Render) -> None:
    (deployment,) = by_kind(render("podLabels.team=inference"), "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    # The selector is immutable on a Deployment: it must stay these three labels.
    assert selector == {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "tandem",
                        "app.kubernetes.io/component": "operator"}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["metadata"]["labels"].items() <= pod_labels.items()
    for key in ("helm.sh/chart", "app.kubernetes.io/version", "app.kubernetes.io/managed-by"):
        assert pod_labels.get(key), key
    assert selector.items() <= pod_labels.items() and pod_labels["team"] == "inference"


def test_dashboard_configmaps_are_not_labelled_as_the_operator(render: Render) -> None:
    configmaps = by_kind(render(), "ConfigMap")
    assert configmaps
    for configmap in configmaps:
        labels = configmap["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "dashboards"
        assert labels["app.kubernetes.io/instance"] == "tandem" and labels["helm.sh/chart"].startswith("tandem-")


def test_user_strings_in_the_operator_args_survive_yaml(render: Render) -> None:
    """A value with " #" would be cut at the # (a YAML comment) if the args were not quoted."""
    url = "http://prometheus.monitoring:9090/x?a=b #frag: y"
    args = operator_container(render(f"operator.prometheusUrl={url}", "operator.watchNamespaces={team-a #x}",
                                     "operator.autoscaleInterval=7.5"))["args"]
    assert f"--prometheus-url={url}" in args
    assert "--namespace=team-a #x" in args
    assert "--autoscale-interval=7.5" in args and "--metrics-port=8080" in args


def render_notes(tmp_path: Any, *set_args: str) -> str:
    """NOTES.txt as `helm install` prints it. helm template leaves NOTES out, so a copy of the chart
    renders the same text with `tpl` into a ConfigMap (same values, same helpers)."""
    import shutil

    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart)
    (chart / "files" / "notes.tpl").write_text((CHART / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data:\n  notes: {{ tpl (.Files.Get "files/notes.tpl") . | quote }}\n')
    argv = [helm_binary(), "template", "tandem", str(chart), "--namespace", "tandem-system",
            "--kube-version", KUBE_VERSION, "--show-only", "templates/zz-notes.yaml"]
    for value in set_args:
        argv += ["--set", value]
    proc = run(argv)
    assert proc.returncode == 0, proc.stderr
    return str(yaml.safe_load(proc.stdout)["data"]["notes"])


@pytest.mark.parametrize(("values", "namespace"), [((), "default"), (NAMESPACED, "team-a")],
                         ids=["cluster-wide", "namespaced"])
def test_notes_commands_look_where_the_example_was_applied(tmp_path: Any, render: Render,
                                                           values: tuple[str, ...], namespace: str) -> None:
    notes = render_notes(tmp_path, *values)
    assert f"kubectl apply -n {namespace} -f -" in notes
    dm_commands = [line.strip() for line in notes.splitlines() if line.strip().startswith("kubectl") and " dm" in line]
    assert len(dm_commands) == 2, notes
    assert all(cmd.startswith(f"kubectl -n {namespace} ") for cmd in dm_commands), dm_commands
    assert f"http://my-model.{namespace}.svc:8000/v1" in notes
    # The notes promise an endpoint in `kubectl get dm`: the CRD has that column.
    crd = next(c for c in by_kind(render(include_crds=True), "CustomResourceDefinition")
               if c["spec"]["names"]["kind"] == "DisaggregatedModel")
    columns = {c["name"].lower(): c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert "endpoint" in notes.split("get dm my-model", 1)[1].splitlines()[0]
    assert columns["endpoint"] == ".status.endpoint"


def operator_settings(args: list[str]) -> Any:
    """The NetworkPolicy setting `tandem operator` makes of the chart's args (click parses them as in the pod)."""
    from tandem.operator.main import command
    from tandem.operator.network_policy import settings_from_options

    assert args[0] == "operator"
    params = command.make_context("operator", list(args[1:])).params
    return settings_from_options(params["network_policy"], params["network_policy_metrics_namespace_selector"],
                                 params["network_policy_metrics_pod_selector"], params["network_policy_clients"])


def test_network_policy_values_reach_the_operator(render: Render) -> None:
    from tandem.operator.network_policy import NetworkPolicySettings

    assert operator_settings(operator_container(render())["args"]) == NetworkPolicySettings()  # on, Prometheus pods
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    args = operator_container(render(
        "networkPolicy.metrics.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
        "networkPolicy.metrics.podSelector=null",
        "networkPolicy.clients[0].namespaceSelector.matchLabels.team=web"))["args"]
    assert operator_settings(args) == NetworkPolicySettings(
        metrics_namespace_selector=monitoring, metrics_pod_selector=None,
        clients=({"namespaceSelector": {"matchLabels": {"team": "web"}}},))
    off = operator_settings(operator_container(render("networkPolicy.enabled=false"))["args"])
    assert off.enabled is False
    # `helm upgrade --reuse-values` from a chart without the block renders no flag: the operator's defaults (on).
    args = operator_container(render("networkPolicy=null"))["args"]
    assert not [a for a in args if a.startswith("--network-policy")]
    assert operator_settings(args) == NetworkPolicySettings()
