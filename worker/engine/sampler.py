"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Filtering runs batched; the final draw is per row, from the request's own generator when it
has a seed, so a seeded request samples the same tokens whatever it is batched with.

A row that cannot be sampled (NaN logits, a distribution with no finite mass) fails alone: its
request gets an error, every other row its token. Rows never mix in these operations, so one bad
row cannot spoil another's numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

NAN_LOGITS = "the model's output for this request is not a number (NaN or infinite logits)"
NO_DISTRIBUTION = "this request's sampling settings leave no valid distribution to sample from"
DRAW_FAILED = "sampling this request's next token failed"


@dataclass
class Sampled:
    tokens: list[int]  # one per row; meaningless where the row failed
    logprobs: list[float] | None  # when any request wants them
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled
    # Per row, its params.top_logprobs most likely (token, logprob), best first; when any request wants them.
    top_logprobs: list[list[tuple[int, float]]] | None = None


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], default_generator: torch.Generator,
           raw_logits: torch.Tensor | None = None) -> Sampled:
    """logits: float32 [num_seqs, vocab], after any penalties (raw_logits: the model's own, if they
    differ). The chosen tokens and, if any request wants them, the log-probability of each chosen
    token under the model's (unscaled, unpenalised) distribution."""
    tokens = torch.argmax(logits, dim=-1)
    errors = {i: NAN_LOGITS for i in bad_logit_rows(logits)}
    random_rows = [i for i, p in enumerate(params) if not p.greedy and i not in errors]
    if random_rows:
        probs = _filtered_probs(logits[random_rows], [params[i] for i in random_rows])
        errors |= {random_rows[row]: NO_DISTRIBUTION for row in bad_prob_rows(probs)}
        for row, i in enumerate(random_rows):
            if i in errors:
                continue
            try:
                tokens[i] = torch.multinomial(probs[row], 1, generator=generators[i] or default_generator)[0]
            except RuntimeError:  # not expected after the checks above; still this row's alone
                log.exception("sampling row %d failed", i)
                errors[i] = DRAW_FAILED
    chosen = tokens.tolist()
    if not any(p.logprobs for p in params):
        return Sampled(chosen, None, errors)
    log_probs = torch.log_softmax(logits if raw_logits is None else raw_logits, dim=-1)
    logprobs = log_probs.gather(1, tokens[:, None]).squeeze(1)
    return Sampled(chosen, logprobs.tolist(), errors, _top_logprobs(log_probs, params))


def _top_logprobs(log_probs: torch.Tensor, params: Sequence[SamplingParams]) -> list[list[tuple[int, float]]] | None:
    """One top-k over the batch at the largest k asked for, cut to each row's own k."""
    k = max(p.top_logprobs for p in params)
    if k == 0:
        return None
    values, ids = torch.topk(log_probs, min(k, log_probs.shape[-1]), dim=-1)
    rows = zip(ids.tolist(), values.tolist(), strict=True)
    return [list(zip(i[:p.top_logprobs], v[:p.top_logprobs], strict=True)) for p, (i, v) in zip(params, rows, strict=True)]


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top: Sequence[int]
                    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Prompt logprobs: per row of `logits` (float32, the model's own), the log-softmax at its target
    token (the prompt token that follows the row's position) and its `top[row]` most likely (token,
    logprob) pairs, best first."""
    log_probs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    chosen = log_probs.gather(1, index[:, None]).squeeze(1).tolist()
    k = max(top, default=0)
    if k == 0:
        return chosen, [[] for _ in chosen]
    values, ids = torch.topk(log_probs, min(k, log_probs.shape[-1]), dim=-1)
    rows = zip(top, ids.tolist(), values.tolist(), strict=True)
    return chosen, [list(zip(i[:n], v[:n], strict=True)) for n, i, v in rows]


def bad_logit_rows(logits: torch.Tensor) -> list[int]:
    """Rows with a NaN or +inf logit: the model's numbers broke down (-inf is a masked token, fine)."""
    return _rows(torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1))


def bad_prob_rows(probs: torch.Tensor) -> list[int]:
    """Rows of (unnormalised) probabilities `multinomial` refuses: not finite, or no positive mass."""
    return _rows(~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0))


def _rows(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(mask).flatten().tolist()]


def skip_draws(generator: torch.Generator, vocab_size: int, num_draws: int) -> None:
    """Advance a request's generator past `num_draws` tokens sampled elsewhere (by the prefill worker,
    or a decode worker the request migrated from), so its next draw is the one a single worker would
    make. How much of the generator's stream a draw uses depends on the vocabulary size only, not on
    the probabilities, so a draw from a uniform distribution advances it exactly like the real one."""
    uniform = torch.ones(vocab_size, device=generator.device)
    for _ in range(num_draws):
        torch.multinomial(uniform, 1, generator=generator)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k for p in params]
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
        sorted_desc = torch.sort(logits, dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = before >= torch.tensor(top_p, device=device, dtype=probs.dtype)[:, None]
        # The best token always stays: a top_p that rounds to 0 in the logits' dtype (5e-324 is a valid
        # top_p > 0, and 0 in float32) would otherwise drop every token and fail the request.
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device,
                                                                           dtype=probs.dtype)[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
