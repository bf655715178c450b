"""usage.prompt_tokens_details.cached_tokens (issue 24): the prompt tokens a worker's prefix cache served,
as OpenAI's API reports them, through the official openai client on real stacks (disaggregated: the
prefill worker's count; monolithic and chunked: the worker's)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from openai import OpenAI

from .conftest import Stack

pytestmark = pytest.mark.integration

BLOCK = 16


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def fresh_prompt(tokens: int) -> list[int]:
    """Token ids no other test sent (the stacks are shared): a random start, then a run."""
    start = uuid.uuid4().int % 300
    return [(start + i * 7) % 500 + 1 for i in range(tokens)]


@pytest.mark.parametrize("mode", ["disagg", "mono", "chunked"])
def test_a_repeated_prompt_reports_its_cached_tokens(mode: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(mode)
    prompt = fresh_prompt(75)  # 4 full blocks, the last token always computed
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = client(stack).completions.create(**kw).usage
    again = client(stack).completions.create(**kw).usage
    assert first.prompt_tokens == again.prompt_tokens == 75
    assert first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens == 4 * BLOCK
    streamed = list(client(stack).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 4 * BLOCK


def test_n_choices_count_their_prompt_once(disagg: Stack) -> None:
    prompt = fresh_prompt(40)  # 2 full blocks
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0.7, "seed": 1}
    assert client(disagg).completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    usage = client(disagg).completions.create(n=3, **kw).usage
    assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (40, 2 * BLOCK)
    chat = client(disagg).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 40}],
                                                  max_tokens=2)
    chat_again = client(disagg).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 40}],
                                                        max_tokens=2)
    assert chat_again.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens_details.cached_tokens
    assert chat_again.usage.prompt_tokens_details.cached_tokens == \
        (chat_again.usage.prompt_tokens - 1) // BLOCK * BLOCK
