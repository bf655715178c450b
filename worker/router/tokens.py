"""The router's tokenizer and the per-request text assembly (detokenizing, stop strings, logprobs).

The router tokenizes prompts (it needs their length and prefix for placement) and detokenizes
the tokens the workers stream back, so a request whose tokens came from a prefill worker, a
decode worker and, after a migration, another decode worker still reads as one clean text.
The tokenizer files come from a worker (GET /tokenizer) unless the router was given the model folder.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.worker.model.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def tokenizer_files(model_dir: Path) -> dict[str, str]:
    return {name: (model_dir / name).read_text() for name in TOKENIZER_FILES if (model_dir / name).is_file()}


async def fetch_tokenizer(client: httpx.AsyncClient, worker_url: str) -> tuple[Tokenizer, set[int]]:
    """Load the tokenizer a worker serves; returns it with the worker's end-of-sequence ids."""
    resp = await client.get(f"{worker_url}/tokenizer", timeout=10.0)
    resp.raise_for_status()
    data = resp.json()
    folder = Path(tempfile.mkdtemp(prefix="tandem-router-tokenizer-"))
    for name, text in data["files"].items():
        if name in TOKENIZER_FILES:  # never write a path a worker made up
            (folder / name).write_text(text)
    tok = Tokenizer(folder)
    return tok, set(data.get("eos_token_ids") or tok.eos_token_ids)


# Most code points one code point can decompose into: canonically (NFD, U+1F82 -> 4) and with
# compatibility mappings (NFKD, U+FDFA -> 18). Composition (NFC/NFKC) can therefore shrink a text
# by at most these factors; tests/unit/test_router_tokens.py checks them against unicodedata.
MAX_CANONICAL_DECOMPOSITION = 4
MAX_COMPATIBILITY_DECOMPOSITION = 18


def encode(tok: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tok.encode`, through `encode_batch`: the `tokenizers` binding releases the GIL there (and not
    in `encode`), so a long prompt encoded in a worker thread leaves the event loop free."""
    return list(tok.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def chars_per_token_bound(tok: Tokenizer) -> float | None:
    """A number B such that a text of C characters always encodes to at least C / B tokens, or None
    when this tokenizer admits no such bound (then only the exact count decides).

    A BPE token stands for at most as many characters as its vocabulary string has (a byte-level
    token's string has one character per byte, a byte-fallback token `<0xNN>` is one byte, an
    unknown character gets one `unk` token), so B = the longest vocabulary or added-token string,
    times how much normalization can shrink a text. That holds only when no step can make
    characters vanish or cover an unbounded run, which this checks and otherwise answers None:
    truncation; normalizers that strip or drop characters (Strip, StripAccents, BertNormalizer,
    Precompiled, Nmt, regex Replace); pre-tokenizers that drop whitespace or delimiters; added
    tokens that swallow whitespace (lstrip/rstrip); BPE that drops or fuses unknown characters;
    WordPiece/Unigram/WordLevel models (one `unk` can stand for a whole word).
    """
    hf = tok.backend
    try:
        cfg = json.loads(hf.to_str())
        return _bound(cfg, hf.get_vocab(with_added_tokens=True))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _bound(cfg: dict[str, Any], vocab: dict[str, int]) -> float | None:
    if cfg.get("truncation") is not None:
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in cfg.get("added_tokens") or []):
        return None
    shrink = _normalizer_shrink(cfg.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_all(cfg.get("pre_tokenizer")):
        return None
    model = cfg.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if _has_type(cfg.get("pre_tokenizer"), "ByteLevel"):
        from tokenizers.pre_tokenizers import ByteLevel

        covered = all(ch in vocab for ch in ByteLevel.alphabet())  # every byte has a token
    else:
        covered = bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if not covered and (model.get("unk_token") is None or model.get("fuse_unk")):
        return None
    longest = max((len(t) for t in vocab), default=0)
    return float(longest) * shrink if longest > 0 else None


def _normalizer_shrink(n: dict[str, Any] | None) -> float | None:
    """By how much this normalizer can shorten a text at most (1.0: never), or None: unbounded."""
    if n is None:
        return 1.0
    kind = n.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in n.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            total *= f
        return total
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):  # never shorten a text
        return 1.0
    if kind == "NFC":
        return float(MAX_CANONICAL_DECOMPOSITION)
    if kind == "NFKC":
        return float(MAX_COMPATIBILITY_DECOMPOSITION)
    if kind == "Replace":
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if isinstance(pattern, str) and pattern and isinstance(content, str) and content:
            return max(1.0, len(pattern) / len(content))
    return None


def _pre_tokenizer_keeps_all(p: dict[str, Any] | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_all(part) for part in p.get("pretokenizers") or [])
    if kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts"):
        return True
    if kind in ("Split", "Punctuation"):
        return bool(p.get("behavior", "Isolated") != "Removed")
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop characters


def _has_type(p: dict[str, Any] | None, kind: str) -> bool:
    if p is None:
        return False
    if p.get("type") == kind:
        return True
    return any(_has_type(part, kind) for part in p.get("pretokenizers") or [])


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class TextAssembler:
    """Token ids in, text deltas out; cuts the text at the first stop string (OpenAI excludes it).

    Text that could be the start of a stop string is held back until it cannot be.
    """

    tokenizer: Tokenizer
    prompt_ids: list[int]
    stop: list[str]
    text: str = ""  # everything emitted so far
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # Completions' echo: the prompt's text, which the answer's text starts with; with logprobs, the prompt's
    # own (from the first event: tokens 1..n-1, and their alternatives) come before the generated tokens'.
    echo: str | None = None
    drop_output: bool = False  # echo with max_tokens 0: the one token the workers generated is left out
    want_prompt_logprobs: bool = False  # echo with logprobs: the first event must bring the prompt's
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    offset: int = 0  # characters of the tokens listed in logprobs so far (completions' text_offset)
    num_cached_tokens: int | None = None  # from the first event: the prompt tokens a prefix cache served
    _pending: str = ""
    _detok: Any = field(default=None)

    def __post_init__(self) -> None:
        self._detok = self.tokenizer.new_detokenizer(self.prompt_ids)
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None,
             top_logprobs: list[list[tuple[int, float]]] | None = None) -> Delta:
        if self.finished:
            return Delta("", [], None, None)
        self.token_ids += token_ids
        for tok in token_ids:
            self._pending += self._detok.push(tok)
        if self.stop:
            hit = _first_stop(self._pending, self.stop)
            if hit is not None:
                out, self._pending, self.finished = self._pending[:hit], "", True
                self.text += out
                return Delta(out, token_ids, logprobs, "stop", top_logprobs)
        if finish_reason is not None:
            out, self._pending, self.finished = self._pending, "", True
        else:
            cut = max(0, len(self._pending) - self._hold) if self.stop else len(self._pending)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return Delta(out, token_ids, logprobs, finish_reason, top_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
