"""The state of one request as it moves through the engine."""

from __future__ import annotations

import enum
from typing import Any

import torch

from ..kv.prefix_hash import BlockHash
from .detokenizer import OutputText
from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, text: OutputText, generator: torch.Generator | None) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)  # prompt, then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.text = text
        self.generator = generator  # per-request RNG when params.seed is set
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []  # of full blocks, computed or not
        self.num_registered_blocks = 0  # leading blocks indexed in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.prefix_recorded = False
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.num_sampled_in_prompt = 0  # trailing prompt tokens another worker generated (a migration)
        self.matcher: Any = None  # xgrammar's GrammarMatcher when params.grammar is set (grammar.py)
        # params.prompt_logprobs: entry i is prompt token i + 1's (position i's logits score it), filled
        # chunk by chunk as the prompt is computed, handed out with the first token (then cleared).
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_logprobs_sent = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def owns_kv(self) -> bool:
        """Holds KV blocks while not running: a prefilled hand-off (decode role) waiting for admission.
        New and preempted sequences hold none; one in the middle of a chunked prefill is running."""
        return self.status is Status.WAITING and bool(self.block_table)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for its prompt's logprobs and has not had them yet: its prompt must be computed (no
        prefix-cache hit), since a cached prefix has no logits."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def prompt_logprob_span(self, num_new: int) -> tuple[int, int] | None:
        """The positions [lo, hi) of this step's `num_new` tokens whose logits score a prompt token that
        has no logprob yet (position p scores prompt token p + 1), or None. After a preemption the
        recomputed positions already scored are skipped; a prompt whose start this engine did not
        compute (KV from elsewhere) gets none."""
        start = self.num_computed_tokens
        if not self.needs_prompt_logprobs or start > len(self.prompt_logprobs):
            return None
        lo, hi = len(self.prompt_logprobs), min(start + num_new, self.num_prompt_tokens - 1)
        return (lo, hi) if lo < hi else None

    @property
    def num_uncomputed_prompt_tokens(self) -> int:
        return max(self.num_prompt_tokens - self.num_computed_tokens, 0)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
