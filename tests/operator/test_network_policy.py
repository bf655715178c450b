"""The model's NetworkPolicies (tandem.operator.network_policy), pure: who may reach which port.

Each case asks the policies the question a user's traffic asks: may this pod (labels, namespace) open
a connection to that pod's port? `allowed` answers it the way Kubernetes defines NetworkPolicy
ingress (a pod no policy selects takes everything; a selected one takes the union of its policies'
rules). The destination pods' labels come from the operator's own pod templates, so a policy that
stopped selecting the pods it means would fail here. Nothing in this file enforces anything: that is
the network plugin's job (docs/security.md, "Network policies").
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.operator import builders, network_policy
from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.kube import KubeError
from tandem.operator.network_policy import NetworkPolicySettings

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")
SPEC = DisaggregatedModelSpec.model_validate({"model": {"name": "tiny-llama", "source": {"path": "/models/tiny"}}})
HTTP, KV = builders.HTTP_PORT, builders.KV_PORT


def pod_labels(owner: builders.Owner, component: str) -> dict[str, str]:
    """The labels of the pods the operator really runs (from the Deployments' templates)."""
    if component == "router":
        deployment = builders.router_deployment(owner, SPEC, 1)
    else:
        deployment = builders.worker_deployment(owner, SPEC, component, 1, "fp")  # type: ignore[arg-type]
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def namespace_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}  # what the API server puts on every namespace


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_ns: str, src_ns: str, src_labels: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return False  # these cases are pod to pod
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], namespace_labels(src_ns)):
            return False
    elif src_ns != policy_ns:  # a lone podSelector means the policy's own namespace
        return False
    return _matches(peer.get("podSelector", {}), src_labels)


def allowed(policies: list[dict[str, Any]], src_ns: str, src_labels: dict[str, str], dst_ns: str,
            dst_labels: dict[str, str], port: int) -> bool:
    selecting = [p for p in policies if p["metadata"]["namespace"] == dst_ns
                 and "Ingress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], dst_labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports_ok = "ports" not in rule or any(p["port"] == port and p["protocol"] == "TCP" for p in rule["ports"])
            from_ok = "from" not in rule or any(
                _peer_matches(peer, policy["metadata"]["namespace"], src_ns, src_labels) for peer in rule["from"])
            if ports_ok and from_ok:
                return True
    return False


PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"})
STRANGER = ("serving", {"app": "curl"})  # any other pod of the model's namespace
CLIENT = ("apps", {"app": "frontend"})
ROUTER = ("serving", pod_labels(OWNER, "router"))
PREFILL = ("serving", pod_labels(OWNER, "prefill"))
DECODE = ("serving", pod_labels(OWNER, "decode"))
OTHER = builders.Owner(name="other", namespace="serving", uid="uid-2")
OTHER_ROUTER = ("serving", pod_labels(OTHER, "router"))
OTHER_PREFILL = ("serving", pod_labels(OTHER, "prefill"))
ROUTER_LABELS_ELSEWHERE = ("elsewhere", pod_labels(OWNER, "router"))

# (source, destination component, port, allowed with the default setting)
DEFAULT_CASES = [
    (CLIENT, "router", HTTP, True),  # clients: the router's port, from anywhere
    (STRANGER, "router", HTTP, True),
    (PROMETHEUS, "router", HTTP, True),
    (CLIENT, "router", KV, False),  # nothing else on the router
    (ROUTER, "prefill", HTTP, True),  # the router drives both pools
    (ROUTER, "decode", HTTP, True),
    (PREFILL, "decode", KV, True),  # KV: prefill -> decode
    (PROMETHEUS, "prefill", HTTP, True),  # scrapes /metrics
    (PROMETHEUS, "decode", HTTP, True),
    (PROMETHEUS, "decode", KV, False),
    (CLIENT, "prefill", HTTP, False),
    (CLIENT, "decode", KV, False),
    (STRANGER, "decode", HTTP, False),
    (STRANGER, "decode", KV, False),
    (ROUTER, "decode", KV, False),  # the router never touches KV
    (PREFILL, "decode", HTTP, False),  # workers never call each other over HTTP
    (DECODE, "prefill", HTTP, False),
    (PREFILL, "prefill", KV, False),  # nothing listens on a prefill pod's KV port
    (DECODE, "prefill", KV, False),
    (DECODE, "decode", KV, False),
    (OTHER_ROUTER, "prefill", HTTP, False),  # another model's router
    (OTHER_PREFILL, "decode", KV, False),  # another model's prefill pool
    (ROUTER_LABELS_ELSEWHERE, "decode", HTTP, False),  # the router's labels in another namespace
    (("monitoring", {"app": "grafana-agent"}), "decode", HTTP, False),  # a scraper not labelled as Prometheus
]


def case_id(case: tuple[Any, ...]) -> str:
    (ns, labels), component, port, expected = case
    who = labels.get("app.kubernetes.io/component") or labels.get("app.kubernetes.io/name") or labels.get("app")
    instance = labels.get("app.kubernetes.io/instance")
    return f"{ns}/{who}{'@' + instance if instance else ''}->{component}:{port}={'allow' if expected else 'deny'}"


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=[case_id(c) for c in DEFAULT_CASES])
def test_default_policies_let_in_exactly_the_legitimate_paths(case: tuple[Any, ...]) -> None:
    (src_ns, src_labels), component, port, expected = case
    policies = network_policy.network_policies(OWNER, NetworkPolicySettings())
    assert allowed(policies, src_ns, src_labels, "serving", pod_labels(OWNER, component), port) is expected


def test_three_ingress_only_policies_owned_by_the_model() -> None:
    policies = network_policy.network_policies(OWNER, NetworkPolicySettings())
    assert [(p["kind"], p["apiVersion"], p["metadata"]["name"]) for p in policies] == [
        ("NetworkPolicy", "networking.k8s.io/v1", f"tiny-{c}") for c in ("router", "prefill", "decode")]
    for policy, component in zip(policies, ("router", "prefill", "decode"), strict=True):
        meta = policy["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [{"apiVersion": "tandem.dev/v1alpha1", "kind": "DisaggregatedModel",
                                            "name": "tiny", "uid": "uid-1", "controller": True}]
        assert meta["labels"] == builders.labels(OWNER, component)
        # Egress never isolated: model downloads, DNS and the router's API server calls stay open.
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
        assert policy["spec"]["podSelector"] == {"matchLabels": builders.selector_labels(OWNER, component)}


def test_each_policy_selects_its_components_pods_and_no_other() -> None:
    policies = {p["metadata"]["name"]: p for p in network_policy.network_policies(OWNER, NetworkPolicySettings())}
    for component in ("router", "prefill", "decode"):
        for other in ("router", "prefill", "decode"):
            selects = _matches(policies[f"tiny-{component}"]["spec"]["podSelector"], pod_labels(OWNER, other))
            assert selects is (component == other), (component, other)
        assert not _matches(policies[f"tiny-{component}"]["spec"]["podSelector"], pod_labels(OTHER, component))


def test_ports_are_the_ones_the_containers_listen_on() -> None:
    worker = builders.worker_deployment(OWNER, SPEC, "decode", 1, "fp")["spec"]["template"]["spec"]["containers"][0]
    router = builders.router_deployment(OWNER, SPEC, 1)["spec"]["template"]["spec"]["containers"][0]
    listening = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert listening == {"http": HTTP, "kv": KV}
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == {"http": HTTP}
    # The worker and router really listen there (their command lines).
    assert worker["args"][worker["args"].index("--port") + 1] == str(HTTP)
    assert worker["args"][worker["args"].index("--kv-port") + 1] == str(KV)
    assert router["args"][router["args"].index("--port") + 1] == str(HTTP)


MONITORING_ONLY = NetworkPolicySettings(metrics_namespace_selector={"matchLabels": namespace_labels("monitoring")},
                                        metrics_pod_selector=None)


@pytest.mark.parametrize(("settings", "source", "expected"), [
    (MONITORING_ONLY, ("monitoring", {"app": "vmagent"}), True),  # any pod of the monitoring namespace
    (MONITORING_ONLY, ("other", PROMETHEUS[1]), False),  # Prometheus labels elsewhere: not any more
    (NetworkPolicySettings(metrics_namespace_selector=None), ("serving", PROMETHEUS[1]), True),  # pod only: own ns
    (NetworkPolicySettings(metrics_namespace_selector=None), PROMETHEUS, False),
    (NetworkPolicySettings(metrics_namespace_selector=None, metrics_pod_selector=None), PROMETHEUS, False),
    (NetworkPolicySettings(metrics_pod_selector={"matchExpressions": [
        {"key": "app.kubernetes.io/name", "operator": "In", "values": ["prometheus", "vmagent"]}]}),
     ("metrics", {"app.kubernetes.io/name": "vmagent"}), True),
], ids=["ns-only-any-pod", "ns-only-other-ns", "pod-only-own-ns", "pod-only-other-ns", "none", "expressions"])
def test_metrics_scrapers_follow_the_selectors(settings: NetworkPolicySettings, source: tuple[str, dict[str, str]],
                                               expected: bool) -> None:
    policies = network_policy.network_policies(OWNER, settings)
    for component in ("prefill", "decode"):
        assert allowed(policies, *source, "serving", pod_labels(OWNER, component), HTTP) is expected
        assert not allowed(policies, *source, "serving", pod_labels(OWNER, component), KV)
    # The model's own paths do not depend on the scrapers' setting.
    assert allowed(policies, *ROUTER, "serving", pod_labels(OWNER, "decode"), HTTP)
    assert allowed(policies, *PREFILL, "serving", pod_labels(OWNER, "decode"), KV)


def test_no_scrapers_leaves_only_the_router_on_the_workers_port() -> None:
    settings = NetworkPolicySettings(metrics_namespace_selector=None, metrics_pod_selector=None)
    prefill = network_policy.worker_policy(OWNER, "prefill", settings)
    assert prefill["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": builders.selector_labels(
        OWNER, "router")}}], "ports": [{"protocol": "TCP", "port": HTTP}]}]


def test_clients_narrow_the_router_and_keep_the_scrapers() -> None:
    settings = NetworkPolicySettings(clients=({"namespaceSelector": {"matchLabels": namespace_labels("apps")},
                                               "podSelector": {"matchLabels": {"app": "frontend"}}},))
    policies = network_policy.network_policies(OWNER, settings)
    router = pod_labels(OWNER, "router")
    assert allowed(policies, *CLIENT, "serving", router, HTTP)
    assert not allowed(policies, "apps", {"app": "batch"}, "serving", router, HTTP)
    assert not allowed(policies, *STRANGER, "serving", router, HTTP)
    assert allowed(policies, *PROMETHEUS, "serving", router, HTTP)  # still scraped


def test_turned_off_there_are_none() -> None:
    assert network_policy.network_policies(OWNER, NetworkPolicySettings(enabled=False)) == []


# ---------------------------------------------------------------- the command line's values


def test_the_flags_defaults_are_the_settings_defaults() -> None:
    from tandem.operator.main import command

    ctx = command.make_context("operator", [])  # the command's own option defaults, as click passes them
    params = ctx.params
    settings = network_policy.settings_from_options(
        params["network_policy"], params["network_policy_metrics_namespace_selector"],
        params["network_policy_metrics_pod_selector"], params["network_policy_clients"])
    assert settings == NetworkPolicySettings()
    assert settings.metrics_namespace_selector == {}
    assert settings.metrics_pod_selector == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}


@pytest.mark.parametrize(("text", "expected"), [
    ("{}", {}), ("null", None), ('{"matchLabels": {"a": "b"}}', {"matchLabels": {"a": "b"}}),
    ('{"matchExpressions": [{"key": "a", "operator": "Exists"}]}', {"matchExpressions": [{"key": "a", "operator": "Exists"}]}),
])
def test_label_selectors_parse(text: str, expected: Any) -> None:
    assert network_policy.parse_label_selector(text, "--x") == expected


@pytest.mark.parametrize("text", ["", "monitoring", "[]", '{"matchLabel": {}}', '{"matchLabels": {"a": 1}}',
                                  '{"matchExpressions": [{"key": "a"}]}'])
def test_bad_label_selectors_are_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--x: "):
        network_policy.parse_label_selector(text, "--x")


@pytest.mark.parametrize("text", ["{}", "[{}]", '[{"cidr": "10.0.0.0/8"}]', '[{"ipBlock": {}}]',
                                  '[{"podSelector": {"matchLabels": {"a": 1}}}]'])
def test_bad_client_peers_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--c"):
        network_policy.parse_peers(text, "--c")


def test_client_peers_parse() -> None:
    peers = [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"namespaceSelector": {}}]
    assert network_policy.parse_peers(json.dumps(peers), "--c") == tuple(peers)
    assert network_policy.parse_peers("[]", "--c") == () == network_policy.parse_peers("null", "--c")


def test_the_operator_refuses_a_bad_selector_before_starting() -> None:
    from click.testing import CliRunner

    from tandem.operator.main import command

    result = CliRunner().invoke(command, ["--network-policy-metrics-pod-selector", "app=prometheus"])
    assert result.exit_code == 2
    assert "--network-policy-metrics-pod-selector: not JSON" in result.output


# ---------------------------------------------------------------- turned off: removing what was made


class FakeKube:
    """NetworkPolicies only: list and delete, as the operator's RBAC allows."""

    def __init__(self, policies: list[dict[str, Any]], refuse_list: int = 0, gone: tuple[str, ...] = ()) -> None:
        self.policies, self.refuse_list, self.gone = policies, refuse_list, gone
        self.deleted: list[str] = []
        self.selectors: list[dict[str, str]] = []

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        assert (api_version, kind, namespace) == ("networking.k8s.io/v1", "NetworkPolicy", "serving")
        if self.refuse_list:
            raise KubeError(self.refuse_list, "networkpolicies is forbidden")
        self.selectors.append(selector)
        return [p for p in self.policies if all(p["metadata"]["labels"].get(k) == v for k, v in selector.items())]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        assert (api_version, kind, namespace) == ("networking.k8s.io/v1", "NetworkPolicy", "serving")
        if name in self.gone:
            return False
        self.deleted.append(name)
        return True


def test_remove_deletes_this_models_policies_only() -> None:
    ours = network_policy.network_policies(OWNER, NetworkPolicySettings())
    namesake = network_policy.router_policy(builders.Owner("tiny", "serving", "uid-old"), NetworkPolicySettings())
    namesake["metadata"]["name"] = "tiny-router-old"
    theirs = network_policy.router_policy(OTHER, NetworkPolicySettings())
    kube = FakeKube([*ours, namesake, theirs], gone=("tiny-decode",))
    assert network_policy.remove(kube, OWNER) == ["tiny-router", "tiny-prefill"]  # type: ignore[arg-type]
    assert kube.deleted == ["tiny-router", "tiny-prefill"]
    assert kube.selectors == [{**builders.instance_labels(OWNER), "app.kubernetes.io/managed-by": "tandem-operator"}]


def test_remove_without_the_right_to_list_has_nothing_to_do() -> None:
    assert network_policy.remove(FakeKube([], refuse_list=403), OWNER) == []  # type: ignore[arg-type]
    with pytest.raises(KubeError):
        network_policy.remove(FakeKube([], refuse_list=500), OWNER)  # type: ignore[arg-type]


def test_describe_says_what_the_operator_does() -> None:
    assert "off" in network_policy.describe(NetworkPolicySettings(enabled=False))
    line = network_policy.describe(NetworkPolicySettings())
    assert "router from anywhere" in line and "prometheus" in line
    assert "none" in network_policy.describe(NetworkPolicySettings(metrics_namespace_selector=None,
                                                                  metrics_pod_selector=None))
