"""Wire format of the worker control API (router <-> worker), as pydantic models.

Kept in one module so the router and the worker cannot drift apart. Token streams are
newline-delimited JSON (`StreamChunk` per line): cheaper to parse than SSE between our own
processes, and a missing final chunk is how the router notices a worker that died mid-stream.
A blank line is a heartbeat: a worker sends one after STREAM_HEARTBEAT_S without output, so a
router hears from a live worker at least that often, and a frozen one (stopped, swapped out, cut
off) shows as silence within seconds, not only after the stall timeout.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# 2: streams carry heartbeats (blank lines); 3: a chunk's error may be the request's own (request_error);
# 4: Sampling's grammar, penalties, logit_bias, min_tokens and top_logprobs (SAMPLING_FIELDS_SINCE);
# 5: Sampling's prompt_logprobs (completions' echo), answered in PrefillResponse and the first StreamChunk
# 6: GET /kv/events (KVEvents): what the prefix cache stored and evicted, for the router's placement
CONTROL_API_VERSION = 6
KV_EVENTS_SINCE = 6
STREAM_HEARTBEAT_S = 1.0

# Ranges every caller of a worker is held to, the router included (it checks the same ones first, so a
# client sees them as 400s with the OpenAI parameter named). The worker checks them again: it must not
# trust its caller to have (issue 18: one out-of-range request could fail every request on a worker).
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (and the engine's)
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's [-100, 100] per token
# Dividing logits by a repetition penalty much below this overflows them to infinity (5e-324 did).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGIT_BIAS_TOKENS = 1024  # each biased token costs every step of the request a little
INT32_MAX = 2**31 - 1  # top_k, token ids: anything at or above the vocabulary means "off" or is refused
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit seed, as vLLM takes it (torch refuses wider ones)
# Deadlines are finite: a request's own (generate, prefill, decode) at most a day, and a reservation's at
# most 10 minutes; an unclaimed reservation holds KV blocks all that time (the router sends no more than
# the time its request has left, and claims a reservation as soon as the first token is back).
MAX_DEADLINE_S = 86_400.0
# Request ids of the router's output canary (router/canary.py). Workers serve them like any request but
# leave them out of the request metrics (TTFT, ITL, tokens, requests): a probe a minute is no user's
# latency, and the autoscaler and the SLO rules read those series.
CANARY_ID_PREFIX = "canary-"
MAX_RESERVE_DEADLINE_S = 600.0
MAX_GRAMMAR_CHARS = 65_536  # a JSON schema, regex or choice list (engine/grammar.py holds the same limit)

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Wire(BaseModel):
    # No NaN or Infinity anywhere (pydantic's JSON parser takes both): a NaN passes no range check
    # and an infinite deadline never passes.
    model_config = ConfigDict(allow_inf_nan=False)


class Grammar(_Wire):
    """The output must follow this (engine/grammar.py): a JSON schema (spec: its JSON text), any JSON
    object (spec empty), a regex, or one of a list of strings (spec: their JSON list)."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    spec: str = Field("", max_length=MAX_GRAMMAR_CHARS)


class Sampling(_Wire):
    """Mirror of the engine's SamplingParams (plain data, so the router does not import torch)."""

    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)  # below the engine's floor: greedy
    top_k: int = Field(0, ge=0, le=INT32_MAX)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # with logprobs: the most likely tokens too
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)  # at most max_tokens (the engine checks)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS_TOKENS)
    grammar: Grammar | None = None  # structured outputs and forced tool calls
    # The prompt's own logprobs (echo with logprobs): with the first token, and this many most likely tokens
    # per prompt token (0: none). None: off. The worker that computes the prompt computes them.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


# Since which control API version a worker honours each Sampling field added after version 3. A worker
# ignores a field it does not know (pydantic's default, kept: see below), so a worker of version 3 would
# take a request with a grammar and answer unconstrained output, or drop a penalty, without a word. The
# router therefore sends a request that sets one of these (a value other than the default) only to workers
# whose /info reports at least that version (router/dispatch.py), and waits for one (503 after 10 s) when
# none does. Every field added to Sampling from now on goes in here with the version that brought it
# (tests/unit/test_protocol_versions.py fails otherwise).
#
# Why a worker does not refuse unknown fields instead (extra="forbid"): it would not help in the roll that
# matters now (the version 3 workers already out there ignore them; only a router can keep requests from
# them), and later it would break the other half of a roll: a router newer than a worker sends every field
# of its Sampling, set or not, so every request to the older worker would be a 400, which the router
# passes to the client as the request's own fault, without trying another worker.
SAMPLING_FIELDS_SINCE: dict[str, int] = {
    "grammar": 4, "top_logprobs": 4, "presence_penalty": 4, "frequency_penalty": 4, "min_tokens": 4,
    "repetition_penalty": 4, "logit_bias": 4, "prompt_logprobs": 5,
}


def required_api_version(sampling: Sampling) -> tuple[int, list[str]]:
    """The oldest control API version that honours every field this sampling sets (1: any worker), and
    those fields (the ones that need more than version 1)."""
    fields = [name for name in SAMPLING_FIELDS_SINCE
              if getattr(sampling, name) != Sampling.model_fields[name].get_default(call_default_factory=True)]
    return max((SAMPLING_FIELDS_SINCE[name] for name in fields), default=1), fields


class GenerateRequest(_Wire):
    """Plain generation on a `both` or `decode` worker (monolithic mode, fallback, migration)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    deadline_s: float = Field(600.0, gt=0, le=MAX_DEADLINE_S)  # seconds from now; the worker aborts after it
    # Tokens of this request already sampled elsewhere (a migration: they end the prompt); a seeded
    # request's generator skips their draws, so the continuation is the draw of an undisturbed run.
    sampled_before: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _sampled_tokens_end_the_prompt(self) -> GenerateRequest:
        # Skipping a draw costs one multinomial on the engine thread: an unbounded count stalled every
        # request on the worker (300,000 took 26 s). Tokens sampled before are part of the prompt, and
        # at least one prompt token came before them, so the prompt's length bounds them.
        if self.sampled_before >= max(1, len(self.prompt_token_ids)):
            raise ValueError(f"sampled_before ({self.sampled_before}) must be less than the number of prompt "
                             f"tokens ({len(self.prompt_token_ids)}): the tokens sampled before end the prompt")
        return self


class ReserveRequest(_Wire):
    request_id: str
    num_tokens: int = Field(ge=1, le=INT32_MAX)  # and below the worker's max_model_len (checked there)
    # The reservation is freed if no decode call claims it by then.
    deadline_s: float = Field(30.0, gt=0, le=MAX_RESERVE_DEADLINE_S)


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


class PrefillRequest(_Wire):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    target: KVTarget | None = None  # None: prefill only (first token), nothing to ship
    deadline_s: float = Field(60.0, gt=0, le=MAX_DEADLINE_S)


class PrefillResponse(BaseModel):
    first_token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # the first token's, when sampling.top_logprobs
    # With sampling.prompt_logprobs (version 5): prompt tokens 1..n-1's logprobs (the first has none) and,
    # when it asks for any, their most likely (token id, logprob) pairs, best first.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (None: a worker before it said)
    kv_sent: bool  # False: the transfer failed; decode must prefill locally
    error: str | None = None


class DecodeRequest(_Wire):
    """Continue a request on a decode worker after prefill returned its first token.

    With kv_ready the reserved blocks hold the prompt's KV; otherwise (or if the transfer did not
    land before the deadline) the worker cancels the reservation and prefills locally.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: Sampling  # the client's sampling; max_tokens counts the first token too
    kv_ready: bool = True
    deadline_s: float = Field(600.0, gt=0, le=MAX_DEADLINE_S)


class AbortRequest(BaseModel):
    request_id: str


class StreamChunk(BaseModel):
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when sampling.top_logprobs
    # With the first token, when sampling.prompt_logprobs (version 5): as in PrefillResponse.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens the prefix cache served, on every chunk (the router reads the first); None: an older worker.
    num_cached_tokens: int | None = None
    error: str | None = None  # set with finished=True when the worker gave up on the request
    # With error: the failure is this request's own (its sampling failed, its logits were NaN...), the
    # same on any worker. The router fails the request alone; it neither migrates it nor marks the
    # worker down. Without: the worker failed (its engine stopped), and the request may move.
    request_error: bool = False
    fallback: bool = False  # the decode worker prefilled locally (KV transfer failed)


class KVEvents(BaseModel):
    """GET /kv/events?since=CURSOR&epoch=EPOCH (kv/events.py): the prefix cache's block hashes (hex)
    stored and evicted after the cursor, in order; or, when the worker's log cannot answer from that
    cursor (too old, or another epoch: the worker restarted), `snapshot`, every hash it holds now."""

    epoch: str
    next: int  # the cursor for the next call
    stored_evicted: list[tuple[int, str]] = Field(default_factory=list)  # (1 stored | 0 evicted, hash hex)
    snapshot: list[str] | None = None


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
