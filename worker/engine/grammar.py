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

Only xgrammar's public API is used. The vocabulary's type and prefix space, which xgrammar's own
`TokenizerInfo.from_huggingface` detects with a private helper, are read from tokenizer.json here
(`vocab_metadata`, the same rules; tests/engine/test_grammar.py compares the two when the helper
exists). Tested with xgrammar 0.2.9 (TESTED_XGRAMMAR, pyproject's lower bound); an xgrammar that
cannot be imported or lacks what this uses fails the request's grammar with a message naming it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
JSON_KINDS = ("json_schema", "json_object")
MAX_GRAMMAR_CHARS = 65_536  # a schema, a regex or the choices (as JSON); longer ones are refused
# Compiled grammars kept (by their spec): a client repeating its schema compiles it once.
CACHE_LIMIT_BYTES = 256 * 1024 * 1024
TESTED_XGRAMMAR = "0.2.9"  # the version the tests ran with; pyproject.toml pins it as the lower bound


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


class GrammarsUnavailable(ValueError):
    """xgrammar is missing or lacks what this module uses: no grammar can be compiled on this worker. A
    ValueError, so the worker refuses the request (400, with this message) and cleans up as for a bad spec."""


def vocab_metadata(backend_json: str) -> tuple[str, bool]:
    """(xgrammar VocabType name, add_prefix_space) of a tokenizer.json, by the rules xgrammar 0.2.9's
    TokenizerInfo.from_huggingface applies (through its private _detect_metadata_from_hf):
    - the first ByteLevel or ByteFallback decoder (the decoder itself, or in a Sequence decoder) makes the
      vocabulary BYTE_LEVEL or BYTE_FALLBACK; neither: RAW;
    - a Prepend "▁" normalizer (itself or in a Sequence), or a Metaspace pre-tokenizer whose
      prepend_scheme is "always" or "first", means the tokenizer adds a prefix space."""
    cfg = json.loads(backend_json)

    def parts(node: Any, kind: str) -> list[Any]:
        if not isinstance(node, dict):
            return []
        if node.get("type") == "Sequence":
            return [p for p in node.get(kind) or [] if isinstance(p, dict)]
        return [node]

    vocab_type = "RAW"
    for dec in parts(cfg.get("decoder"), "decoders"):
        if dec.get("type") in ("ByteLevel", "ByteFallback"):
            vocab_type = "BYTE_LEVEL" if dec["type"] == "ByteLevel" else "BYTE_FALLBACK"
            break
    prepend = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581"
                  for n in parts(cfg.get("normalizer"), "normalizers"))
    pre = cfg.get("pre_tokenizer")
    metaspace = isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("prepend_scheme") in ("always",
                                                                                                        "first")
    return vocab_type, bool(prepend or metaspace)


def _xgrammar() -> Any:
    """xgrammar, or GrammarsUnavailable naming what is wrong with it."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise GrammarsUnavailable(f"structured outputs are not available on this worker: xgrammar cannot be "
                                  f"imported ({exc}); install xgrammar>={TESTED_XGRAMMAR}") from None
    missing = [name for name in ("TokenizerInfo", "VocabType", "GrammarCompiler", "GrammarMatcher", "Grammar",
                                 "allocate_token_bitmask", "apply_token_bitmask_inplace") if not hasattr(xgr, name)]
    if missing:
        raise GrammarsUnavailable(f"structured outputs are not available on this worker: xgrammar "
                                  f"{_version()} has no {', '.join(missing)}; Tandem is tested with "
                                  f"{TESTED_XGRAMMAR} (install xgrammar>={TESTED_XGRAMMAR})")
    return xgr


def _version() -> str:
    try:
        return metadata.version("xgrammar")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


class Grammars:
    """Compiles grammars for one tokenizer (cached) and makes matchers. compile() may run on any
    thread (the worker compiles off the engine thread); matcher() runs on the engine's.

    Nothing is computed at construction: the vocabulary table xgrammar needs (every token's string, the
    tokenizer's JSON) is built with the first grammar, so an engine whose requests bring none never pays
    for it (for a 128k-token vocabulary about 0.2 s of every start, and the memory)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop = sorted(stop_token_ids)
        self._compiler: Any = None
        self._control: torch.Tensor | None = None
        self._lock = threading.Lock()

    def control_tokens(self) -> torch.Tensor:
        """Ids of the tokens whose text holds a control character (computed once, by the first JSON grammar's
        compile(): off the engine thread on a worker, as decoding a 128k vocabulary takes a while)."""
        if self._control is None:
            size = max(self._tokenizer.backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
            decode = self._tokenizer.decode
            ids = [i for i in range(size) if any(ord(c) < 0x20 for c in decode([i], skip_special_tokens=False))]
            self._control = torch.tensor(ids, dtype=torch.long)
        return self._control

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                vocab_type, add_prefix_space = vocab_metadata(self._tokenizer.backend.to_str())
                try:
                    info = xgr.TokenizerInfo(self._tokenizer.encoded_vocab(), xgr.VocabType[vocab_type],
                                             vocab_size=self._vocab_size, stop_token_ids=self._stop,
                                             add_prefix_space=add_prefix_space)
                    self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)
                except (TypeError, KeyError, AttributeError) as exc:  # an xgrammar whose API differs
                    log.error("xgrammar %s cannot be used (tested with %s): %s", _version(), TESTED_XGRAMMAR, exc)
                    raise GrammarsUnavailable(f"structured outputs are not available on this worker: xgrammar "
                                              f"{_version()} does not take what Tandem passes it ({exc}); Tandem "
                                              f"is tested with {TESTED_XGRAMMAR}") from None
            return self._compiler

    def compile(self, grammar: tuple[str, str]) -> Any:
        """The compiled grammar, or ValueError saying what is wrong with the spec (GrammarsUnavailable: with
        xgrammar)."""
        kind, spec = grammar
        check_spec(kind, spec)
        compiler = self._get_compiler()
        xgr = _xgrammar()
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
        compiled = self.compile(grammar)
        matcher = _xgrammar().GrammarMatcher(compiled, terminate_without_stop_token=False)
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
