"""Grammar-constrained decoding (structured outputs, tool calls) with xgrammar.

A request with a grammar (`SamplingParams.grammar`: a JSON schema, any JSON object, a regex or a list
of choices) gets a matcher that follows the tokens it produces; before each of its tokens is sampled,
the matcher says which tokens may come next, as a bitmask over the vocabulary, and every other token's
logit becomes -inf. One bitmask tensor serves the batch's grammar rows; a batch without grammars
never loads xgrammar (it is imported with the first grammar).

Tokens the request produced elsewhere (the prefill worker's first token, a decode worker it migrated
from) are fed to the matcher before it masks anything, so it resumes where the other worker's left off.

JSON comes out compact (no whitespace between tokens): with "any whitespace" a model is free to emit
spaces and newlines without end, and a weak or random-weight model does. Compact JSON never holds a raw
control character (U+0000-U+001F), yet xgrammar 0.2.9 lets one into strings with a maxLength or
minLength (mlc-ai/xgrammar#800), which strict JSON parsers refuse: for JSON grammars, tokens holding
one are masked too.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
JSON_KINDS = ("json_schema", "json_object")
MAX_GRAMMAR_CHARS = 65_536  # a schema, a regex or the choices (as JSON); longer ones are refused
# Compiled grammars kept (by their spec): a client repeating its schema compiles it once.
CACHE_LIMIT_BYTES = 256 * 1024 * 1024


def check_spec(kind: str, spec: str) -> None:
    """The cheap checks (the kind, the size, choices being a JSON list of strings) before compiling."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the {kind} is {len(spec)} characters long; at most {MAX_GRAMMAR_CHARS} are accepted")
    if kind == "choice":
        choices = json.loads(spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")


class Grammars:
    """Compiles grammars for one tokenizer (cached) and makes matchers. compile() may run on any
    thread (the worker compiles off the engine thread); matcher() runs on the engine's."""

    def __init__(self, encoded_vocab: list[str], backend_json: str, vocab_size: int, stop_token_ids: Sequence[int],
                 decode: Callable[[list[int]], str]) -> None:
        self._vocab, self._backend, self._vocab_size = encoded_vocab, backend_json, vocab_size
        self._stop = sorted(stop_token_ids)
        self._decode = decode
        self._compiler: Any = None
        self._control: torch.Tensor | None = None
        self._lock = threading.Lock()

    def control_tokens(self) -> torch.Tensor:
        """Ids of the tokens whose text holds a control character (computed once, by the first JSON grammar's
        compile(): off the engine thread on a worker, as decoding a 128k vocabulary takes a while)."""
        if self._control is None:
            ids = [i for i in range(len(self._vocab)) if any(ord(c) < 0x20 for c in self._decode([i]))]
            self._control = torch.tensor(ids, dtype=torch.long)
        return self._control

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                meta = xgr.TokenizerInfo._detect_metadata_from_hf(self._backend)
                info = xgr.TokenizerInfo(self._vocab, meta["vocab_type"], vocab_size=self._vocab_size,
                                         stop_token_ids=self._stop, add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, grammar: tuple[str, str]) -> Any:
        """The compiled grammar, or ValueError saying what is wrong with the spec."""
        import xgrammar as xgr

        kind, spec = grammar
        check_spec(kind, spec)
        compiler = self._get_compiler()
        if kind in JSON_KINDS:
            self.control_tokens()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
            return compiler.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {alternatives}"))
        except Exception as exc:  # xgrammar raises RuntimeError and its own errors for a bad spec
            raise ValueError(f"invalid {kind.replace('_', ' ')}: {_reason(exc)}") from None

    def matcher(self, grammar: tuple[str, str], produced: Sequence[int] = ()) -> Any:
        """A matcher for a new request, advanced past the tokens it `produced` elsewhere."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(grammar), terminate_without_stop_token=False)
        for token in produced:
            if not matcher.accept_token(token):
                raise ValueError(f"token {token} produced before does not follow this request's {grammar[0]} grammar")
        return matcher


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location and assertion text."""
    lines = str(exc).strip().splitlines()
    text = _CPP_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return text.replace("Check failed: (error.empty()) is false: ", "")[:500]


_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def mask_logits(logits: torch.Tensor, matchers: Sequence[Any], json_rows: Sequence[int] = (),
                control_tokens: torch.Tensor | None = None) -> None:
    """Sets to -inf, in place, each row's logits of tokens its matcher forbids (None: no grammar), and in
    `json_rows` those of `control_tokens`. One bitmask for the batch, filled by the matchers and applied
    in one call."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    if json_rows and control_tokens is not None and control_tokens.numel():
        index = torch.tensor(list(json_rows), dtype=torch.long, device=logits.device)
        control = control_tokens.to(logits.device)
        logits[index[:, None], control[None, :]] = float("-inf")
