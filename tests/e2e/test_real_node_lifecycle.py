"""Tandem on real pods while things change: scaling, a killed decode pod, the autoscaler, rolling
updates (one of them a KV layout change), a restarted operator, a second model with the same served name, and deletion.

Each step is what a user does with kubectl (or what a node does to a pod), under real streaming
load from the openai client where the claim is "no request fails". The setup is shared with
test_real_node.py (tests/e2e/conftest.py) and these run after it, in file order: each test
leaves the resource as it found it (1 prefill, 1 decode, Ready), and the last one deletes it.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import cluster  # noqa: E402
import e2e  # noqa: E402
import k8s_build  # noqa: E402

from tandem.operator import signals as sig  # noqa: E402
from tandem.worker import metrics as m  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

GENERATED = m.exposed_name(m.GENERATION_TOKENS)
PROMPT_TOKENS = m.exposed_name(m.PROMPT_TOKENS)
RUNNING = m.exposed_name(m.RUNNING_REQUESTS)
MIGRATIONS = m.exposed_name(m.MIGRATIONS)


@pytest.fixture(scope="module", autouse=True)
def tear_down_after_the_last_check(setup: Any) -> Iterator[None]:
    """This module is the last of tests/e2e: the real node goes with it, not at the end of the suite."""
    yield
    setup.close()


def scale_decode(setup: Any, replicas: int) -> None:
    """`kubectl scale` of the decode pool (autoscaling mode external: its DisaggregatedPool)."""
    setup.kubectl("scale", "disaggregatedpool", f"{setup.name}-decode", "-n", setup.namespace,
                  f"--replicas={replicas}")


def wait_pool(setup: Any, component: str, replicas: int, timeout: float = 300, name: str | None = None) -> list[Any]:
    """Until the pool has exactly `replicas` pods, all ready (none terminating), and says so."""
    def settled() -> list[Any] | None:
        pods = setup.pods(component, name)
        ready = [p for p in pods if p["status"].get("containerStatuses") and
                 all(s.get("ready") for s in p["status"]["containerStatuses"])]
        summary = setup.resource(name).get("status", {}).get(component, {}).get("summary")
        return pods if len(pods) == len(ready) == replicas and summary == f"{replicas}/{replicas}" else None
    return setup.wait(f"{component} of {name or setup.name} at {replicas} ready pods", settled, timeout)  # type: ignore[no-any-return]


def prometheus_value(setup: Any, query: str) -> float | None:
    """`query`'s value in Prometheus now; None when it has no series or is NaN (no data)."""
    result = prometheus_series(setup, query)
    value = float(result[0]["value"][1]) if result else None
    return None if value is None or math.isnan(value) else value


def burst(client: Any, model: str, n: int, max_tokens: int = 8, prompt: str = "Hello there") -> list[Any]:
    """n concurrent completions; raises on the first failure."""
    def one(_: int) -> Any:
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


# --- scaling by hand -----------------------------------------------------------------------

def test_kubectl_scale_adds_a_decode_worker_that_serves(setup: Any) -> None:
    first = {p["metadata"]["name"] for p in wait_pool(setup, "decode", 1)}
    scale_decode(setup, 2)
    pods = wait_pool(setup, "decode", 2)
    added = [p for p in pods if p["metadata"]["name"] not in first]
    assert len(added) == 1
    before = setup.pod_metrics(added[0]).get(GENERATED, 0.0)

    # The router learns of it from the EndpointSlice and spreads concurrent requests by free KV.
    def new_pod_served() -> bool:
        for answer in burst(setup.client(), setup.info["model_name"], 6):
            assert answer.choices[0].finish_reason == "length"
        return setup.pod_metrics(added[0]).get(GENERATED, 0.0) > before
    setup.wait("the added decode pod generates tokens for the router's requests", new_pod_served, timeout=120)


def test_decode_pod_killed_mid_stream_the_stream_completes(setup: Any, tokenizer: Any, hf_greedy: Any) -> None:
    """The decode pod serving a long stream is deleted with a 1 s grace (its drain is cut short): the
    router replays prompt + tokens so far on the other decode pod, and the client sees one whole
    answer, equal to transformers' greedy output (1800 tokens)."""
    wait_pool(setup, "decode", 2)
    prompt, n = "Once upon a time", 1800  # seconds of decoding on the CPU: the pod goes away in ~1.5 s
    expected = hf_greedy(tokenizer.encode(prompt), n)
    migrations = setup.router_metrics().get(MIGRATIONS, 0.0)
    ids: list[int] = []
    victim = None
    stream = setup.client().completions.create(model=setup.info["model_name"], prompt=prompt, max_tokens=n,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
        if victim is None and ids:  # at the first token: find the pod now, while it surely runs
            busy = [p for p in setup.pods("decode") if setup.pod_metrics(p).get(RUNNING, 0.0) > 0]
            assert len(busy) == 1, f"expected one decode pod running the stream, got {len(busy)}"
            victim = busy[0]["metadata"]["name"]
            setup.kubectl("delete", "pod", victim, "-n", setup.namespace, "--grace-period=1", "--wait=false")
    assert victim is not None
    assert len(ids) == n and ids == expected
    assert setup.router_metrics().get(MIGRATIONS, 0.0) > migrations, \
        f"the stream finished before {victim} went away: make it longer"
    wait_pool(setup, "decode", 2)  # the Deployment replaced it


def test_scale_down_under_streaming_load_fails_nothing(setup: Any, steady_load: Any) -> None:
    wait_pool(setup, "decode", 2)
    with steady_load(clients=2) as load:
        load.wait_completed(3)
        scale_decode(setup, 1)
        wait_pool(setup, "decode", 1, timeout=240)
        load.wait_completed(3)
    assert not load.failures, f"{len(load.failures)} of {load.completed + len(load.failures)} failed: " \
                              f"{load.failures[:5]}"


# --- the autoscaler ------------------------------------------------------------------------

def test_autoscaler_adds_a_prefill_worker_on_real_queue_depth(setup: Any, steady_load: Any) -> None:
    """Prefill takes one sequence at a time (the setup's --max-num-seqs 1) and aims for 0.5 queued
    per replica: 8 clients with long prompts queue requests on one worker; Prometheus scrapes
    that from the pod, the operator's autoscaler reads it and adds a worker, which then takes
    prompts. Once the load stops, the signal falls and the pool shrinks back (60 s window, 90 s cooldown)."""
    first = {p["metadata"]["name"] for p in wait_pool(setup, "prefill", 1)}
    with steady_load(clients=8, max_tokens=2, prompt="Autoscale me, " * 40) as load:
        pods = wait_pool(setup, "prefill", 2, timeout=300)
        added = next(p for p in pods if p["metadata"]["name"] not in first)
        setup.wait("the added prefill pod takes prompts",
                   lambda: setup.pod_metrics(added).get(PROMPT_TOKENS, 0.0) > 0, timeout=120)
    assert not load.failures, load.failures[:5]
    events = setup.json("get", "events", "-n", setup.namespace,
                        "--field-selector", f"involvedObject.name={setup.name},reason=ScaledUp")["items"]
    assert any("prefill 1 -> 2" in e["message"] for e in events), [e["message"] for e in events]
    wait_pool(setup, "prefill", 1, timeout=300)


def test_the_predictive_policy_sizes_prefill_from_the_routers_arrivals(setup: Any, steady_load: Any) -> None:
    """The prefill pool on `policy: predictive` with a capacity profile of 100 prompt tokens/s per replica
    (far below what a tiny-model worker does, so that the 8 clients' arrivals need more than one): the
    operator reads the router's arrival series from Prometheus, sizes the pool from them (the scale reason
    says predictive, not the reactive fallback) and adds a worker; once the load stops it scales back."""
    profile = {"prefillTokensPerSecond": 100, "kvTokens": 131072, "itlBaseSeconds": 0.002,
               "itlPerRequestSeconds": 0.0003, "startupSeconds": 30}
    setup.kubectl("patch", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--type=merge", "-p",
                  json.dumps({"spec": {"capacityProfile": profile,
                                       "prefill": {"autoscaling": {"policy": "predictive"}}}}))
    try:
        wait_pool(setup, "prefill", 1)

        def predictive_reason() -> str | None:
            """The scale reason once the predictive sizing (not the fallback) asks for more than one replica."""
            reason = str(setup.resource().get("status", {}).get("prefill", {}).get("scaleReason", ""))
            need = re.search(r"-> (\d+) prefill", reason)
            return reason if reason.startswith("predictive:") and "fallback" not in reason and need \
                and int(need.group(1)) >= 2 else None

        with steady_load(clients=8, max_tokens=2, prompt="Autoscale me, " * 40) as load:
            reason = setup.wait("the prefill pool sized by the predictive policy", predictive_reason, timeout=240)
            print(f"scale reason: {reason}")
            wait_pool(setup, "prefill", 2, timeout=300)
        assert not load.failures, load.failures[:5]
        wait_pool(setup, "prefill", 1, timeout=300)
    finally:
        setup.kubectl("patch", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--type=merge", "-p",
                      json.dumps({"spec": {"prefill": {"autoscaling": {"policy": "reactive"}}}}))


# --- a rolling update ----------------------------------------------------------------------

def test_spec_change_rolls_both_pools_under_load_with_no_failure(setup: Any, steady_load: Any) -> None:
    old = {p["metadata"]["name"] for c in ("prefill", "decode") for p in setup.pods(c)}
    env = [{"name": "TANDEM_E2E_ROLL", "value": str(time.time_ns())}]
    with steady_load(clients=2) as load:
        load.wait_completed(3)
        setup.kubectl("patch", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--type=merge",
                      "-p", json.dumps({"spec": {"prefill": {"env": env}, "decode": {"env": env}}}))
        setup.wait("both pools replaced by ready pods with the new env", lambda: rolled(setup, old), timeout=420)
        load.wait_completed(3)
    assert not load.failures, f"{len(load.failures)} of {load.completed + len(load.failures)} failed: " \
                              f"{load.failures[:5]}"
    for component in ("prefill", "decode"):
        env_now = setup.pods(component)[0]["spec"]["containers"][0].get("env", [])
        assert {"name": "TANDEM_E2E_ROLL", "value": env[0]["value"]} in env_now


def test_a_kv_layout_change_rolls_without_ever_pairing_old_and_new(setup: Any, steady_load: Any) -> None:
    """blockSize 16 -> 32 changes every worker's KV layout. While both pools roll under load the
    router must pair a prefill and a decode worker only on equal layouts: no KV transfer fails on
    any pod (Prometheus keeps the series of the pods that are gone), no answer differs, and after
    the roll KV moves between the new pods."""
    old = {p["metadata"]["name"] for c in ("prefill", "decode") for p in setup.pods(c)}
    failures_query = (f'max_over_time({m.exposed_name(m.KV_TRANSFER_FAILURES)}{{namespace="{setup.namespace}",'
                      f'tandem_dev_model="{setup.name}"}}[30m])')
    def failed_transfers() -> dict[str, str]:  # every reason's series exists from the start, at 0
        return {f'{s["metric"].get("pod")}/{s["metric"].get("reason")}': s["value"][1]
                for s in prometheus_series(setup, failures_query) if float(s["value"][1]) > 0}
    assert not failed_transfers(), f"KV transfers failed before this test: {failed_transfers()}"
    with steady_load(clients=2) as load:
        load.wait_completed(3)
        setup.kubectl("patch", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--type=merge",
                      "-p", json.dumps({"spec": {"kvTransfer": {"blockSize": 32}}}))
        setup.wait("both pools replaced by ready pods with the new layout", lambda: rolled(setup, old), timeout=420)
        load.wait_completed(5)
    assert not load.failures, f"{len(load.failures)} of {load.completed + len(load.failures)} failed: " \
                              f"{load.failures[:5]}; the router's warnings:\n{setup.warnings('router')}"
    time.sleep(4)  # two scrapes
    assert not failed_transfers(), f"KV transfers failed during the layout change (a mixed pair?): {failed_transfers()}"
    decode = setup.pods("decode")[0]
    assert flag(decode["spec"]["containers"][0]["args"], "--block-size") == "32"
    assert setup.pod_metrics(decode).get(m.exposed_name(m.KV_TRANSFER_BYTES), 0.0) > 0, "no KV reached the new decode"


def rolled(setup: Any, old: set[str]) -> bool:
    """Every prefill and decode pod is new and ready, and the resource is Ready."""
    pods = [p for c in ("prefill", "decode") for p in setup.pods(c)]
    return (bool(pods) and not {p["metadata"]["name"] for p in pods} & old
            and all(p["status"].get("containerStatuses") and p["status"]["containerStatuses"][0]["ready"]
                    for p in pods) and setup.ready_condition() == "True")


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def prometheus_series(setup: Any, query: str) -> list[Any]:
    url = f"{setup.info['prometheus']}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    return json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]  # type: ignore[no-any-return]


# --- the operator restarted ----------------------------------------------------------------

def test_operator_pod_deleted_mid_reconcile_converges_without_duplicates(setup: Any) -> None:
    ns = setup.info["operator_namespace"]
    operator = setup.json("get", "pods", "-n", ns)["items"]
    scale_decode(setup, 2)  # a reconcile starts now...
    setup.kubectl("delete", "pod", "-n", ns, *[p["metadata"]["name"] for p in operator], "--wait=false")
    # ...and its operator goes away; the new one must finish the job.
    setup.wait("a new operator pod is running",
               lambda: any(p["status"]["phase"] == "Running" and p["metadata"]["name"] not in
                           {o["metadata"]["name"] for o in operator}
                           for p in setup.json("get", "pods", "-n", ns)["items"]), timeout=180)
    wait_pool(setup, "decode", 2)
    selector = f"app.kubernetes.io/instance={setup.name}"
    for kind, expected in (("deployments", 3), ("services", None), ("poddisruptionbudgets", None)):
        names = setup.kubectl("get", kind, "-n", setup.namespace, "-l", selector, "-o", "name").split()
        assert len(names) == len(set(names)) and names, (kind, names)
        if expected is not None:
            assert len(names) == expected, names
    replicasets = setup.json("get", "replicasets", "-n", setup.namespace, "-l", selector)["items"]
    live = [r for r in replicasets if r["spec"]["replicas"] > 0]
    assert sorted(r["metadata"]["labels"]["app.kubernetes.io/component"] for r in live) == \
        ["decode", "prefill", "router"], [r["metadata"]["name"] for r in live]
    scale_decode(setup, 1)
    wait_pool(setup, "decode", 1)
    assert setup.ready_condition() == "True"


# --- two models, one served name -----------------------------------------------------------

def test_two_models_serving_one_name_keep_their_own_pools_routers_and_signals(setup: Any, steady_load: Any) -> None:
    other = f"{setup.name}-b"
    setup.kubectl("apply", "-f", "-", input=json.dumps(e2e.resource(other, setup.namespace,
                                                                    setup.info["model_name"])))
    try:
        setup.wait(f"{other} Ready", lambda: setup.ready_condition(other) == "True", timeout=420)
        port = cluster.free_port()
        forward = subprocess.Popen([str(k8s_build.bin_dir() / "kubectl"), "port-forward", "-n", setup.namespace,
                                    f"service/{other}", f"{port}:{e2e.ROUTER_PORT}", "--address", "127.0.0.1"],
                                   env=setup.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            other_url = f"http://127.0.0.1:{port}/v1"
            setup.wait("the second router through port-forward",
                       lambda: urllib.request.urlopen(f"{other_url}/models", timeout=3).status == 200, timeout=60)
            # Our traffic is our signal only: the autoscaler's own prefill queries (keyed on the
            # resource, not the served name), on what Prometheus scraped; theirs saw no request yet.
            with steady_load(clients=4, max_tokens=2) as load:
                load.wait_completed(20, timeout=180)
            assert not load.failures, load.failures[:5]
            time.sleep(4)  # two scrapes
            values = {model: prometheus_value(setup, sig.pool_queries(
                sig.PREFILL, sig.Selector(setup.namespace, model, sig.PREFILL))[sig.LATENCY_P])
                for model in (setup.name, other)}
            assert values[setup.name] is not None and values[setup.name] > 0, values
            assert values[other] is None, values

            ours = {c: setup.pods(c)[0] for c in ("prefill", "decode")}
            theirs = {c: setup.pods(c, other)[0] for c in ("prefill", "decode")}
            assert not {p["metadata"]["name"] for p in ours.values()} & {p["metadata"]["name"] for p in theirs.values()}
            before = {k: setup.pod_metrics(p).get(GENERATED, 0.0) for k, p in {**{f"ours-{c}": p for c, p in ours.items()},
                                                                             **{f"theirs-{c}": p for c, p in theirs.items()}}.items()}
            # Requests to the second router reach only its own workers.
            answers = burst(setup.client(other_url), setup.info["model_name"], 4)
            assert all(a.choices[0].finish_reason == "length" for a in answers)
            assert setup.pod_metrics(theirs["decode"]).get(GENERATED, 0.0) > before["theirs-decode"]
            assert setup.pod_metrics(ours["decode"]).get(GENERATED, 0.0) == before["ours-decode"]

        finally:
            forward.terminate()
            forward.wait(timeout=10)
    finally:
        setup.kubectl("delete", "disaggregatedmodel", other, "-n", setup.namespace, "--ignore-not-found",
                      "--timeout=180s")
    setup.wait(f"{other}'s pods gone", lambda: not setup.json(
        "get", "pods", "-n", setup.namespace, "-l", f"app.kubernetes.io/instance={other}")["items"], timeout=180)
    assert setup.ready_condition() == "True"


# --- deletion (last: it removes what the tests above use) ----------------------------------

def test_delete_removes_everything_it_created(setup: Any) -> None:
    selector = f"app.kubernetes.io/instance={setup.name}"
    setup.kubectl("delete", "disaggregatedmodel", setup.name, "-n", setup.namespace, "--timeout=120s")
    kinds = "pods,services,deployments,poddisruptionbudgets,serviceaccounts,roles,rolebindings,secrets,endpointslices"
    deadline = time.monotonic() + 120
    left: list[str] = []
    while time.monotonic() < deadline:
        left = setup.kubectl("get", kinds, "-n", setup.namespace, "-l", selector, "-o", "name").split()
        if not left:
            break
        time.sleep(1)
    assert not left, f"still there {120}s after the delete: {left}"
    # Our claim stays bound to our volume (the operator never created or touched it).
    pvc = setup.json("get", "pvc", "model", "-n", setup.namespace)
    assert pvc["status"]["phase"] == "Bound"

