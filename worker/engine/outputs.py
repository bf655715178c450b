"""What the engine hands back: per-request outputs, engine statistics, layer-write notices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | "error"
    logprobs: list[float] | None  # one per new token, when SamplingParams.logprobs
    num_prompt_tokens: int
    num_output_tokens: int
    kv_block_ids: list[int] | None = None  # prefill role: the request's blocks, in order
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed in a layer callback)
    # With finish_reason "error": why this request failed alone (its sampling, NaN logits...); a message
    # for its client. The other requests of the step were not affected.
    error: str | None = None
    # Per new token, SamplingParams.top_logprobs (token id, logprob) pairs, best first, when it asks for any.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With the first token, when SamplingParams.prompt_logprobs: the logprob of each prompt token after the
    # first (num_prompt_tokens - 1 of them; the first has none) and, when it asks for any, that many most
    # likely (token id, logprob) pairs per prompt token, best first.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int  # prompt tokens not yet prefilled (waiting and partially prefilled requests)
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # 0..1
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found
    num_reserved_blocks: int = 0  # decode role: blocks reserved for incoming KV
    num_held_blocks: int = 0  # prefill role: blocks kept until release_kv
    num_preemptions: int = 0  # cumulative requests preempted for lack of KV blocks


@dataclass(frozen=True)
class LayerWrite:
    """Layer i of the KV for positions [start_pos, end_pos) of a request has just been written.

    `block_ids` are the blocks holding those positions: block_ids[0] holds position
    (start_pos // block_size) * block_size.
    """

    request_id: str
    block_ids: list[int]
    start_pos: int
    end_pos: int
