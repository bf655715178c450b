"""A failed KV transfer makes the decode worker prefill locally: slower, never wrong.

The prefill worker runs with the hidden `--fault drop-kv` test hook (it computes the prompt and
returns the first token but ships no KV), which is what a dead link or an expired transfer
deadline looks like from the decode side.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from openai import OpenAI

from tandem.worker import faults

from .conftest import Stack, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

PROMPT = "Prefill computes the prompt; decode generates one token at a time. Hello, world!"


def faults_on() -> dict[str, str]:
    """The test's environment with fault injection allowed (`--prefill-fault` is refused without it)."""
    return {**os.environ, faults.ENV: "1"}


def test_transfer_failure_falls_back_with_identical_tokens(start_stack: Callable[..., Stack], mono: Stack) -> None:
    faulty = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                         "--prefill-fault", "drop-kv", env=faults_on())
    wait_until_disaggregated(faulty)  # else the first request may go to decode alone, with no transfer
    outs = []
    for stack in (faulty, mono):
        c = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                  "extra_body": {"ignore_eos": True, "return_token_ids": True}}
            if stream:
                ids = [t for ch in c.completions.create(stream=True, **kw) for choice in ch.choices
                       for t in choice.model_extra["token_ids"]]
            else:
                ids = c.completions.create(**kw).choices[0].model_extra["token_ids"]
            outs.append(ids)
    assert outs[0] == outs[1] == outs[2] == outs[3]
    assert len(outs[0]) == 10
    decode = faulty.procs("decode")[0]["url"]
    assert metric_value(decode, "tandem_fallback_prefills_total") == 2
    assert metric_value(decode, "tandem_kv_transfer_bytes_total") == 0
