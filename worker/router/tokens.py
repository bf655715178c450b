"""The router's tokenizer and the per-request text assembly (detokenizing, stop strings, logprobs).

The router tokenizes prompts (it needs their length and prefix for placement) and detokenizes
the tokens the workers stream back, so a request whose tokens came from a prefill worker, a
decode worker and, after a migration, another decode worker still reads as one clean text.
The tokenizer files come from a worker (GET /tokenizer) unless the router was given the model folder.
"""

from __future__ import annotations

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


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None


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
    _pending: str = ""
    _detok: Any = field(default=None)

    def __post_init__(self) -> None:
        self._detok = self.tokenizer.new_detokenizer(self.prompt_ids)
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None) -> Delta:
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
                return Delta(out, token_ids, logprobs, "stop")
        if finish_reason is not None:
            out, self._pending, self.finished = self._pending, "", True
        else:
            cut = max(0, len(self._pending) - self._hold) if self.stop else len(self._pending)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return Delta(out, token_ids, logprobs, finish_reason)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
