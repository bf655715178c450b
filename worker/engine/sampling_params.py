"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this are greedy. Dividing logits by a smaller one overflows float32 or leaves a
# distribution with all its mass on one token anyway; 1e-50 (which is 0.0 in float32) made the softmax
# NaN and `multinomial` raise (issue 18). vLLM draws the line at the same place.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # a seeded request samples the same tokens whatever it is batched with
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # `not a <= x` rather than `x < a`: NaN fails every comparison and must fail the check too.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
