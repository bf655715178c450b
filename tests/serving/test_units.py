"""Pure parts of the serving path: placement, text assembly, request parsing, workloads, stats."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from tandem.worker.bench.client import RequestResult
from tandem.worker.bench.stats import percentile, summarize
from tandem.worker.bench.workload import (
    RequestSpec,
    TraceRow,
    arrivals,
    load_trace,
    prompt_text,
    resolve_trace,
    scale_trace,
)
from tandem.worker.kv.prefix_hash import block_hashes
from tandem.worker.router.discovery import read_workers_file, ready_endpoints
from tandem.worker.router.errors import APIError
from tandem.worker.router.openai_api import (
    ChatRequest,
    CompletionRequest,
    parse_body,
    resolve_max_tokens,
    sampling_from,
)
from tandem.worker.router.placement import Candidate, PrefixAffinity, pick_decode, pick_prefill
from tandem.worker.router.tokens import TextAssembler


# --- placement ---
def test_decode_goes_to_most_free_blocks_with_matching_layout() -> None:
    cands = [Candidate("a", "h1", free_blocks=10), Candidate("b", "h1", free_blocks=50),
             Candidate("c", "h2", free_blocks=90)]
    assert pick_decode(cands, layout_hash="h1").url == "b"  # type: ignore[union-attr]
    assert pick_decode(cands, exclude={"b"}, layout_hash="h1").url == "a"  # type: ignore[union-attr]
    assert pick_decode(cands, exclude={"a", "b"}, layout_hash="h1") is None


@pytest.mark.parametrize(("preferred", "queues", "expected"), [
    (None, (100, 10), "q"),  # shortest queue
    ("p", (100, 10), "p"),  # affinity wins while within the slack
    ("p", (5000, 10), "q"),  # ...but not when far behind
    ("gone", (100, 10), "q"),  # a remembered worker that is not a candidate is ignored
])
def test_prefill_by_queue_and_prefix_affinity(preferred: str | None, queues: tuple[int, int], expected: str) -> None:
    cands = [Candidate("p", "h", queued_tokens=queues[0]), Candidate("q", "h", queued_tokens=queues[1]),
             Candidate("r", "other", queued_tokens=0)]
    assert pick_prefill(cands, "h", preferred).url == expected  # type: ignore[union-attr]


def first_block(tokens: list[int]) -> bytes | None:
    """The first-block policy's key: the hash of the prompt's first full block."""
    return next(iter(block_hashes(tokens, 16)), None)


def test_prefix_affinity_is_bounded_and_keyed_by_first_block() -> None:
    aff = PrefixAffinity(capacity=2)
    k1, k2, k3 = (first_block([i] * 16 + [99]) for i in range(3))
    assert first_block([1, 2, 3]) is None
    assert first_block([7] * 16 + [1]) == first_block([7] * 16 + [2, 3])
    aff.put(k1, "a")
    aff.put(k2, "b")
    aff.put(k3, "c")
    assert aff.get(k1) is None and aff.get(k2) == "b" and aff.get(k3) == "c"


# --- text assembly ---
class FakeTokenizer:
    """One character per token id (ord), so expectations are obvious. The real tokenizer is used end to end."""

    def new_detokenizer(self, _prompt: list[int]) -> Any:
        class D:
            def push(self, t: int) -> str:
                return chr(t)
        return D()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def push_text(asm: TextAssembler, text: str, finish_at_end: bool = True) -> list[Any]:
    out = []
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        out.append(asm.push([ord(ch)], None, "length" if last and finish_at_end else None))
        if out[-1].finish_reason:
            break
    return out


def test_stop_string_split_across_tokens_is_held_back_and_cut() -> None:
    asm = TextAssembler(FakeTokenizer(), [], ["END"])  # type: ignore[arg-type]
    deltas = push_text(asm, "abcENxyENDzz")
    assert asm.text == "abcENxy"
    assert deltas[-1].finish_reason == "stop"
    # Two characters (len("END") - 1) are always held back until they cannot start the stop string.
    assert [d.text for d in deltas] == ["", "", "a", "b", "c", "E", "N", "x", "y", ""]


def test_without_stop_strings_text_flows_and_finish_flushes() -> None:
    asm = TextAssembler(FakeTokenizer(), [], [])  # type: ignore[arg-type]
    deltas = push_text(asm, "hello")
    assert [d.text for d in deltas] == list("hello")
    assert deltas[-1].finish_reason == "length" and asm.num_tokens == 5


# --- request parsing ---
def parse(body: dict[str, Any], chat: bool = False) -> Any:
    return parse_body(json.dumps(body).encode(), ChatRequest if chat else CompletionRequest)


def test_vllm_extensions_and_defaults() -> None:
    req = parse({"model": "m", "prompt": "x", "max_tokens": 5, "ignore_eos": True, "top_k": -1, "stop": "##",
                 "stream_options": {"include_usage": True}})  # unknown fields: 400 (test_router_openai_api)
    s = sampling_from(req, 5, False)
    assert (s.ignore_eos, s.top_k, s.stop, s.max_tokens) == (True, 0, ["##"], 5)
    assert req.stream_options.include_usage
    chat = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                  "max_completion_tokens": 7}, chat=True)
    assert chat.max_completion_tokens == 7


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "x", "echo": True, "logprobs": 6},
    {"model": "m", "prompt": ["a", ""]},
    {"model": "m", "prompt": "x", "max_tokens": 0},  # 0 only with echo
    {"model": "m", "prompt": "x", "presence_penalty": 2.5},
    {"model": "m", "prompt": "x", "top_p": 0},
])
def test_unsupported_or_invalid_is_a_400(body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400


def test_max_tokens_against_the_context() -> None:
    assert resolve_max_tokens(None, 10, 100, 16) == 16
    assert resolve_max_tokens(None, 10, 100, None) == 90
    for args in ((91, 10, 100, None), (None, 100, 100, 16)):
        with pytest.raises(APIError) as info:
            resolve_max_tokens(*args)
        assert info.value.code == "context_length_exceeded"


# --- discovery ---
def test_endpoint_slices_keep_ready_endpoints_only() -> None:
    slices = [{"addressType": "IPv4", "ports": [{"name": "kv", "port": 5555}, {"name": "http", "port": 8000}],
               "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                             {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                             {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                             {"addresses": ["10.0.0.4"]}]},
              {"addressType": "IPv6", "ports": [{"name": "http", "port": 8000}],
               "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": True}}]}]
    assert ready_endpoints(slices) == ["http://10.0.0.1:8000", "http://10.0.0.4:8000", "http://[fd00::5]:8000"]


def test_workers_file_forms(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text("prefill: [http://a:1]\ndecode: [http://b:2, http://c:3]\n")
    assert read_workers_file(f) == ["http://a:1", "http://b:2", "http://c:3"]
    f.write_text("- http://a:1\n")
    assert read_workers_file(f) == ["http://a:1"]
    f.write_text("just a string")
    with pytest.raises(ValueError, match="expected a list"):
        read_workers_file(f)


# --- workloads and statistics ---
def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = arrivals(4000, 5.0, "poisson", random.Random(1))
    assert times == sorted(times) and times[0] == 0.0
    assert 4000 / times[-1] == pytest.approx(5.0, rel=0.05)
    assert arrivals(3, 2.0, "constant", random.Random(0)) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        arrivals(3, 2.0, "bursty", random.Random(0))


def test_trace_scaling_says_what_it_did() -> None:
    rows = [TraceRow(float(i), 1000 * (i + 1), 100, []) for i in range(5)]  # 1 req/s, median prompt 3000
    specs, scaling = scale_trace(rows, rate=4.0, time_scale=None, target_median_prompt=300, length_scale=None,
                                 max_prompt_tokens=400, max_output_tokens=50)
    assert [s.send_at for s in specs] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [s.prompt_tokens for s in specs] == [100, 200, 300, 400, 400]  # x0.1, clamped at 400
    assert all(s.output_tokens == 10 for s in specs)
    assert "x0.25" in scaling.description and "3000 -> 300" in scaling.description


@pytest.mark.skipif(not Path("/work/shared/traces").is_dir(),
                    reason="the shared traces folder is not on this machine")
def test_both_real_traces_load() -> None:
    moon = load_trace(resolve_trace("mooncake"), 50)
    azure = load_trace(resolve_trace("azure-code"), 50, offset=10)
    for rows in (moon, azure):
        assert len(rows) == 50 and rows[0].arrival == 0.0
        assert all(b.arrival >= a.arrival for a, b in itertools.pairwise(rows))
    assert moon[0].hash_ids and not azure[0].hash_ids


def test_shared_trace_prefixes_become_shared_text() -> None:
    a = prompt_text(RequestSpec(0, 2000, 1, prefix_blocks=[7, 8, 1]), 0, 1.0)
    b = prompt_text(RequestSpec(0, 2000, 1, prefix_blocks=[7, 8, 2]), 1, 1.0)
    c = prompt_text(RequestSpec(0, 2000, 1, prefix_blocks=[9, 8, 3]), 2, 1.0)
    assert a.split()[:1024] == b.split()[:1024] and a != b
    assert a.split()[:10] != c.split()[:10]
    assert len(a.split()) == 2000


def test_percentiles_and_goodput() -> None:
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    good = RequestResult("t", True, 0, ttft=0.1, e2e=1.0, itls=[0.01, 0.01], output_tokens=3)
    slow = RequestResult("t", True, 0, ttft=2.0, e2e=3.0, itls=[0.01], output_tokens=2)
    failed = RequestResult("t", False, 0, error="HTTP 500")
    s = summarize([good, slow, failed], duration=2.0, slo_ttft=0.5, slo_itl=0.05)
    assert (s.completed, s.failed) == (2, 1)
    assert s.goodput == 0.5 and s.slo_attainment == pytest.approx(1 / 3)
    assert s.output_throughput == 2.5 and s.errors == ["HTTP 500"]


def test_endpoint_slices_from_the_kubernetes_client_models() -> None:
    """The k8s discovery path turns the client's typed objects into the API's JSON shape first."""
    client = pytest.importorskip("kubernetes.client", reason="kubernetes client (operator extra) not installed")
    sl = client.V1EndpointSlice(
        address_type="IPv4", ports=[client.DiscoveryV1EndpointPort(name="http", port=8000)],
        endpoints=[client.V1Endpoint(addresses=["10.1.0.7"], conditions=client.V1EndpointConditions(ready=True)),
                   client.V1Endpoint(addresses=["10.1.0.8"], conditions=client.V1EndpointConditions(ready=False))])
    as_json = client.ApiClient().sanitize_for_serialization(sl)
    assert ready_endpoints([as_json]) == ["http://10.1.0.7:8000"]
