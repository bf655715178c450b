"""The pure checks behind issue 18's input bounds: the router's body parsing (NaN, deep nesting, lone
surrogates, sampling ranges), the worker's control API models, and the per-caller reservation quota."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.worker.router.errors import APIError
from tandem.worker.router.openai_api import CompletionRequest, load_json, parse_body
from tandem.worker.server.kv_link import PeerQuota
from tandem.worker.server.protocol import (
    MAX_DEADLINE_S,
    MAX_RESERVE_DEADLINE_S,
    DecodeRequest,
    GenerateRequest,
    ReserveRequest,
    Sampling,
)


def refused(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(raw, CompletionRequest)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "x", "temperature": NaN}',
    b'{"model": "m", "prompt": "x", "top_p": Infinity}',
    b'{"model": "m", "prompt": "x", "min_p": -Infinity}',
])
def test_nan_and_infinity_are_not_json(raw: bytes) -> None:
    assert "not a JSON number" in refused(raw).message


def test_nesting_past_the_recursion_limit_is_a_400() -> None:
    assert "nested too deeply" in refused(b"[" * 100_000 + b"]" * 100_000).message
    assert "nested too deeply" in refused(b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}").message


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "\\ud800"}', b'{"model": "m", "prompt": "x\\uDFFFy"}',
    b'{"model": "m", "prompt": "x", "user": "\\ude00\\ud83d"}',  # a pair in the wrong order is two lone ones
    b'{"model": "m", "prompt": "x", "\\udbff": 1}',  # in a key, too
])
def test_lone_surrogates_are_a_400(raw: bytes) -> None:
    assert "surrogate" in refused(raw).message


@pytest.mark.parametrize("raw", [b'{"a": "\\ud83d\\ude00"}', b'{"a": "\\u00e9 \\\\ud800"}', "{\"a\": \"\U0001F600\"}".encode()])
def test_surrogate_pairs_and_escaped_backslashes_are_fine(raw: bytes) -> None:
    load_json(raw)


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": 2.01}, "temperature"), ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**31}, "top_k"), ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids.0"),
])
def test_sampling_out_of_range_names_the_param(extra: dict[str, Any], param: str) -> None:
    err = refused(json.dumps({"model": "m", "prompt": "x", **extra}).encode())
    assert err.param == param, err.message


@pytest.mark.parametrize("extra", [{"temperature": 1e-50}, {"temperature": 0}, {"temperature": 2}, {"seed": -1},
                                   {"seed": 2**63 - 1}, {"top_k": -1}, {"stop_token_ids": [0, 2**31 - 1]}])
def test_sampling_in_range_is_accepted(extra: dict[str, Any]) -> None:
    parse_body(json.dumps({"model": "m", "prompt": "x", **extra}).encode(), CompletionRequest)


@pytest.mark.parametrize("sampling", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": 2.5}, {"top_p": math.nan},
    {"seed": 2**64}, {"top_k": 2**40}, {"stop_token_ids": [-3]}, {"max_tokens": 0},
])
def test_worker_sampling_bounds(sampling: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Sampling.model_validate_json(json.dumps(sampling))


def test_worker_deadlines_are_finite_and_capped() -> None:
    base = {"request_id": "r", "prompt_token_ids": [1, 2], "sampling": {}}
    for deadline in (math.inf, math.nan, MAX_DEADLINE_S * 2, 0):
        with pytest.raises(ValidationError):
            GenerateRequest.model_validate_json(json.dumps({**base, "deadline_s": deadline}))
        with pytest.raises(ValidationError):
            DecodeRequest.model_validate_json(json.dumps({**base, "first_token_id": 3, "deadline_s": deadline}))
    GenerateRequest.model_validate_json(json.dumps({**base, "deadline_s": MAX_DEADLINE_S}))
    with pytest.raises(ValidationError, match="deadline_s"):
        ReserveRequest.model_validate_json(json.dumps({"request_id": "r", "num_tokens": 8, "deadline_s": 1e6}))
    ReserveRequest(request_id="r", num_tokens=8, deadline_s=MAX_RESERVE_DEADLINE_S)


@pytest.mark.parametrize(("prompt", "sampled_before", "ok"), [
    ([1, 2, 3], 0, True), ([1, 2, 3], 2, True), ([1, 2, 3], 3, False), ([1], 1, False), ([1, 2], 300_000, False),
])
def test_sampled_before_ends_the_prompt(prompt: list[int], sampled_before: int, ok: bool) -> None:
    body = {"request_id": "r", "prompt_token_ids": prompt, "sampling": {}, "sampled_before": sampled_before}
    if ok:
        GenerateRequest.model_validate(body)
    else:
        with pytest.raises(ValidationError, match="sampled_before"):
            GenerateRequest.model_validate(body)


def test_peer_quota_caps_blocks_and_count_per_peer() -> None:
    quota = PeerQuota(max_blocks=10, max_reservations=3)
    assert quota.take("a", 6) is None
    assert "blocks" in (quota.take("a", 5) or "")  # 11 > 10
    assert quota.take("b", 10) is None  # another peer has its own share
    assert quota.take("a", 1) is None and quota.take("a", 1) is None
    assert "reservations" in (quota.take("a", 1) or "")  # a fourth
    quota.give_back("a", 6)
    assert quota.take("a", 8) is None  # 1 + 1 + 8
    for blocks in (1, 1, 8):
        quota.give_back("a", blocks)
    assert quota.take("a", 10) is None  # all given back


class _Receiver:
    def expect(self, transfer_id: str, block_ids: list[int], deadline_s: float, done: Any) -> None:
        pass

    def cancel(self, transfer_id: str, reason: str | None = None) -> bool:
        return True


def test_an_intake_gives_a_reservations_share_back_however_it_ends() -> None:
    import asyncio

    from tandem.worker.server import kv_link

    async def scenario() -> None:
        quota = PeerQuota(max_blocks=4, max_reservations=10)
        intake = kv_link.KVIntake(_Receiver(), lambda request_id: None, quota)
        for rid in ("claimed", "cancelled", "expired"):
            assert quota.take("router", 4) is None
            intake.open(rid, [0, 1, 2, 3], 30.0, "router", 4)
            assert quota.take("router", 1) is not None  # the share is held
            if rid == "claimed":
                intake.claim(rid)
            elif rid == "cancelled":
                intake.cancel(rid)
            else:
                intake._expire(rid)
        assert quota.take("router", 4) is None  # everything given back

    asyncio.run(scenario())
