"""KV the decode side can trust (issue 18, point 3): prefix-cache poisoning through /decode.

The repro, against real worker processes (`tandem serve`): a caller holding the worker control token
reserves KV on the decode worker, has the prefill worker compute and ship the KV of prompt A, then
calls /decode with prompt B. Before, the decode worker decoded B on A's KV and registered A's blocks
in its prefix cache under B's tokens, so a later request with prompt B was served A's KV as prefix-cache
hits: a wrong answer for someone else. Now the prefill worker sends a digest of the tokens it
prefilled inside the KV transfer (BEGIN); the decode worker compares it with the request's prompt,
and on a mismatch neither uses nor caches the received blocks: it prefills locally (same answer as a
monolithic greedy run) and counts `tandem_kv_transfer_failures_total{reason="prompt_mismatch"}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Stack, control_headers, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
# Two prompts of the same length (the reservation's block count fits both), three blocks of 16 but
# the last partial: two full blocks would be registered in the prefix cache. Token ids no other
# test uses, so the session's shared stacks have none of them cached.
PROMPT_A = [300 + (i * 7) % 190 for i in range(40)]
PROMPT_B = [100 + (i * 11) % 190 for i in range(40)]
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def monolithic_greedy(mono: Stack, prompt: list[int]) -> list[int]:
    resp = httpx.post(f"{mono.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    tokens = list(resp.json()["choices"][0]["token_ids"])
    assert len(tokens) == MAX_TOKENS
    return tokens


def stream_chunks(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    chunks = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
    assert chunks and chunks[-1]["finished"], chunks
    assert not any(c.get("error") for c in chunks), chunks
    return chunks


def prefill_and_ship(stack: Stack, request_id: str, prompt: list[int]) -> int:
    """Reserve on the decode worker and have the prefill worker compute and ship `prompt`'s KV into it;
    returns the prefill worker's first token."""
    decode, prefill = stack.procs("decode")[0]["url"], stack.procs("prefill")[0]["url"]
    reserved = httpx.post(f"{decode}/kv/reserve", headers=control_headers(), timeout=10,
                          json={"request_id": request_id, "num_tokens": len(prompt), "deadline_s": 30})
    assert reserved.status_code == 200, reserved.text
    target = reserved.json()
    shipped = httpx.post(f"{prefill}/prefill", headers=control_headers(), timeout=60, json={
        "request_id": request_id, "prompt_token_ids": prompt, "sampling": SAMPLING,
        "target": {key: target[key] for key in ("kv_address", "transfer_id", "block_ids", "layout_hash")}})
    assert shipped.status_code == 200, shipped.text
    assert shipped.json()["kv_sent"] is True, shipped.json()
    return int(shipped.json()["first_token_id"])


def mismatches(decode: str) -> float:
    return metric_value(decode, "tandem_kv_transfer_failures_total", reason="prompt_mismatch", role="decode")


@pytest.fixture(scope="module")
def plain(start_stack: Callable[..., Stack]) -> Stack:
    """A stack of its own: the attack makes its decode worker prefill locally (tandem_fallback_prefills_total),
    which the session's shared disaggregated stack must not show to later tests (test_openai_parity
    asserts no fallback there)."""
    return start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1")


@pytest.fixture(scope="module")
def secure(start_stack: Callable[..., Stack]) -> Stack:
    """KV over CURVE (--secure-kv): the channel is authenticated, but /decode's caller still names the prompt."""
    return start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--secure-kv")


@pytest.mark.parametrize("kv", ["plain", "secure"])
def test_kv_shipped_for_one_prompt_is_neither_used_nor_cached_for_another(kv: str, mono: Stack,
                                                                         request: pytest.FixtureRequest) -> None:
    disagg: Stack = request.getfixturevalue(kv)
    wait_until_disaggregated(disagg)
    decode = disagg.procs("decode")[0]["url"]
    want_b = monolithic_greedy(mono, PROMPT_B)
    assert monolithic_greedy(mono, PROMPT_A) != want_b  # the two prompts' KV lead to different answers
    fallbacks, mismatched = metric_value(decode, "tandem_fallback_prefills_total"), mismatches(decode)

    # The attack: A's KV shipped into the reservation, then /decode claims it holds prompt B. The caller
    # even gives B's true first token: only the KV is foreign.
    rid = f"poison-{uuid.uuid4().hex[:8]}"
    prefill_and_ship(disagg, rid, PROMPT_A)
    chunks = stream_chunks(httpx.post(f"{decode}/decode", headers=control_headers(), timeout=60, json={
        "request_id": rid, "prompt_token_ids": PROMPT_B, "first_token_id": want_b[0], "sampling": SAMPLING,
        "kv_ready": True}))
    got = [want_b[0], *(t for c in chunks for t in c["token_ids"])]
    assert got == want_b, "decode continued prompt B on prompt A's KV"
    assert chunks[0].get("fallback") is True, "the decode worker must prefill B locally, not use A's KV"
    assert mismatches(decode) == mismatched + 1
    assert metric_value(decode, "tandem_fallback_prefills_total") == fallbacks + 1
    log = Path(disagg.procs("decode")[0]["log_path"]).read_text()
    said = [line for line in log.splitlines() if rid in line and "computed for another prompt" in line]
    assert said and "neither used nor cached" in said[0], log[-2000:]

    # Later requests with prompt B, as the router sends them when it prefills on the decode worker (no
    # prefill worker, a migration, a fallback): A's blocks must not be in the prefix cache under B's tokens.
    later = stream_chunks(httpx.post(f"{decode}/generate", headers=control_headers(), timeout=60, json={
        "request_id": f"later-{uuid.uuid4().hex[:8]}", "prompt_token_ids": PROMPT_B, "sampling": SAMPLING}))
    assert [t for c in later for t in c["token_ids"]] == want_b, "a later request got prompt A's KV from the prefix cache"
    longer = [*PROMPT_B, *want_b[:4]]  # a prompt that extends B: its leading blocks are B's
    extended = stream_chunks(httpx.post(f"{decode}/generate", headers=control_headers(), timeout=60, json={
        "request_id": f"longer-{uuid.uuid4().hex[:8]}", "prompt_token_ids": longer,
        "sampling": {**SAMPLING, "max_tokens": MAX_TOKENS - 4}}))
    assert [t for c in extended for t in c["token_ids"]] == want_b[4:]
    # And through the router, disaggregated: the same answer again.
    resp = httpx.post(f"{disagg.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT_B, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    assert list(resp.json()["choices"][0]["token_ids"]) == want_b


def test_kv_shipped_for_the_same_prompt_is_used(disagg: Stack, mono: Stack) -> None:
    """The honest path is unchanged: matching digests, the received KV is decoded on, no fallback."""
    wait_until_disaggregated(disagg)
    decode = disagg.procs("decode")[0]["url"]
    prompt = [PROMPT_A[0] + 1, *PROMPT_A[1:]]
    want = monolithic_greedy(mono, prompt)
    fallbacks, mismatched = metric_value(decode, "tandem_fallback_prefills_total"), mismatches(decode)
    received = metric_value(decode, "tandem_kv_transfer_seconds_count", direction="recv")
    rid = f"honest-{uuid.uuid4().hex[:8]}"
    first = prefill_and_ship(disagg, rid, prompt)
    assert first == want[0]
    chunks = stream_chunks(httpx.post(f"{decode}/decode", headers=control_headers(), timeout=60, json={
        "request_id": rid, "prompt_token_ids": prompt, "first_token_id": first, "sampling": SAMPLING,
        "kv_ready": True}))
    assert [first, *(t for c in chunks for t in c["token_ids"])] == want
    assert not chunks[0].get("fallback")
    assert metric_value(decode, "tandem_kv_transfer_seconds_count", direction="recv") == received + 1
    assert metric_value(decode, "tandem_fallback_prefills_total") == fallbacks
    assert mismatches(decode) == mismatched
