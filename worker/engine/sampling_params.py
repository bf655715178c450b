"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Temperatures below this are greedy. Dividing logits by a smaller one overflows float32 or leaves a
# distribution with all its mass on one token anyway; 1e-50 (which is 0.0 in float32) made the softmax
# NaN and `multinomial` raise (issue 18). vLLM draws the line at the same place.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range is [-2, 2]
MAX_LOGIT_BIAS = 100.0  # logit_bias values: OpenAI's range is [-100, 100]
# Dividing logits by a much smaller repetition penalty overflows them to infinity (5e-324 did).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


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
    top_logprobs: int = 0  # and this many most likely tokens with theirs (needs logprobs)
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # times how often it was generated
    repetition_penalty: float = 1.0  # transformers': context tokens' logits divided (if > 0) or multiplied by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens (vLLM's)
    # (kind, spec): the output follows a JSON schema, any JSON object, a regex or one of a list of choices
    # (grammar.py). The wire form {"kind": ..., "spec": ...} is taken too.
    grammar: tuple[str, str] | None = None
    # The prompt's own logprobs (vLLM's prompt_logprobs; completions' echo): the logprob of each prompt
    # token after the first given the tokens before it, and this many most likely tokens with theirs (0:
    # none). None: off. Such a request reads nothing from the prefix cache until they are computed.
    prompt_logprobs: int | None = None

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
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        # Not bounded by max_tokens: a migrated request's max_tokens counts what is left, min_tokens the whole.
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        if any(not isinstance(t, int) or t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
               for t, b in self.logit_bias.items()):
            raise ValueError(f"logit_bias must map token ids >= 0 to values in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        if isinstance(self.grammar, dict):
            self.grammar = (self.grammar.get("kind"), self.grammar.get("spec"))
        if self.grammar is not None:
            from .grammar import check_spec

            kind, spec = self.grammar
            if not isinstance(kind, str) or not isinstance(spec, str):
                raise ValueError("grammar must be a (kind, spec) pair of strings")
            try:
                check_spec(kind, spec)
            except (TypeError, json.JSONDecodeError) as exc:
                raise ValueError(f"invalid {kind}: {exc}") from None
            self.grammar = (kind, spec)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
