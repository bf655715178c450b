"""vLLM's names beside Tandem's on one /metrics page: the same values, scrape for scrape."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from tandem.worker import metrics as m
from tandem.worker import metrics_vllm as v
from tandem.worker.server.telemetry import Telemetry


def page(t: Telemetry) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(t.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def drive(t: Telemetry, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        t.set(m.RUNNING_REQUESTS, rng.randint(0, 9))
        t.set(m.WAITING_REQUESTS, rng.randint(0, 9))
        t.set(m.KV_USAGE_RATIO, rng.random())
        for d in (m.PREEMPTIONS, m.PREFIX_CACHE_QUERIES, m.PREFIX_CACHE_HITS, m.PROMPT_TOKENS, m.GENERATION_TOKENS):
            t.inc(d, rng.randint(0, 50))
        for d in (m.TTFT, m.ITL, m.E2E):
            t.observe(d, rng.expovariate(10))
        t.inc(m.REQUESTS, reason=rng.choice(["stop", "length", "error"]))


def tandem_samples(found: dict, name: str) -> dict:  # type: ignore[type-arg]
    return {dict(k).get("reason", dict(k).get("le", "")): val for k, val in found[name].items()}


def mirrored_samples(found: dict, name: str) -> dict:  # type: ignore[type-arg]
    return {dict(k).get("finished_reason", dict(k).get("le", "")): val for k, val in found[name].items()}


def test_every_mirror_carries_its_sources_values_with_model_name() -> None:
    for role, mirrors in (("decode", v.WORKER_MIRRORS), ("router", v.ROUTER_MIRRORS)):
        t = Telemetry("tiny", role, role, (*m.ALL_WORKER_METRICS, *m.ROUTER_ONLY_METRICS))
        drive(t, seed=len(role))
        found = page(t)
        for mirror in mirrors:
            suffixes = ("_bucket", "_sum", "_count") if mirror.source.kind == "histogram" else ("",)
            for suffix in suffixes:
                name, source = v.exposed_name(mirror) + suffix, m.exposed_name(mirror.source) + suffix
                assert all(dict(k)["model_name"] == "tiny" for k in found[name]), name
                theirs = tandem_samples(found, source)
                if mirror.finished_reasons is not None:
                    theirs = {r: val for r, val in theirs.items() if r in mirror.finished_reasons}
                assert mirrored_samples(found, name) == theirs, name
        others = {v.exposed_name(x) for x in v.ALL_MIRRORS if x not in mirrors}
        assert not others & set(found), f"{role} exports another role's vLLM names"


def test_request_success_leaves_out_errors() -> None:
    t = Telemetry("tiny", "router", "router", (m.REQUESTS,))
    for reason in ("stop", "stop", "length", "error", "error", "error"):
        t.inc(m.REQUESTS, reason=reason)
    assert mirrored_samples(page(t), "vllm:request_success_total") == {"stop": 2.0, "length": 1.0}


def test_a_mirror_whose_source_this_process_lacks_is_absent() -> None:
    t = Telemetry("tiny", "prefill", "prefill", (m.RUNNING_REQUESTS,))
    t.set(m.RUNNING_REQUESTS, 3)
    found = page(t)
    assert found["vllm:num_requests_running"] == {(("model_name", "tiny"),): 3.0}
    assert "vllm:kv_cache_usage_perc" not in found
