"""Tokenizer (tokenizer.json via `tokenizers`), chat template and streaming detokenizer."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Byte-level tokens can split a multi-byte character; the text of the newest tokens is held
    back until it decodes without a replacement character. Decoding a short window of earlier
    tokens along with the new ones keeps word-initial spaces right for SentencePiece-style
    tokenizers (the same technique as vLLM's detokenizer).
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context_ids or [])[-6:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full_text[len(prefix_text):]
        return ""


class Tokenizer:
    def __init__(self, model_dir: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> None:
        path = Path(model_dir)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"model folder {str(path)!r} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        self.chat_template: str | None = _chat_template(path, config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos: set[int] = set(extra_eos_ids)
        generation = _read_json(path / "generation_config.json").get("eos_token_id")
        eos.update(generation if isinstance(generation, list) else [generation] if isinstance(generation, int) else [])
        if self.eos_token is not None and (eos_id := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_token_ids: set[int] = eos
        self.vocab_size = self._tok.get_vocab_size()

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` itself (the router reads its vocabulary and normalizers)."""
        return self._tok

    def encoded_vocab(self) -> list[str]:
        """Every token's string as the tokenizer stores it (byte-level symbols, ▁...), indexed by id."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        out = [""] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            out[token_id] = token
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def new_detokenizer(self, context_ids: list[int] | None = None) -> IncrementalDetokenizer:
        """`context_ids` (e.g. the prompt) only shape word-initial spacing; they are never emitted."""
        return IncrementalDetokenizer(self, context_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json has no chat_template)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        from jinja2.exceptions import TemplateError

        try:
            template = _compile(self.chat_template)
            # tools and documents are None when absent, as transformers renders them: templates test
            # `tools is not none` (an Undefined would pass that test and open an empty tools block).
            context: dict[str, Any] = {"tools": None, "documents": None, **kwargs}
            return str(template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **context))
        except TemplateError as exc:  # the template's raise_exception (it refuses these messages) or its syntax
            raise ValueError(f"the chat template refused the messages: {exc}") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


_COMPILED: dict[str, Any] = {}


def _compile(source: str) -> Any:
    if source not in _COMPILED:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        # As transformers sets its environment up: published templates use {% break %} and tojson's options.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]
