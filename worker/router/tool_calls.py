"""Tool calls out of a model's output, into OpenAI's `tool_calls`.

With tool_choice `required` or a named function the output was constrained by a grammar (structured.py),
so it is the call's JSON itself. With `auto` the model chose; its call is found in the formats the
supported families' chat templates teach it:
- Qwen 2.5+/Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- Llama 3.x: the output is `{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`),
  or several separated by `;`;
- Mistral, tokenizers before v11: `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}`;
  v11 and later (Mistral Small 3.1+, Devstral, Magistral): one `[TOOL_CALLS]name[ARGS]{...}` per call,
  optionally `[CALL_ID]id` before `[ARGS]`; text before the first `[TOOL_CALLS]` is the content.
Only calls naming one of the request's tools count; anything else stays text.

The router's text skips special tokens, and some tokenizers have these markers as special tokens
(Mistral's `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]`, Llama's `<|python_tag|>`): `parse_output` puts them
back from the token ids.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.worker.router.structured import ToolUse

if TYPE_CHECKING:
    from tandem.worker.model.tokenizer import Tokenizer

HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MISTRAL_MARK = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
MISTRAL_V11_CALL = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?\[ARGS\](.*)", re.DOTALL)
LLAMA_PYTHON_TAG = "<|python_tag|>"
MARKERS = (MISTRAL_MARK, MISTRAL_ARGS, MISTRAL_CALL_ID, LLAMA_PYTHON_TAG, "<tool_call>", "</tool_call>")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # a streamed delta's
            out = {"index": index, **out}
        return out


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse(use: ToolUse, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content left, calls) of an output. No calls: the text is the content."""
    names = {t["function"]["name"] for t in use.tools}
    if use.choice == "function":
        args = _loads(text)
        return (None, [ToolCall(str(use.name), json.dumps(args, ensure_ascii=False))]) if isinstance(args, dict) \
            else (text, [])
    if use.choice == "required":
        call = _call(_loads(text), names)
        return (None, [call]) if call is not None else (text, [])
    if use.choice != "auto":
        return text, []
    return _parse_auto(text, names)


def parse_output(use: ToolUse, text: str, tok: Tokenizer, prompt_ids: list[int],
                 token_ids: list[int]) -> tuple[str | None, list[ToolCall]]:
    """`parse` of a generated output: `text` as the client gets it (special tokens skipped, cut at a stop
    string), `token_ids` the tokens it came from. With `auto`, the format markers the tokenizer has as
    special tokens are put back where the model wrote them first: Mistral's tokenizers have
    `[TOOL_CALLS]` as one, and without it a Mistral call reads as a bare JSON list. Without calls the
    content is `text` as it was."""
    if use.choice != "auto":
        return parse(use, text)
    content, calls = parse(use, with_markers(tok, prompt_ids, token_ids, text))
    return (content, calls) if calls else (text, [])


def with_markers(tok: Tokenizer, prompt_ids: list[int], token_ids: list[int], text: str) -> str:
    """`text` with each marker of MARKERS that decoding skips (a special token of this tokenizer) put in
    again at the place its token had. The places come from decoding the tokens again the way the router's
    TextAssembler did (the same detokenizer after the same prompt), so they are the text's own offsets; a
    marker past the end of `text` (cut off by a stop string) stays out."""
    skipped: dict[int, str] = {}
    for mark in MARKERS:
        token_id = tok.backend.token_to_id(mark)
        if token_id is not None and tok.decode([token_id]) != mark:
            skipped[token_id] = mark
    if not any(t in skipped for t in token_ids):
        return text
    detok = tok.new_detokenizer(prompt_ids)
    at, out, done = 0, [], 0
    for token_id in token_ids:
        if token_id in skipped:
            if at > len(text):
                break
            out += [text[done:at], skipped[token_id]]
            done = at
        at += len(detok.push(token_id))
    return "".join([*out, text[done:]])


def _parse_auto(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    blocks = HERMES_BLOCK.findall(text)
    if blocks:
        calls = [c for b in blocks if (c := _call(_loads(b), names)) is not None]
        if len(calls) == len(blocks):
            rest = HERMES_BLOCK.sub("", text).strip()
            return rest or None, calls
        return text, []
    stripped = text.strip()
    if MISTRAL_MARK in stripped:
        before, _, after = stripped.partition(MISTRAL_MARK)
        mistral = _mistral_calls(after, names)
        return (before.strip() or None, mistral) if mistral else (text, [])
    body = stripped.removeprefix(LLAMA_PYTHON_TAG).strip()
    if body.startswith("{"):
        parts = [body] if (one := _loads(body)) is not None else body.split(";")
        objs = [one] if one is not None else [_loads(p.strip()) for p in parts]
        calls = [c for o in objs if (c := _call(o, names)) is not None]
        if calls and len(calls) == len(objs):
            return None, calls
    return text, []


def _mistral_calls(body: str, names: set[str]) -> list[ToolCall]:
    """The calls after a first `[TOOL_CALLS]` (none unless every one parses and names a tool)."""
    if MISTRAL_ARGS not in body:  # before v11: one JSON list (or object) of calls
        items = _loads(body.strip())
        items = [items] if isinstance(items, dict) else items
        if not isinstance(items, list) or not items:
            return []
        calls = [c for i in items if (c := _call(i, names)) is not None]
        return calls if len(calls) == len(items) else []
    calls = []
    for part in body.split(MISTRAL_MARK):  # v11: name[ARGS]{...} per call
        match = MISTRAL_V11_CALL.fullmatch(part)
        args = _loads(match.group(2).strip()) if match else None
        call = _call({"name": match.group(1), "arguments": args}, names) if match and isinstance(args, dict) else None
        if call is None:
            return []
        calls.append(call)
    return calls


def chat_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    return message


def template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them (transformers' convention): the
    arguments as an object, not OpenAI's JSON string."""
    from tandem.worker.router.errors import bad_request

    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", param=where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{i}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                              param=f"{where}.{i}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            parsed = _loads(args)
            args = parsed if isinstance(parsed, dict) else args
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
