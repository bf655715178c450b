"""Request parsing: JSON types are taken as JSON has them (no "yes" for true, no true for 1), params
are named as the API names them, best_of is refused, user/system messages need content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.worker.router.errors import APIError
from tandem.worker.router.openai_api import ChatRequest, CompletionRequest, chat_messages, parse_body


def parse(body: dict[str, Any], chat: bool = False) -> Any:
    return parse_body(json.dumps(body).encode(), ChatRequest if chat else CompletionRequest)


def refused(body: dict[str, Any], chat: bool = False) -> APIError:
    with pytest.raises(APIError) as info:
        req = parse(body, chat)
        if chat:
            chat_messages(req)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"ignore_eos": "true"}, "ignore_eos"),
    ({"temperature": True}, "temperature"), ({"temperature": "0.5"}, "temperature"), ({"seed": False}, "seed"),
    ({"n": True}, "n"), ({"logprobs": True}, "logprobs"), ({"echo": "no"}, "echo"),
    ({"stop_token_ids": [True]}, "stop_token_ids.0"), ({"stream_options": {"include_usage": "yes"}},
                                                        "stream_options.include_usage"),
    ({"best_of": 2}, "best_of"), ({"best_of": 3}, "best_of"), ({"best_of": True}, "best_of"),
    ({"prompt": 5}, "prompt"), ({"prompt": [True, 2]}, "prompt"), ({"prompt": {"a": 1}}, "prompt"),
    ({"stop": 123}, "stop"),
])
def test_wrong_types_are_refused_with_the_param_named(extra: dict[str, Any], param: str) -> None:
    err = refused({"model": "m", "prompt": "x", **extra})
    assert err.param == param, err.message


@pytest.mark.parametrize("extra", [
    {}, {"best_of": 1}, {"best_of": None}, {"stream": None}, {"stream": True, "stream_options": {"include_usage": True}},
    {"max_tokens": 5.0}, {"temperature": 1}, {"ignore_eos": True, "return_token_ids": True, "top_k": -1},
    {"prompt": [1, 2, 3]}, {"prompt": [[1, 2]]}, {"prompt": ["x"]}, {"logprobs": 2, "seed": 3, "user": "u"},
])
def test_what_clients_send_is_accepted(extra: dict[str, Any]) -> None:
    parse({"model": "m", "prompt": "x", **extra})


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user"}, "messages.0.content"), ({"role": "system", "content": None}, "messages.0.content"),
    ({"role": "user", "content": 5}, "messages.0.content"), ({"role": "wizard", "content": "x"}, "messages.0.role"),
])
def test_chat_messages_need_proper_content(message: dict[str, Any], param: str) -> None:
    assert refused({"model": "m", "messages": [message]}, chat=True).param == param


def test_assistant_message_may_leave_content_out() -> None:
    req = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"},
                                            {"role": "assistant", "content": None, "tool_calls": []},
                                            {"role": "user", "content": [{"type": "text", "text": "again"}]}],
                 "max_completion_tokens": 3, "logprobs": None}, chat=True)
    assert [m["content"] for m in chat_messages(req)] == ["hi", "", "", "again"]
