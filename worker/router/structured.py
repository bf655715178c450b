"""What a request asks its output to look like: `response_format` (OpenAI), vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `structured_outputs`, and `tool_choice` with `tools`, turned into
the one grammar the workers constrain decoding with (protocol.Grammar; worker/engine/grammar.py).

The router checks the shape of these fields (a 400 naming the field); whether a schema or regex
compiles is the worker's to say (xgrammar lives there), and its 400 reaches the client as is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.worker.router.errors import bad_request
from tandem.worker.server.protocol import MAX_GRAMMAR_CHARS, Grammar

MAX_TOOLS = 128


@dataclass
class ToolUse:
    """The request's tools and how it wants them used."""

    tools: list[dict[str, Any]]  # as the chat template gets them: {"type": "function", "function": {...}}
    choice: str  # "none", "auto", "required" or "function" (a named one)
    name: str | None = None  # the named function

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.choice != "none"


def _spec(value: Any, param: str) -> str:
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' is {len(text)} characters as JSON; at most {MAX_GRAMMAR_CHARS} are accepted",
                          param=param)
    return text


def _schema(value: Any, param: str) -> Grammar:
    if isinstance(value, str):  # vLLM takes guided_json as a JSON string too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"'{param}' is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"'{param}' must be a JSON schema (an object)", param=param)
    return Grammar(kind="json_schema", spec=_spec(value, param))


def _regex(value: Any, param: str) -> Grammar:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty regular expression", param=param)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' is {len(value)} characters long; at most {MAX_GRAMMAR_CHARS} are accepted",
                          param=param)
    return Grammar(kind="regex", spec=value)


def _choice(value: Any, param: str) -> Grammar:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"'{param}' must be a non-empty list of non-empty strings", param=param)
    return Grammar(kind="choice", spec=_spec(value, param))


def response_format_grammar(value: Any) -> Grammar | None:
    """OpenAI's response_format: text (nothing), json_object, or json_schema {name, schema, strict}."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(kind="json_object", spec="")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("'response_format.json_schema' must be an object with the 'schema'",
                              param="response_format.json_schema")
        if "schema" not in spec:  # OpenAI's schema is optional; without it, any JSON object
            return Grammar(kind="json_object", spec="")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise bad_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                      param="response_format.type")


def vllm_grammar(extras: dict[str, Any]) -> tuple[str, Grammar] | None:
    """vLLM's guided_json / guided_regex / guided_choice, or structured_outputs {json, regex, choice}."""
    found: list[tuple[str, Grammar]] = []
    for name, make in (("guided_json", _schema), ("guided_regex", _regex), ("guided_choice", _choice)):
        if extras.get(name) is not None:
            found.append((name, make(extras[name], name)))
    so = extras.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object", param="structured_outputs")
        unknown = set(so) - {"json", "regex", "choice"}
        if unknown:
            key = sorted(unknown)[0]
            raise bad_request(f"unsupported parameter 'structured_outputs.{key}': this server implements json, "
                              "regex and choice", param=f"structured_outputs.{key}")
        for key, make in (("json", _schema), ("regex", _regex), ("choice", _choice)):
            if so.get(key) is not None:
                found.append((f"structured_outputs.{key}", make(so[key], f"structured_outputs.{key}")))
    if len(found) > 1:
        raise bad_request(f"only one of {', '.join(n for n, _ in found)} may be given", param=found[1][0])
    return found[0] if found else None


def tool_use(tools: Any, tool_choice: Any) -> ToolUse | None:
    """The request's tools (OpenAI's shape) and tool_choice, checked; None without tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", param=f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                              param=f"tools.{i}.function.parameters")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                              "{'name': ...}}", param="tool_choice")
        if name not in names:
            raise bad_request(f"'tool_choice' names {name!r}, which is not one of the tools", param="tool_choice")
        return ToolUse(tools, "function", name)
    if choice not in ("none", "auto", "required"):
        raise bad_request("'tool_choice' must be none, auto, required or a named function", param="tool_choice")
    return ToolUse(tools, choice)


def _parameters(tool: dict[str, Any]) -> Any:
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


def tool_grammar(use: ToolUse) -> Grammar | None:
    """required: one call as {"name": ..., "arguments": {...}} of one of the tools (its parameters' schema);
    a named function: its arguments alone. auto and none leave the output free."""
    if use.choice == "function":
        tool = next(t for t in use.tools if t["function"]["name"] == use.name)
        return Grammar(kind="json_schema", spec=_spec(_parameters(tool), "tools"))
    if use.choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in use.tools]
        return Grammar(kind="json_schema", spec=_spec(calls[0] if len(calls) == 1 else {"anyOf": calls}, "tools"))
    return None
