"""Wire format of the worker control API (router <-> worker), as pydantic models.

Kept in one module so the router and the worker cannot drift apart. Token streams are
newline-delimited JSON (`StreamChunk` per line): cheaper to parse than SSE between our own
processes, and a missing final chunk is how the router notices a worker that died mid-stream.
A blank line is a heartbeat: a worker sends one after STREAM_HEARTBEAT_S without output, so a
router hears from a live worker at least that often, and a frozen one (stopped, swapped out, cut
off) shows as silence within seconds, not only after the stall timeout.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

CONTROL_API_VERSION = 2  # 2: streams carry heartbeats (blank lines)
STREAM_HEARTBEAT_S = 1.0


class Sampling(BaseModel):
    """Mirror of the engine's SamplingParams (plain data, so the router does not import torch)."""

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False


class GenerateRequest(BaseModel):
    """Plain generation on a `both` or `decode` worker (monolithic mode, fallback, migration)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    deadline_s: float = Field(600.0, gt=0)  # seconds from now; the worker aborts after it
    # Tokens of this request already sampled elsewhere (a migration: they end the prompt); a seeded
    # request's generator skips their draws, so the continuation is the draw of an undisturbed run.
    sampled_before: int = Field(0, ge=0)


class ReserveRequest(BaseModel):
    request_id: str
    num_tokens: int = Field(ge=1)
    deadline_s: float = Field(30.0, gt=0)  # the reservation is freed if no decode call claims it


class ReserveResponse(BaseModel):
    transfer_id: str
    kv_address: str
    block_ids: list[int]
    layout_hash: str


class KVTarget(BaseModel):
    """Where a prefill worker ships the KV of one request."""

    kv_address: str
    transfer_id: str
    block_ids: list[int]
    layout_hash: str


class PrefillRequest(BaseModel):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    target: KVTarget | None = None  # None: prefill only (first token), nothing to ship
    deadline_s: float = Field(60.0, gt=0)


class PrefillResponse(BaseModel):
    first_token_id: int
    logprob: float | None = None
    num_prompt_tokens: int
    kv_sent: bool  # False: the transfer failed; decode must prefill locally
    error: str | None = None


class DecodeRequest(BaseModel):
    """Continue a request on a decode worker after prefill returned its first token.

    With kv_ready the reserved blocks hold the prompt's KV; otherwise (or if the transfer did not
    land before the deadline) the worker cancels the reservation and prefills locally.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: Sampling  # the client's sampling; max_tokens counts the first token too
    kv_ready: bool = True
    deadline_s: float = Field(600.0, gt=0)


class AbortRequest(BaseModel):
    request_id: str


class StreamChunk(BaseModel):
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    error: str | None = None  # set with finished=True when the worker gave up on the request
    fallback: bool = False  # the decode worker prefilled locally (KV transfer failed)


class WorkerInfo(BaseModel):
    api_version: int = CONTROL_API_VERSION
    model: str
    role: str
    pool: str
    layout_hash: str
    kv_address: str | None
    transport: str | None
    max_model_len: int
    block_size: int
    ready: bool
    draining: bool
    load_progress: float
    in_flight: int = 0  # requests this worker is serving (streams, prefills, unclaimed reservations)
    stats: dict[str, Any] = Field(default_factory=dict)
