"""The router's side of structured outputs and tool calls (issue 20): which grammar a request's fields
ask for, what is refused (400 naming the field), and tool calls read out of the three families' formats."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.worker.router.errors import APIError
from tandem.worker.router.openai_api import ChatRequest, CompletionRequest, grammar_of, parse_body, tools_of
from tandem.worker.router.structured import ToolUse, tool_use
from tandem.worker.router.tool_calls import parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "x"}]


def grammar(body: dict[str, Any], chat: bool = True) -> Any:
    req = parse_body(json.dumps({"model": "m", **({"messages": MESSAGES} if chat else {"prompt": "x"}), **body}).encode(),
                     ChatRequest if chat else CompletionRequest)
    return grammar_of(req, tools_of(req))


def refused(body: dict[str, Any], chat: bool = True) -> APIError:
    with pytest.raises(APIError) as info:
        grammar(body, chat)
    assert info.value.status == 400
    return info.value


def test_each_way_of_asking_gives_its_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert grammar({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                "strict": True}}}).spec == json.dumps(schema)
    assert grammar({"response_format": {"type": "json_object"}}).kind == "json_object"
    assert grammar({"response_format": {"type": "text"}}) is None
    assert grammar({"guided_json": json.dumps(schema)}, chat=False).spec == json.dumps(schema)
    assert grammar({"guided_regex": "[a-z]+"}).spec == "[a-z]+"
    assert json.loads(grammar({"structured_outputs": {"choice": ["a", "b"]}}).spec) == ["a", "b"]
    named = grammar({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(named.spec) == WEATHER["function"]["parameters"]
    required = json.loads(grammar({"tools": [WEATHER, TIME], "tool_choice": "required"}).spec)
    assert [c["properties"]["name"]["const"] for c in required["anyOf"]] == ["get_weather", "get_time"]
    assert grammar({"tools": [WEATHER], "tool_choice": "auto"}) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"guided_json": {"type": "object", "description": "x" * 70_000}}, "guided_json"),
])
def test_bad_requests_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def use(choice: Any = "auto") -> ToolUse:
    found = tool_use([WEATHER, TIME], choice)
    assert found is not None
    return found


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',  # Qwen / Hermes
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',  # Llama 3.x
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',  # Mistral
])
def test_auto_reads_each_familys_format(text: str) -> None:
    content, calls = parse(use(), text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_auto_reads_several_calls_and_keeps_text_around_them() -> None:
    text = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse(use(), text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("text", [
    "Just text.", '{"name": "unknown_tool", "parameters": {}}', '<tool_call>{"name": "get_weather"</tool_call>',
    '{"city": "Oslo"}',
])
def test_auto_leaves_what_is_not_a_call_of_these_tools_as_text(text: str) -> None:
    assert parse(use(), text) == (text, [])


def test_forced_outputs_are_the_calls_json() -> None:
    named = use({"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse(named, '{"city": "Oslo"}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = parse(use("required"), '{"name": "get_time", "arguments": {}}')
    assert calls[0].name == "get_time" and calls[0].arguments == "{}"
    assert parse(use("required"), '{"name": "get_ti') == ('{"name": "get_ti', [])  # cut off by max_tokens: text
    assert parse(use("none"), '{"name": "get_time", "arguments": {}}')[1] == []


def _mistral_tokenizer(tmp_path: Any, special: bool) -> Any:
    """The tiny model's tokenizer with [TOOL_CALLS] added, as Mistral's have it (special) or as plain text."""
    from tokenizers import AddedToken

    from tandem.worker.model.tiny import build_tokenizer, write_tiny_model
    from tandem.worker.model.tokenizer import Tokenizer

    path = write_tiny_model(tmp_path / "m")
    hf = build_tokenizer()
    hf.add_tokens([AddedToken("[TOOL_CALLS]", special=special)])
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


@pytest.mark.parametrize("special", [True, False])
def test_auto_finds_mistrals_marker_in_the_token_ids(tmp_path: Any, special: bool) -> None:
    from tandem.worker.router.tokens import TextAssembler
    from tandem.worker.router.tool_calls import parse_output

    tok = _mistral_tokenizer(tmp_path, special)
    mark = tok.backend.token_to_id("[TOOL_CALLS]")
    prompt = tok.encode("Weather?")
    call = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    ids = [mark, *tok.encode(call, add_special_tokens=False)]
    asm = TextAssembler(tok, prompt, [])
    asm.push(ids, None, "stop")
    assert asm.text == (call if special else "[TOOL_CALLS]" + call)  # the router's text, as the client gets it
    content, calls = parse_output(use(), asm.text, tok, prompt, asm.token_ids)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    # Cut by a stop string before the marker: the marker is not put back, and the text stays as it was.
    text = tok.decode(tok.encode("Hi", add_special_tokens=False))
    cut = [*tok.encode("Hi", add_special_tokens=False), *ids]
    assert parse_output(use(), text[:1], tok, prompt, cut) == (text[:1], [])
    assert parse_output(use("none"), call, tok, prompt, ids) == (call, [])


@pytest.mark.parametrize(("text", "content", "expected"), [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None, [("get_weather", {"city": "Oslo"})]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}', None, [("get_weather", {"city": "Oslo"})]),
    ('Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "Checking both.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('Sure: [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Sure:", [("get_time", {})]),  # before v11
])
def test_auto_reads_mistrals_v11_calls_and_the_content_before_them(text: str, content: str | None,
                                                                    expected: list[tuple[str, Any]]) -> None:
    got_content, calls = parse(use(), text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in calls] == expected


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]unknown_tool[ARGS]{}',  # not a tool of the request
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Os',  # cut off by max_tokens
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time',  # the second has no arguments
    '[TOOL_CALLS]get_weather[ARGS]["Oslo"]',  # arguments not an object
])
def test_a_broken_mistral_v11_call_stays_text(text: str) -> None:
    assert parse(use(), text) == (text, [])


def test_mistral_v11_markers_are_put_back_from_the_token_ids(tmp_path: Any) -> None:
    """v11 tokenizers have [TOOL_CALLS], [ARGS] and [CALL_ID] as special tokens: the client's text has
    none of them, and the call is read from the token ids."""
    from tokenizers import AddedToken

    from tandem.worker.model.tiny import build_tokenizer, write_tiny_model
    from tandem.worker.model.tokenizer import Tokenizer
    from tandem.worker.router.tokens import TextAssembler
    from tandem.worker.router.tool_calls import parse_output

    path = write_tiny_model(tmp_path / "m")
    hf = build_tokenizer()
    hf.add_tokens([AddedToken(m, special=True) for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")])
    hf.save(str(path / "tokenizer.json"))
    tok = Tokenizer(path)
    mark, args, call_id = (tok.backend.token_to_id(m) for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
    prompt = tok.encode("Weather?")
    plain = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = [*plain("On it."), mark, *plain("get_weather"), call_id, *plain("x9Y8z7W6v"), args, *plain('{"city": "Oslo"}'),
           mark, *plain("get_time"), args, *plain("{}")]
    asm = TextAssembler(tok, prompt, [])
    asm.push(ids, None, "stop")
    assert not any(m in asm.text for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))  # none reaches the client's text
    content, calls = parse_output(use(), asm.text, tok, prompt, asm.token_ids)
    assert content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
