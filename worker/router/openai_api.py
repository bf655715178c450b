"""OpenAI request bodies (with vLLM's extensions that benchmark clients send) and their validation.

Parsing is strict where a wrong value would silently change the answer (types, ranges, n>1,
best_of). Nothing is dropped silently: a field this server does not implement (`tools`,
`response_format`, `logit_bias`, ...) is refused with a 400 naming it, unless its value says nothing
(null, empty, `{"type": "text"}`); the few OpenAI fields that mean nothing here (`user`, `metadata`,
`store`, ...) are accepted and ignored, as docs/serving.md lists them. Types are JSON's:
a flag must be true/false (null means the default), a number must not be a string or a boolean,
as OpenAI's own API answers; pydantic's lax mode would turn "yes" into true and true into 1.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from tandem.worker.router.errors import APIError, bad_request
from tandem.worker.router.structured import (
    ToolUse,
    response_format_grammar,
    tool_grammar,
    tool_use,
    vllm_grammar,
)
from tandem.worker.router.tool_calls import template_tool_calls
from tandem.worker.server.protocol import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    SEED_MAX,
    SEED_MIN,
    Grammar,
    Sampling,
)


def _json_number(value: Any) -> Any:
    """Numbers must be JSON numbers: lax pydantic would take "5" or true (1) for an int or a float."""
    if isinstance(value, bool | str):
        raise PydanticCustomError("number_type", "Input should be a number, not a {kind}",
                                  {"kind": "boolean" if isinstance(value, bool) else "string"})
    return value


def _null_is_false(value: Any) -> Any:
    return False if value is None else value


Int = Annotated[int, BeforeValidator(_json_number)]  # 5 and 5.0 pass; "5", true and 5.5 do not
Float = Annotated[float, BeforeValidator(_json_number)]
# true/false only (null: the default, false), never "yes" or 1.
Flag = Annotated[bool, Strict(), BeforeValidator(_null_is_false)]
TokenId = Annotated[int, BeforeValidator(_json_number), Field(ge=0, le=INT32_MAX)]
# A UTF-16 surrogate written as a JSON escape (\ud800-\udfff): json.loads turns a lone one into a str no
# tokenizer can encode. Pairs are fine (an emoji); this only says whether the slower exact check must run.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Roles whose message must carry content (OpenAI: required for system/developer/user/tool; an
# assistant message may leave it out or null when it carries tool_calls, and vLLM accepts that).
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


# n: each choice is a generation of its own on the workers, so n multiplies a request's cost.
MAX_CHOICES = 16
# A batch of prompts (completions): each is a choice (n of them) of its own on the workers too; this bounds
# prompts x n, what one request can put on the workers at once.
MAX_BATCH_CHOICES = 64
MAX_ECHO_LOGPROBS = 5  # completions' logprobs: OpenAI's limit, for the prompt's tokens (echo) as for the rest
# OpenAI request fields that change nothing in the answer this server gives: accepted and ignored.
# (`parallel_tool_calls`: a forced call is one call; with `auto` the model writes as many as it likes.)
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# Message fields that are output or bookkeeping when a client sends a previous answer back.
IGNORED_MESSAGE_FIELDS = ("refusal", "annotations")
# Why some unimplemented fields are refused, for a message more useful than "not supported".
NOT_IMPLEMENTED = {
    "functions": "the deprecated function calls are not implemented (use tools)",
    "function_call": "the deprecated function calls are not implemented (use tool_choice)",
}


def _says_nothing(name: str, value: Any) -> bool:
    """A value that asks for nothing: what a client sends when it leaves a feature off."""
    if name == "response_format" and value == {"type": "text"}:
        return True
    return value is None or value == [] or value == {}


def _drop_empty_unknowns(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if k in model.model_fields or not _says_nothing(k, v)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    include_usage: Flag = False


class _Common(BaseModel):
    # Ranges are the worker's (protocol.Sampling), checked here first so that the client sees a 400 naming
    # the parameter. No NaN or Infinity: json.loads takes both, and they fail no range check downstream.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)  # a tiny one is greedy (the engine's floor)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=-1, le=INT32_MAX)  # vLLM: -1 and 0 both mean off
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, json_schema_extra={"anyOf": [  # see stop_list
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        {"type": "null"}]})
    stop_token_ids: list[TokenId] | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    ignore_eos: Flag = False
    # The published schema (the router's /openapi.json) says what _check_unsupported accepts: best_of 1 or
    # null. Validation stays as it is, so that the 400 names the unsupported feature.
    n: Int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: Int | None = Field(None, json_schema_extra={"anyOf": [{"const": 1}, {"type": "null"}]})
    return_token_ids: Flag = False  # vLLM extension: token ids in each choice
    presence_penalty: Float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: Float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    min_tokens: Int = Field(0, ge=0, le=INT32_MAX)  # vLLM's: no EOS or stop_token_ids before this many
    repetition_penalty: Float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])  # vLLM's
    # Token ids as JSON object keys (strings), as OpenAI takes them; logit_bias_of checks them.
    logit_bias: Annotated[dict[str, Annotated[float, BeforeValidator(_json_number),
                                              Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    # Accepted and ignored (IGNORED_FIELDS): any JSON value, as OpenAI's own types for them vary.
    user: str | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    # Structured outputs (structured.py checks them): OpenAI's, and vLLM's extensions.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _unknown_but_empty(cls, data: Any) -> Any:
        return _drop_empty_unknowns(cls, data)


class CompletionRequest(_Common):
    # Not empty; a list of prompts is a batch (one choice per prompt and n, in order: _check_unsupported).
    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_BATCH_CHOICES},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
         "minItems": 1, "maxItems": MAX_BATCH_CHOICES}]})
    # 0 only with echo: the prompt's logprobs, nothing generated (OpenAI's legacy scoring call).
    max_tokens: Int | None = Field(None, ge=0)
    logprobs: Int | None = Field(None, ge=0, le=MAX_ECHO_LOGPROBS)
    # The answer's text starts with the prompt; with logprobs, its tokens' logprobs come first (prompt_logprobs).
    echo: Flag = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # passed to the chat template, as transformers passes it
    tool_call_id: str | None = None  # likewise
    tool_calls: list[Any] | None = None  # an assistant's earlier calls, passed to the template (arguments as objects)
    refusal: Any = None  # IGNORED_MESSAGE_FIELDS
    annotations: Any = None

    @model_validator(mode="before")
    @classmethod
    def _unknown_but_empty(cls, data: Any) -> Any:
        return _drop_empty_unknowns(cls, data)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Flag = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None  # structured.tool_use checks them with tool_choice
    tool_choice: Any = None


def parse_body(raw: bytes, model: type[CompletionRequest] | type[ChatRequest]) -> Any:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = next((e for e in errors if e["type"] != "extra_forbidden"), errors[0])
        if first["type"] == "extra_forbidden":
            raise _unsupported_field(first["loc"]) from None
        where, inside_union = _param(model, first["loc"])
        if inside_union:  # e.g. prompt: 5 -> every member of the union failed; name the field, not a member
            raise bad_request(f"invalid type for '{where}': {_union_help(model, where)}", param=where) from None
        raise bad_request(f"invalid value for '{where}': {first['msg']}", param=where) from None
    _check_unsupported(req)
    return req


def _unsupported_field(loc: tuple[int | str, ...]) -> APIError:
    where = ".".join(str(p) for p in loc)
    name = str(loc[-1])
    why = NOT_IMPLEMENTED.get(name, "this server does not implement it")
    return bad_request(f"unsupported parameter '{where}': {why} (refused rather than ignored, so that the answer "
                       "is never silently different from what was asked)", param=where)


def load_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 for anything a strict JSON parser refuses and for what Python's takes
    but nothing downstream can use: NaN and Infinity, nesting deeper than the interpreter's recursion
    limit (a RecursionError, which was a 500), and lone surrogates (a 500 in the tokenizer)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise bad_request("request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff): not a character")
    return data


def _no_constant(name: str) -> Any:
    raise bad_request(f"request body is not valid JSON: {name} is not a JSON number")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether any string in the parsed body holds a surrogate json.loads left unpaired. Iterative: the
    body's nesting is whatever json.loads accepted, close to the interpreter's recursion limit."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _param(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str | None, bool]:
    """The request parameter an error is about ("messages.0.role", "prompt"), and whether the error's
    location went on into a member of a union (pydantic names those "str", "list[int]", ...)."""
    parts: list[str] = []
    current: type[BaseModel] | None = model
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
            continue
        if current is None or item not in current.model_fields:
            return ".".join(parts) or None, True
        parts.append(item)
        current = _model_in(current.model_fields[item].annotation)
    return ".".join(parts) or None, False


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The request model inside an annotation such as `list[ChatMessage]` or `StreamOptions | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None


def _union_help(model: type[BaseModel], where: str | None) -> str:
    if where == "prompt":
        return "expected a string, a list of token ids, or a one-element list of either"
    if where == "stop":
        return "expected a string or a list of strings"
    if where is not None and where.endswith(".content"):
        return "expected a string or a list of content parts"
    return "wrong type"


def _check_unsupported(req: CompletionRequest | ChatRequest) -> None:
    if req.best_of not in (None, 1):
        raise bad_request("best_of is not supported (only best_of=1)", param="best_of")
    if isinstance(req, CompletionRequest):
        prompts = prompts_of(req)
        if len(prompts) * req.n > MAX_BATCH_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n={req.n} is more than {MAX_BATCH_CHOICES} choices in one "
                              "request", param="prompt")
        if any(p in ("", []) for p in prompts):
            raise bad_request("prompt must not be empty", param="prompt")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt's logprobs alone)",
                              param="max_tokens")


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one, or a batch (a list of strings or of token id lists)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]  # type: ignore[list-item]


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings are supported", param="stop")
    return stops


def top_logprobs_of(req: CompletionRequest | ChatRequest) -> int:
    """How many most likely tokens each answer token lists: chat's top_logprobs, completions' logprobs."""
    if isinstance(req, CompletionRequest):
        return req.logprobs or 0
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    return req.top_logprobs or 0


def logit_bias_of(req: CompletionRequest | ChatRequest, vocab_size: int | None) -> dict[int, float]:
    """logit_bias with its keys as token ids: decimal integers inside the vocabulary."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        if not key.isascii() or not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
            limit = f" in 0..{vocab_size - 1}" if vocab_size is not None else ""
            raise bad_request(f"logit_bias keys must be token ids{limit}, got {key!r}", param="logit_bias")
        out[int(key)] = bias
    return out


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice `index` of n: a seeded request's choices use seed + index (seed - index past the top of the
    range), so they differ from each other and repeat from run to run."""
    if sampling.seed is None or index == 0:
        return sampling
    seed = sampling.seed + index if sampling.seed + index <= SEED_MAX else sampling.seed - index
    return sampling.model_copy(update={"seed": seed})


def min_tokens_of(req: CompletionRequest | ChatRequest, max_tokens: int) -> int:
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    return req.min_tokens


def tools_of(req: CompletionRequest | ChatRequest) -> ToolUse | None:
    return tool_use(req.tools, req.tool_choice) if isinstance(req, ChatRequest) else None


def grammar_of(req: CompletionRequest | ChatRequest, use: ToolUse | None) -> Grammar | None:
    """The one grammar the output follows: a forced tool call's, response_format's or vLLM's guided_*."""
    asked: list[tuple[str, Grammar]] = []
    if use is not None and (g := tool_grammar(use)) is not None:
        asked.append(("tool_choice", g))
    if (g := response_format_grammar(req.response_format)) is not None:
        asked.append(("response_format", g))
    if (found := vllm_grammar({"guided_json": req.guided_json, "guided_regex": req.guided_regex,
                               "guided_choice": req.guided_choice,
                               "structured_outputs": req.structured_outputs})) is not None:
        asked.append(found)
    if len(asked) > 1:
        raise bad_request(f"'{asked[1][0]}' cannot be combined with '{asked[0][0]}': the output follows one of "
                          "them", param=asked[1][0])
    return asked[0][1] if asked else None


def prompt_logprobs_of(req: CompletionRequest | ChatRequest) -> int | None:
    """How many alternatives each prompt token lists (echo with logprobs), or None: no prompt logprobs."""
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return req.logprobs
    return None


def sampling_from(req: CompletionRequest | ChatRequest, max_tokens: int, want_logprobs: bool,
                  top_logprobs: int = 0, vocab_size: int | None = None, grammar: Grammar | None = None) -> Sampling:
    """`max_tokens` 0 (echo alone) asks the workers for one token, which the answer leaves out."""
    max_tokens = max(1, max_tokens)
    return Sampling(
        max_tokens=max_tokens, temperature=req.temperature, top_k=max(0, req.top_k), top_p=req.top_p,
        min_p=req.min_p, seed=req.seed, stop=stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, logprobs=want_logprobs, top_logprobs=top_logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=logit_bias_of(req, vocab_size),
        min_tokens=min_tokens_of(req, max_tokens), grammar=grammar, prompt_logprobs=prompt_logprobs_of(req))


class HasMessages(typing.Protocol):
    messages: list[ChatMessage]


def chat_messages(req: HasMessages) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; content parts must be text."""
    out = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if content is None and msg.role in CONTENT_REQUIRED:
            raise bad_request(f"messages[{i}]: a {msg.role} message needs content (a string or a list of "
                              "content parts)", param=f"messages.{i}.content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        entry: dict[str, Any] = {"role": msg.role, "content": content or ""}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls:
            entry["tool_calls"] = template_tool_calls(msg.tool_calls, f"messages.{i}.tool_calls")
        out.append(entry)
    return out


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None) -> int:
    if prompt_len >= max_model_len:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                       f"{max_model_len} tokens", param="prompt", code="context_length_exceeded")
    room = max_model_len - prompt_len
    if requested is None:
        return min(room, default) if default is not None else room
    if requested > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the request has "
                       f"{prompt_len} prompt tokens and asks for {requested} more", param="max_tokens",
                       code="context_length_exceeded")
    return requested
