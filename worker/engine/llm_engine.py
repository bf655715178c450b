"""LLMEngine: the in-process API the worker server drives.

`add_request` queues work, `step` runs one scheduler iteration and returns what changed,
`abort` drops a request. Roles: `both` runs requests to the end; `prefill` stops each request
after its prompt (first token + KV blocks, held until `release_kv`); `decode` also accepts
requests whose prompt KV was shipped in (`reserve_kv` -> transfer -> `add_prefilled_request`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..kv.events import EventBatch
from ..kv.layout import KVLayout
from ..kv.manager import KVCacheManager, blocks_for
from ..model.config import ModelConfig
from ..model.loader import TORCH_DTYPES, load_model
from ..model.tensor_parallel import TensorParallel
from ..model.tokenizer import Tokenizer
from .detokenizer import OutputText
from .grammar import JSON_KINDS, Grammars, mask_logits
from .kv_budget import free_memory_bytes, kv_budget_bytes
from .outputs import EngineStats, LayerWrite, RequestOutput
from .penalties import adjust_logits, wants_adjusting
from .runner import ModelRunner
from .sampler import DRAW_FAILED, Sampled, prompt_logprobs, sample, skip_draws
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status

if TYPE_CHECKING:
    from .tp_group import TPGroup

log = logging.getLogger(__name__)

LayerCallback = Callable[[int, list[LayerWrite]], None]


class LLMEngine:
    """Not thread-safe: call every method from one thread (the worker server's engine loop).

    Tensor parallel: `tp_group.launch_engine` builds one per rank (`tp`); rank 0's is the engine to use,
    the others run the steps it publishes. `close()` stops them."""

    def __init__(self, cfg: EngineConfig, progress: Callable[[str, float], None] | None = None,
                 tp: TPGroup | None = None) -> None:
        if cfg.tensor_parallel_size != (tp.size if tp is not None else 1):
            raise ValueError(f"tensor_parallel_size {cfg.tensor_parallel_size}: start the engine with "
                             f"tandem.worker.engine.tp_group.launch_engine")
        self.config = cfg
        self.tp = tp
        shard = tp.shard if tp is not None else TensorParallel()
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {cfg.device!r} requested but CUDA is not available here")
        report = progress or (lambda stage, fraction: None)
        report("config", 0.0)
        model_config = ModelConfig.from_dir(cfg.model_dir)
        self.model_config = model_config
        self.model_name = model_config.name
        self.tokenizer = Tokenizer(cfg.model_dir, extra_eos_ids=model_config.eos_token_ids)
        # Structured outputs: nothing of xgrammar is loaded, and its vocabulary table not built, until a
        # request brings a grammar.
        self.grammars = Grammars(self.tokenizer, model_config.vocab_size, sorted(self.tokenizer.eos_token_ids))
        report("config", 1.0)
        share_of_memory = cfg.memory_utilization is not None  # then the weights count against the KV budget
        free_before_load = free_memory_bytes(self.device) if share_of_memory else 0
        self.model = load_model(cfg.model_dir, cfg.dtype, cfg.device, progress=report, tp=shard)
        weight_bytes = _weight_bytes(self.model) if share_of_memory else 0
        self.kv_layout = KVLayout(model=self.model_name, dtype=cfg.dtype, block_size=cfg.block_size,
                                  num_layers=model_config.num_layers,
                                  num_kv_heads=len(shard.kv_heads(model_config)),  # this rank's
                                  head_dim=model_config.head_dim, tensor_parallel=shard.size,
                                  attention=model_config.attention_signature())
        self.max_model_len = self._max_model_len(model_config)
        bytes_per_token = self.kv_layout.bytes_per_block // cfg.block_size
        budget = kv_budget_bytes(cfg, self.device, bytes_per_token, self.max_model_len, free_before_load, weight_bytes)
        num_blocks = budget // self.kv_layout.bytes_per_block
        if tp is not None:  # the same blocks on every rank: the fewest any rank's memory holds
            num_blocks = tp.agree_min(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block ({self.kv_layout.bytes_per_block} bytes each)")
        capacity = num_blocks * cfg.block_size
        if capacity < self.max_model_len:
            if cfg.max_model_len is not None:
                raise ValueError(f"max_model_len {cfg.max_model_len} does not fit in the KV cache "
                                 f"({num_blocks} blocks = {capacity} tokens); raise the KV budget")
            log.info("max_model_len lowered from %d to the KV capacity of %d tokens", self.max_model_len, capacity)
            self.max_model_len = capacity
        report("kv_cache", 0.0)
        self.kv_cache = torch.zeros(model_config.num_layers, 2, num_blocks, cfg.block_size,
                                    self.kv_layout.num_kv_heads, model_config.head_dim,
                                    dtype=TORCH_DTYPES[cfg.dtype], device=self.device)
        report("kv_cache", 1.0)
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        token_budget = cfg.max_num_batched_tokens
        if not cfg.enable_chunked_prefill:  # a whole prompt must fit in one step
            token_budget = max(token_budget, self.max_model_len)
        self.scheduler = Scheduler(self.kv, token_budget, cfg.max_num_seqs, cfg.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg.block_size, self.device,
                                  tp if tp is not None and tp.rank == 0 else None)
        self._requests: dict[str, Sequence] = {}  # waiting or running
        self._held: dict[str, list[int]] = {}  # prefill role: blocks kept until release_kv
        self._reserved: dict[str, list[int]] = {}  # decode role: blocks awaiting incoming KV
        self._pending: list[RequestOutput] = []  # outputs decided outside a step (aborts, instant finishes)
        self._layer_callback: LayerCallback | None = None
        self._default_generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        # Set by step(): why waiting requests got nothing this step although nothing runs (None otherwise).
        # Only blocks held or reserved for KV transfers can cause it; they are the caller's to release.
        self.stall: str | None = None
        report("ready", 1.0)

    # ----- requests -----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, sampled_before: int = 0) -> None:
        """`sampled_before`: tokens of this request another worker already sampled (they end the
        prompt here); a seeded request's generator skips their draws and continues where that one was."""
        self._check_new(request_id, prompt_token_ids, params)
        seq = self._new_sequence(request_id, prompt_token_ids, params, arrival_time, sampled_before)
        seq.num_sampled_in_prompt = sampled_before  # outputs, for the presence and frequency penalties
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        if request_id in self._held or request_id in self._reserved:
            self.release_kv(request_id)
            self.cancel_reservation(request_id)
            return
        seq = self._requests.get(request_id)
        if seq is None:
            return
        self._finish(seq, "abort")
        self._pending.append(self._output(seq, [], None))

    def close(self) -> None:
        """Stop the tensor-parallel followers (nothing to do for a single-process engine)."""
        if self.tp is not None:
            self.tp.close()

    def kv_events(self, cursor: int, epoch: str | None) -> EventBatch:
        """What the prefix cache stored and evicted after `cursor` (kv/events.py), for the router's picture."""
        pool = self.kv.pool
        return pool.events.read(cursor, epoch, pool.cached.keys())

    def check_health(self) -> None:
        """Raise TensorParallelError if a tensor-parallel rank has died (cheap: the worker calls it while idle,
        so a dead rank is found before a request needs it)."""
        if self.tp is not None:
            self.tp.check()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        self.stall = None
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running and not plan.preempted:
                self.stall = self._stall_reason()
            return outputs
        to_sample = [s for s, n in plan.scheduled if s.num_computed_tokens + n == s.num_tokens]
        spans = [(s, *span) for s, n in plan.scheduled if (span := s.prompt_logprob_span(n)) is not None]
        logits = self.runner.execute(plan.scheduled, to_sample, self._layer_hook(plan.scheduled), spans)
        if spans:
            self._record_prompt_logprobs(logits[len(to_sample):], spans)
            logits = logits[:len(to_sample)]
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            seq.num_registered_blocks = self.kv.cache_blocks(
                seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens, seq.num_registered_blocks)
        if not to_sample:
            return outputs
        sampled = self._sample(logits, to_sample)
        for i, seq in enumerate(to_sample):
            error = sampled.errors.get(i)
            if error is None:
                try:
                    outputs.append(self._advance(seq, sampled, i))
                    continue
                except Exception:  # this request's own bookkeeping (stop strings, detokenizing): fail it alone
                    log.exception("request %s: handling its new token failed", seq.request_id)
                    error = "handling this request's new token failed"
            outputs.append(self._fail(seq, error))
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """Sample every row at once; if that raises (one request's settings tripping something the
        checks did not foresee), sample row by row so the failure stays with the row that causes it."""
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        raw = logits
        if any(wants_adjusting(p) for p in params):  # logprobs stay the model's own (raw), as vLLM's default
            logits = adjust_logits(logits, params, [s.token_ids for s in seqs],
                                   [s.num_output_tokens + s.num_sampled_in_prompt for s in seqs],
                                   self.tokenizer.eos_token_ids)
        if any(s.matcher is not None for s in seqs):
            if logits is raw:
                logits = logits.clone()
            json_rows = [i for i, s in enumerate(seqs) if s.matcher is not None and s.params.grammar is not None
                         and s.params.grammar[0] in JSON_KINDS]
            mask_logits(logits, [s.matcher for s in seqs], json_rows,
                        self.grammars.control_tokens() if json_rows else None)
        try:
            return sample(logits, params, generators, self._default_generator, raw)
        except Exception:
            log.exception("sampling a batch of %d failed; sampling its requests one by one", len(seqs))
        merged = Sampled([0] * len(seqs), [0.0] * len(seqs) if any(p.logprobs for p in params) else None,
                         top_logprobs=[[] for _ in seqs] if any(p.top_logprobs for p in params) else None)
        for i in range(len(seqs)):
            try:
                one = sample(logits[i:i + 1], params[i:i + 1], generators[i:i + 1], self._default_generator,
                             raw[i:i + 1])
            except Exception:
                log.exception("request %s: sampling failed", seqs[i].request_id)
                merged.errors[i] = DRAW_FAILED
                continue
            merged.tokens[i] = one.tokens[0]
            if merged.logprobs is not None and one.logprobs is not None:
                merged.logprobs[i] = one.logprobs[0]
            if merged.top_logprobs is not None and one.top_logprobs is not None:
                merged.top_logprobs[i] = one.top_logprobs[0]
            if 0 in one.errors:
                merged.errors[i] = one.errors[0]
        return merged

    def _record_prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> None:
        """Prompt logprobs of this step's positions (`spans`, as ModelRunner.execute takes them)."""
        targets = [s.token_ids[pos + 1] for s, lo, hi in spans for pos in range(lo, hi)]
        top = [s.params.prompt_logprobs or 0 for s, lo, hi in spans for _ in range(lo, hi)]
        chosen, tops = prompt_logprobs(logits, targets, top)
        row = 0
        for seq, lo, hi in spans:
            seq.prompt_logprobs += chosen[row:row + hi - lo]
            if seq.params.prompt_logprobs:
                seq.prompt_top_logprobs += tops[row:row + hi - lo]
            row += hi - lo

    def _advance(self, seq: Sequence, sampled: Sampled, row: int) -> RequestOutput:
        """Append a request's newly sampled token; its output (a hand-over on the prefill role)."""
        token = sampled.tokens[row]
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not follow the request's grammar")  # the mask let it through?
        seq.token_ids.append(token)
        reason = self._stop_reason(seq, token)
        lp = [sampled.logprobs[row]] if sampled.logprobs is not None and seq.params.logprobs else None
        top = [sampled.top_logprobs[row]] if sampled.top_logprobs is not None and seq.params.top_logprobs else None
        if self.config.role == "prefill":  # even when the first token ends it: its KV may be in flight
            out = self._hand_over(seq, token, lp, reason or "prefilled")
        else:
            if reason is not None:
                self._finish(seq, reason)
            out = self._output(seq, [token], lp)
        out.top_logprobs = top
        if seq.needs_prompt_logprobs:  # the prompt is computed: its logprobs go with the first token
            seq.prompt_logprobs_sent = True
            if len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1:
                out.prompt_logprobs = seq.prompt_logprobs
                out.prompt_top_logprobs = seq.prompt_top_logprobs if seq.params.prompt_logprobs else None
            seq.prompt_logprobs, seq.prompt_top_logprobs = [], []
        return out

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """End one request with an error (its blocks freed); the rest of the batch goes on."""
        log.warning("request %s failed: %s", seq.request_id, error)
        if seq.status is Status.FINISHED:  # it failed after finishing (its blocks are freed or held already)
            seq.finish_reason = "error"
        else:
            self._finish(seq, "error")
        out = self._output(seq, [], None)
        out.error = error
        return out

    def iter_outputs(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding outputs as they come.

        Raises RuntimeError instead of spinning when waiting requests cannot be admitted because
        blocks are held for KV transfers (release_kv) or reserved for them (cancel_reservation).
        """
        while self.has_unfinished_requests():
            outputs = self.step()
            if self.stall is not None and not outputs:
                raise RuntimeError(self.stall)
            yield from outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (a convenience for scripts and tests); output token ids per prompt."""
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(request_id, prompt, params)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        for out in self.iter_outputs():
            tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[i] for i in ids]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            queued_prompt_tokens=self.scheduler.queued_prompt_tokens,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_reserved_blocks=sum(len(b) for b in self._reserved.values()),
            num_held_blocks=sum(len(b) for b in self._held.values()),
            num_preemptions=self.scheduler.num_preemptions,
        )

    # ----- disaggregation -----

    def set_layer_callback(self, cb: LayerCallback | None) -> None:
        self._layer_callback = cb

    def release_kv(self, request_id: str) -> None:
        """Prefill role: the request's KV has been shipped; free its blocks (no-op if unknown)."""
        blocks = self._held.pop(request_id, None)
        if blocks is not None:
            self.kv.free(blocks)

    def reserve_kv(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Decode role: blocks to receive `num_tokens` tokens of KV, or None when they do not fit now."""
        if request_id in self._reserved or request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if num_tokens >= self.max_model_len:
            raise ValueError(f"{num_tokens} prompt tokens leave no room to decode within max_model_len "
                             f"{self.max_model_len}")
        blocks: list[int] = []
        if self.kv.allocate_slots(blocks, num_tokens) is None:
            return None
        self._reserved[request_id] = blocks
        return list(blocks)

    def cancel_reservation(self, request_id: str) -> None:
        blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.kv.free(blocks)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                              params: SamplingParams, arrival_time: float | None = None) -> None:
        """Decode role: the prompt's KV now sits in the blocks `reserve_kv` returned; decode from first_token_id."""
        blocks = self._reserved.get(request_id)
        if blocks is None:
            raise ValueError(f"request {request_id!r} has no KV reservation (call reserve_kv first)")
        # On a ValueError the reservation stays; the caller's failure path cancels it.
        if blocks_for(len(prompt_token_ids), self.kv.block_size) != len(blocks):
            raise ValueError(f"request {request_id!r}: {len(prompt_token_ids)} prompt tokens do not match the "
                             f"{len(blocks)} reserved blocks")
        if not isinstance(first_token_id, int) or not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"request {request_id!r}: first_token_id {first_token_id!r} is outside the vocabulary")
        del self._reserved[request_id]
        try:
            self._check_new(request_id, prompt_token_ids, params)
        except ValueError:
            self._reserved[request_id] = blocks
            raise
        try:
            seq = self._new_sequence(request_id, prompt_token_ids, params, arrival_time, sampled_before=1,
                                     produced=[first_token_id])
        except ValueError:
            self._reserved[request_id] = blocks
            raise
        seq.block_table = blocks
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.prefix_recorded = True
        seq.num_registered_blocks = self.kv.cache_blocks(seq.block_table, seq.block_hashes, seq.token_ids,
                                                         seq.num_computed_tokens, 0)
        seq.token_ids.append(first_token_id)
        reason = self._stop_reason(seq, first_token_id)
        seq.text.skip_pending()  # the prefill worker already streamed this token's text
        if reason is not None:  # the first token already ends it (EOS, stop string, max_tokens=1)
            self.kv.free(seq.block_table)
            seq.status, seq.finish_reason = Status.FINISHED, reason
            self._pending.append(self._output(seq, [], None))
            return
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    # ----- internals -----

    def _max_model_len(self, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings  # sliding windows are masked per layer: no cap at the window
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit}")
        return self.config.max_model_len

    def _check_new(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests or request_id in self._held or request_id in self._reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {request_id!r}: prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"request {request_id!r}: logit_bias token ids must be in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams,
                      arrival_time: float | None, sampled_before: int = 0,
                      produced: list[int] | None = None) -> Sequence:
        """`produced`: the tokens sampled before (default: the prompt's last `sampled_before`), which a
        grammar's matcher must follow before it masks this request's next token."""
        # Tokens sampled before end the prompt, so the prompt bounds them: each costs a draw below, on
        # the engine thread, which an unbounded count would hold for as long as it likes.
        if not 0 <= sampled_before <= len(prompt):
            raise ValueError(f"request {request_id!r}: sampled_before must be in [0, {len(prompt)}] (the prompt's "
                             f"length), got {sampled_before}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            if not params.greedy:  # greedy tokens draw nothing
                skip_draws(generator, self.model_config.vocab_size, sampled_before)
        matcher = None
        if params.grammar is not None:
            if produced is None:
                produced = prompt[len(prompt) - sampled_before:] if sampled_before else []
            matcher = self.grammars.matcher(params.grammar, produced)
        text = OutputText(self.tokenizer.new_detokenizer(prompt), params.stop)
        seq = Sequence(request_id, prompt, params, arrival_time if arrival_time is not None else time.time(),
                       text, generator)
        seq.matcher = matcher
        return seq

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids):
            return "stop"
        if seq.text.push(token):
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():  # the grammar is complete (and ignore_eos)
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stall_reason(self) -> str:
        held = sum(len(b) for b in self._held.values())
        reserved = sum(len(b) for b in self._reserved.values())
        waiting = len(self.scheduler.waiting)
        if not held and not reserved:  # the scheduler preempts waiting owners, and a request alone always fits
            raise RuntimeError(f"scheduler bug: {waiting} waiting requests, nothing running, and "
                               f"{self.kv.num_free_blocks} of {self.kv.num_total_blocks} KV blocks free")
        return (f"{waiting} waiting requests cannot get KV blocks: {self.kv.num_free_blocks} of "
                f"{self.kv.num_total_blocks} are free, {held} held for outgoing KV transfers (release_kv) and "
                f"{reserved} reserved for incoming KV (cancel_reservation or add_prefilled_request)")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.kv.free(seq.block_table)
        seq.finish_reason = reason
        self._requests.pop(seq.request_id, None)

    def _hand_over(self, seq: Sequence, token: int, logprobs: list[float] | None, reason: str) -> RequestOutput:
        """Prefill role: the prompt is done; keep its blocks for the transfer and report them."""
        blocks = list(seq.block_table)
        seq.block_table.clear()  # ownership moves to _held; _finish then frees nothing
        self._held[seq.request_id] = blocks
        self._finish(seq, reason)
        out = self._output(seq, [token], logprobs)
        out.kv_block_ids = blocks
        return out

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs: list[float] | None) -> RequestOutput:
        finished = seq.status is Status.FINISHED
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=seq.text.take_delta(finished),
            finished=finished,
            finish_reason=seq.finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _layer_hook(self, scheduled: list[tuple[Sequence, int]]) -> Callable[[int], None] | None:
        callback = self._layer_callback
        if callback is None:
            return None
        bs = self.kv.block_size
        writes = [LayerWrite(s.request_id, s.block_table[s.num_computed_tokens // bs: blocks_for(s.num_computed_tokens + n, bs)],
                             s.num_computed_tokens, s.num_computed_tokens + n) for s, n in scheduled]
        return lambda layer: callback(layer, writes)


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the loaded weights, by storage, so tied embeddings count once."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
