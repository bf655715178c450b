"""Structured outputs and tool calls (issue 20) through the official `openai` client against real
`tandem serve` stacks with the random-weight tiny model: whatever the weights say, the output parses
and validates against the schema (the grammar decides what may come), in disaggregated mode (first
token from the prefill worker, the rest from the decode worker), monolithic and chunked (prompts
prefilled in 16-token chunks); a forced tool call's
arguments validate against the function's parameters; requests without a grammar batched beside
constrained ones get the tokens they get alone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema_rs
import openai
import pytest
from openai import OpenAI

from .conftest import Stack

pytestmark = pytest.mark.integration

MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person."}]
SCHEMAS: dict[str, dict[str, Any]] = {
    "required-fields": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                        "properties": {"name": {"type": "string", "maxLength": 12},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "enum-and-array": {"type": "object", "required": ["color", "sizes"],
                       "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}, "maxItems": 4}}},
    "nested": {"type": "object", "required": ["owner", "ok"],
               "properties": {"owner": {"type": "object", "required": ["id", "tags"],
                                        "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5},
                                                       "tags": {"type": "array", "maxItems": 2,
                                                                "items": {"enum": ["a", "b"]}}}},
                              "ok": {"type": "boolean"}}},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 15}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}

# A tool-calling template in the Qwen 2.5 / Hermes style, written for these tests: tools rendered with
# tojson into the system turn, earlier calls as <tool_call> blocks, tool results as <tool_response>,
# loop controls and raise_exception.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{- 'You may call functions. Signatures:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{- '</tools>\\nAnswer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}{% continue %}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{%- for call in message.tool_calls %}{{ '<tool_call>\\n' }}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}{{ '\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tool_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tool-model") / "tiny-tools"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def tools_stack(start_stack: Callable[..., Stack], tool_model: Path) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", model=tool_model)


@pytest.fixture(params=["disagg", "mono", "chunked"])
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def schema_format(name: str, strict: bool = True) -> Any:
    return {"type": "json_schema", "json_schema": {"name": name.replace("-", "_"), "schema": SCHEMAS[name],
                                                   "strict": strict}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_chat_output_validates_against_its_schema(stack: Stack, name: str) -> None:
    texts = set()
    for seed in range(3):
        resp = client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=150, seed=seed,
                                                     response_format=schema_format(name, strict=seed != 1))
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema_rs.validate(SCHEMAS[name], json.loads(choice.message.content or ""))
        texts.add(choice.message.content)
    assert len(texts) > 1  # sampled: the seeds still choose within the schema


def test_json_object_output_parses_as_an_object(stack: Stack) -> None:
    for seed in range(3):
        resp = client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, seed=seed,
                                                     response_format={"type": "json_object"})
        assert resp.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)


def test_streamed_structured_output_equals_the_whole_answer(stack: Stack) -> None:
    kw: Any = dict(model="tiny", messages=MESSAGES, max_tokens=150, seed=5, response_format=schema_format("nested"))
    whole = client(stack).chat.completions.create(**kw).choices[0].message.content
    chunks = list(client(stack).chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema_rs.validate(SCHEMAS["nested"], json.loads(streamed))


@pytest.mark.parametrize(("extra", "check"), [
    ({"response_format": schema_format("required-fields")},
     lambda text: jsonschema_rs.is_valid(SCHEMAS["required-fields"], json.loads(text))),
    ({"guided_json": SCHEMAS["enum-and-array"]},
     lambda text: jsonschema_rs.is_valid(SCHEMAS["enum-and-array"], json.loads(text))),
    ({"guided_choice": ["positive", "negative"]}, lambda text: text in ("positive", "negative")),
    ({"guided_regex": "[0-9]{4}-[0-9]{2}"}, lambda text: len(text) == 7 and text[4] == "-"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
], ids=["response-format", "vllm-guided-json", "guided-choice", "guided-regex", "structured-outputs"])
def test_completions_follow_the_grammar(stack: Stack, extra: dict[str, Any], check: Any) -> None:
    for seed in range(2):
        resp = client(stack).completions.create(model="tiny", prompt="Answer:", max_tokens=100, seed=seed,
                                                extra_body=extra)
        assert resp.choices[0].finish_reason == "stop"
        assert check(resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize(("response_format", "problem"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}},
     "parenthesis"),
    ({"type": "yaml"}, "response_format.type"),
], ids=["unknown-type", "bad-pattern", "unknown-format"])
def test_an_invalid_schema_is_a_400_naming_the_problem(stack: Stack, response_format: Any, problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                              response_format=response_format)
    body: Any = info.value.body
    assert problem in body["message"] or problem == body.get("param"), body
    # The worker that refused it serves the next request.
    assert client(stack).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices


def test_requests_beside_constrained_ones_get_their_own_tokens(disagg: Stack) -> None:
    """Seeded and greedy requests sampled alone, then again while constrained ones run beside them (the
    workers batch what arrives together): the same tokens."""
    free: list[dict[str, Any]] = [
        {"prompt": "The quick brown", "max_tokens": 40, "temperature": 0},
        {"prompt": "Prefill computes", "max_tokens": 40, "temperature": 0.9, "seed": 17},
        {"prompt": "Kubernetes runs", "max_tokens": 40, "temperature": 1.0, "seed": 3},
    ]
    constrained = {"prompt": "JSON:", "max_tokens": 100, "seed": 1,
                   "extra_body": {"response_format": schema_format("nested")}}
    c = client(disagg)

    def run(kw: dict[str, Any]) -> Any:
        return c.completions.create(model="tiny", extra_body={"ignore_eos": True, **kw.pop("extra_body", {})},
                                    **kw).choices[0]

    alone = [run(dict(kw)).text for kw in free]
    with ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(run, [dict(constrained), *map(dict, free), dict(constrained), dict(constrained)]))
    assert [m.text for m in mixed[1:4]] == alone
    for m in (mixed[0], *mixed[4:]):
        jsonschema_rs.validate(SCHEMAS["nested"], json.loads(m.text))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_gives_a_call_whose_arguments_validate(tools_stack: Stack, stream: bool) -> None:
    kw: Any = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, CLOCK],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=100)
    for seed in range(3):
        if stream:
            chunks = list(client(tools_stack).chat.completions.create(stream=True, seed=seed, **kw))
            deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
            assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id and deltas[0].function
            name, arguments = deltas[0].function.name, deltas[0].function.arguments
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client(tools_stack).chat.completions.create(seed=seed, **kw).choices[0]
            assert choice.message.content is None and choice.message.tool_calls
            [call] = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_")
            name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason  # type: ignore[union-attr]
        assert finish == "tool_calls" and name == "get_weather"
        jsonschema_rs.validate(PARAMS["get_weather"], json.loads(arguments or ""))


def test_a_streamed_tool_call_keeps_its_logprobs(tools_stack: Stack) -> None:
    """A tool-call answer is collected before it streams; the logprobs asked for stream too, equal to the whole."""
    kw: Any = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, CLOCK],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=100, seed=1,
                   logprobs=True, top_logprobs=2)
    whole = client(tools_stack).chat.completions.create(**kw).choices[0]
    assert whole.logprobs and whole.logprobs.content
    chunks = list(client(tools_stack).chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    # Tokens exactly; log-probabilities to float32 noise (two requests, two forward passes).
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in whole.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-4)


def test_required_tool_choice_calls_one_of_the_tools(tools_stack: Stack) -> None:
    names = set()
    for seed in range(6):
        choice = client(tools_stack).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "?"}], tools=[WEATHER, CLOCK], tool_choice="required",
            max_tokens=100, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0].function  # type: ignore[union-attr]
        jsonschema_rs.validate(PARAMS[call.name], json.loads(call.arguments))
        names.add(call.name)
    assert names <= set(PARAMS)


def test_tools_and_a_tool_conversation_reach_the_chat_template(tools_stack: Stack, tool_model: Path) -> None:
    """The prompt the workers get is transformers' apply_chat_template of the same messages and tools (its
    token count is what usage reports); auto and none leave free text (this model calls nothing)."""
    transformers = pytest.importorskip("transformers", reason="transformers renders the reference prompt")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "content": "12 degrees", "tool_call_id": "call_1"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(tool_model))
    hf_messages = [*messages[:2], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]}, messages[3]]
    expected = hf.apply_chat_template(hf_messages, tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=False)
    assert "<tool_response>" in expected and '"get_time"' in expected
    for choice in ("auto", "none"):
        resp = client(tools_stack).chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                                           tool_choice=choice, max_tokens=5, temperature=0)
        assert resp.usage is not None
        assert resp.usage.prompt_tokens == len(hf(expected, add_special_tokens=False)["input_ids"])
        assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="system message must come first"):
        client(tools_stack).chat.completions.create(model="tiny", messages=[*messages, messages[0]], tools=[WEATHER],
                                                    max_tokens=2)


def test_langchain_structured_output_and_bound_tools(tools_stack: Stack) -> None:
    """LangChain's ChatOpenAI against the router: with_structured_output (json_schema and function calling)
    gives a validated object; bind_tools with a forced tool gives a tool call with validated arguments."""
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    llm = langchain_openai.ChatOpenAI(base_url=f"{tools_stack.url}/v1", api_key="unused", model="tiny",
                                      max_tokens=100, seed=3, max_retries=0, timeout=120)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe someone.")
        assert isinstance(person, Person), method
    msg = llm.bind_tools([WEATHER, CLOCK], tool_choice="get_time").invoke("What time is it?")
    [call] = msg.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_time"
    jsonschema_rs.validate(PARAMS["get_time"], call["args"])
