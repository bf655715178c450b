"""Request parsing: JSON types are taken as JSON has them (no "yes" for true, no true for 1), params
are named as the API names them, best_of is refused, user/system messages need content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.worker.router.errors import APIError
from tandem.worker.router.openai_api import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    parse_body,
    sampling_from,
)


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


@pytest.mark.parametrize(("extra", "param"), [
    ({"functions": [{"name": "f"}]}, "functions"), ({"made_up_option": 1}, "made_up_option"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
def test_unimplemented_fields_are_refused_not_dropped(extra: dict[str, Any], param: str) -> None:
    for chat, base in ((False, {"prompt": "x"}), (True, {"messages": [{"role": "user", "content": "x"}]})):
        err = refused({"model": "m", **base, **extra}, chat=chat)
        assert err.param == param and param.split(".")[-1] in err.message, err.message


def test_tools_are_chat_only() -> None:
    for extra, param in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"tool_choice": "auto"}, "tool_choice")):
        err = refused({"model": "m", "prompt": "x", **extra})
        assert err.param == param and param in err.message, err.message


def test_assistant_tool_calls_reach_the_template_with_arguments_as_objects() -> None:
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    req = parse({"model": "m", "messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": None, "tool_calls": call}]}, chat=True)
    assert chat_messages(req)[1]["tool_calls"] == [{"id": "c", "type": "function",
                                                    "function": {"name": "f", "arguments": {"a": 1}}}]
    err = refused({"model": "m", "messages": [{"role": "user", "content": "x"},
                                              {"role": "assistant", "tool_calls": [{"id": "c"}]}]}, chat=True)
    assert err.param == "messages.1.tool_calls.0"


@pytest.mark.parametrize("extra", [
    {"tools": None, "tool_choice": None, "logit_bias": None, "response_format": {"type": "text"}, "functions": []},
    {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True},
])
def test_fields_that_ask_for_nothing_or_mean_nothing_here_are_accepted(extra: dict[str, Any]) -> None:
    parse({"model": "m", "prompt": "x", **extra})
    parse({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}, chat=True)


def test_message_name_and_tool_call_id_reach_the_template_and_replayed_answers_are_accepted() -> None:
    req = parse({"model": "m", "messages": [
        {"role": "user", "content": "x", "name": "ann"},
        {"role": "assistant", "content": "y", "refusal": None, "annotations": [], "tool_calls": None, "audio": None},
        {"role": "tool", "content": "z", "tool_call_id": "c1"}]}, chat=True)
    assert chat_messages(req) == [{"role": "user", "content": "x", "name": "ann"}, {"role": "assistant", "content": "y"},
                                  {"role": "tool", "content": "z", "tool_call_id": "c1"}]


def test_penalties_and_logit_bias_reach_the_sampling() -> None:
    req = parse({"model": "m", "prompt": "x", "presence_penalty": -0.5, "frequency_penalty": 2,
                 "repetition_penalty": 1.3, "logit_bias": {"7": -100, "3": 2.5}})
    s = sampling_from(req, 4, False, vocab_size=10)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (-0.5, 2.0, 1.3)
    assert s.logit_bias == {7: -100.0, 3: 2.5}


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 2.01}, {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": 5e-324},
    {"logit_bias": {"1": 101}},
    {"logit_bias": {"1": "5"}}, {"logit_bias": {"x": 1}}, {"logit_bias": {"-1": 1}}, {"logit_bias": {"10": 1}},
    {"logit_bias": {"\u0661": 1}}, {"logit_bias": [1]},
])
def test_bad_penalties_and_logit_bias_are_400s_naming_the_field(extra: dict[str, Any]) -> None:
    with pytest.raises(APIError) as info:
        sampling_from(parse({"model": "m", "prompt": "x", **extra}), 4, False, vocab_size=10)
    assert info.value.status == 400 and info.value.param == next(iter(extra)), info.value.message
