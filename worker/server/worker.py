"""One worker: loads the engine, runs it in an EngineLoop, and implements the control API.

HTTP routing lives in http.py; this module is the behaviour behind each route. Roles:
- both: /generate (monolithic and chunked modes);
- prefill: /prefill computes the prompt, ships its KV layer by layer, returns the first token;
- decode: /kv/reserve sets blocks aside for incoming KV, /decode continues from the first token
  (or prefills locally when the KV did not arrive, or arrived for another prompt than the one /decode
  names: the prefill worker's prompt digest travels in the transfer), /generate for local work and migration.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tandem.worker import metrics as m
from tandem.worker.server.config import WorkerConfig
from tandem.worker.server.engine_loop import EngineFailure, EngineLoop, Subscription
from tandem.worker.server.kv_link import KVIntake, KVShipper, PeerQuota
from tandem.worker.server.protocol import (
    CANARY_ID_PREFIX,
    STREAM_HEARTBEAT_S,
    DecodeRequest,
    GenerateRequest,
    KVEvents,
    PrefillRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    Sampling,
    StreamChunk,
    WorkerInfo,
)
from tandem.worker.server.telemetry import Telemetry
from tandem.worker.transfer.errors import ABANDONED, PROMPT_MISMATCH, TIMEOUT
from tandem.worker.transfer.wire import prompt_digest

log = logging.getLogger(__name__)

# Registered by TransferTelemetry, in this worker's registry (see _start_transport).
TRANSFER_METRICS = (m.KV_TRANSFER_BYTES, m.KV_TRANSFER_SECONDS, m.KV_TRANSFER_FAILURES, m.KV_RECEIVER_REFUSALS,
                    m.KV_TRANSPORT_INFO)
# The finish reasons tandem_requests_total counts on each role (the engine's finish_reason): a prefill
# worker's requests end once the prompt is computed; decode and both end on a stop token or the length.
FINISH_REASONS = {"prefill": ("prefilled",), "decode": ("stop", "length"), "both": ("stop", "length")}
POD_IP_ENV = "POD_IP"  # set from status.podIP in the operator's worker pods
CALLER_CHECK_S = 0.25  # how often a waiting /prefill asks whether its caller is still there
# ...and its first look, soon after the prompt went to the engine: a close that arrived with the request
# (a router that stopped waiting while this worker was frozen) is read only a few loop turns after it.
FIRST_CALLER_CHECK_S = 0.02


class Rejected(Exception):
    """The worker will not take this request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class WorkerServer:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.model_name = cfg.model_name or cfg.model_dir.name
        own = tuple(d for d in m.ALL_WORKER_METRICS if d not in TRANSFER_METRICS)
        self.telemetry = Telemetry(self.model_name, cfg.role, cfg.pool, own)
        self._initialise_series()
        self.transfer_telemetry: Any = None
        self.engine: Any = None
        self.loop: EngineLoop | None = None
        self.load_progress = 0.0
        self.load_error: str | None = None
        self.fatal_error: str | None = None  # the engine died for good (EngineLoop's on_fatal)
        self.on_fatal: Callable[[], None] | None = None  # run.py: shut the process down
        self.draining = False
        self.transport: str | None = None
        self.kv_address: str | None = None
        self.shipper: KVShipper | None = None
        self.intake: KVIntake | None = None
        self._receiver: Any = None
        self._sender: Any = None
        self._prefix_seen = (0, 0)
        self._preemptions_seen = 0
        self._stopped = threading.Event()

    def _initialise_series(self) -> None:
        """Export this worker's series at 0 from the start: rate() and dashboards get 0, not "no data"."""
        self.telemetry.initialise_all(FINISH_REASONS[self.cfg.role], skip=(m.MIGRATIONS,))  # migrations: the router's
        for reason in m.CONTROL_AUTH_REASONS:
            self.telemetry.initialise(m.CONTROL_AUTH_FAILURES, reason=reason)

    # --- loading ---
    @property
    def ready(self) -> bool:
        return self.loop is not None and self.loop.alive and not self.draining and self.load_error is None

    def load(self) -> None:
        """Build the engine and the transport (blocking; run it in a thread)."""
        try:
            self._load()
        except Exception as exc:
            log.exception("loading the worker failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise

    def _load(self) -> None:
        from tandem.worker.engine import EngineConfig
        from tandem.worker.engine.tp_group import launch_engine

        cfg = self.cfg
        ecfg = EngineConfig(
            model_dir=str(cfg.model_dir), role=cfg.role, dtype=cfg.dtype, device=cfg.device,
            block_size=cfg.block_size, kv_cache_bytes=cfg.kv_cache_bytes, memory_utilization=cfg.memory_utilization,
            seed=cfg.seed, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching, max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel)

        def progress(stage: str, fraction: float) -> None:
            self.load_progress = max(0.0, min(1.0, fraction)) * 0.95
            log.info("loading: %s %.0f%%", stage, fraction * 100)

        engine = launch_engine(ecfg, progress=progress)  # a plain LLMEngine at --tensor-parallel-size 1
        self.engine = engine  # close() stops its tensor-parallel ranks, even if what follows fails
        if cfg.model_name:
            self.model_name = cfg.model_name
        layout_hash = engine.kv_layout.layout_hash()
        if cfg.layout_hash and cfg.layout_hash != layout_hash:
            raise ValueError(f"this worker's KV layout hash is {layout_hash}, but {cfg.layout_hash} was expected "
                             f"(--layout-hash / TANDEM_LAYOUT_HASH): the model, dtype or block size differ from "
                             f"what the deployment declares")
        if cfg.role != "both":
            self._start_transport(engine)
        self.loop = EngineLoop(engine, on_step=self._on_step, on_fatal=self._on_fatal)
        self.loop.start()
        self.load_progress = 1.0
        self.telemetry.set(m.WORKER_READY, 1)
        log.info("worker ready: model %s, role %s, layout %s, %d KV blocks%s", self.model_name, cfg.role,
                 layout_hash, engine.stats().num_total_blocks,
                 f", {cfg.tensor_parallel} tensor-parallel ranks" if cfg.tensor_parallel > 1 else "")

    def _on_fatal(self, message: str) -> None:
        """The engine cannot step again (its tensor-parallel group ended): the process must exit and restart."""
        self.fatal_error = message
        self.telemetry.set(m.WORKER_READY, 0)
        if self.on_fatal is not None:
            self.on_fatal()

    def _start_transport(self, engine: Any) -> None:
        from tandem.worker.transfer.select import make_receiver, make_sender
        from tandem.worker.transfer.telemetry import TransferTelemetry

        cfg = self.cfg
        # The worker's own registry (once per process), so the transfer series are on its /metrics.
        self.transfer_telemetry = TransferTelemetry(self.telemetry.registry, model=self.model_name, role=cfg.role,
                                                    pool=cfg.pool)
        layout = engine.kv_layout
        if cfg.keys is not None:
            log.info("KV transfer: secure (CURVE; peers must hold the keys in %s)", cfg.kv_keys)
        elif cfg.seal is not None:
            log.info("KV transfer: sealed (aes-gcm; peers are authenticated with the model's control token)")
        else:
            log.warning("KV transfer: NOT encrypted or authenticated (--kv-encryption %s): anyone who reaches the "
                        "KV port can read or write KV", cfg.kv_encryption)
        # make_receiver/make_sender resolve the transport the user asked for (auto, tcp or rdma) and log
        # the choice and its reason once; the transport in use is the built object's. They raise
        # TransferError(unavailable) with the reason when rdma is asked for and cannot run here.
        if cfg.role == "decode":
            self._receiver = make_receiver(cfg.transport, layout, engine.kv_cache, host=cfg.host, port=cfg.kv_port,
                                           telemetry=self.transfer_telemetry, keys=cfg.keys, seal=cfg.seal)
            self.transport = str(self._receiver.transport)
            scheme, _, port = self._receiver.address.rpartition(":")
            self.kv_address = f"{scheme.split('://')[0]}://{self._advertised_host()}:{port}"
            # Never less than one full-context request: a small pool must not refuse a long prompt its
            # reservation (that request would always prefill locally, however idle the worker).
            share = int(engine.stats().num_total_blocks * cfg.max_reserved_share_per_peer)
            one_request = math.ceil(engine.max_model_len / cfg.block_size)
            quota = PeerQuota(max(share, one_request), cfg.max_reservations_per_peer)
            self.intake = KVIntake(self._receiver, self._cancel_reservation, quota)
            direction = "recv"
        else:
            # A decode worker that stops answering fails the transfer after kv_wait_timeout, the time
            # decode itself waits for KV, so a frozen peer does not hold the first token and threads
            # here until the request's deadline.
            self._sender = make_sender(cfg.transport, layout, engine.kv_cache, telemetry=self.transfer_telemetry,
                                       keys=cfg.keys, seal=cfg.seal, silence_timeout_s=cfg.kv_wait_timeout)
            self.transport = str(self._sender.transport)
            self.shipper = KVShipper(self._sender, layout.num_layers, layout.block_size)
            self.shipper.mirror_sources = cfg.fault == "swap-kv-blocks"  # a test hook (faults.py)
            engine.set_layer_callback(self.shipper.on_layer)
            direction = "send"
        # Every failure reason (and the byte/latency series) at 0, so dashboards see 0 rather than no data.
        self.transfer_telemetry.initialise(self.transport, direction)

    def _advertised_host(self) -> str:
        if self.cfg.kv_host:
            return self.cfg.kv_host
        if self.cfg.host not in ("0.0.0.0", "::", ""):
            return self.cfg.host
        # In the operator's pods the downward API gives status.podIP as POD_IP (operator/builders.py). It is
        # the address peers reach, also with hostNetwork, where the hostname is the node's and may resolve to
        # a loopback address (a Debian /etc/hosts has 127.0.1.1 for it).
        return os.environ.get(POD_IP_ENV) or socket.gethostbyname(socket.gethostname())

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.engine is not None:
            try:
                self.engine.close()  # the tensor-parallel ranks stop with this process
            except Exception:
                log.exception("closing the engine")
        for part in (self._receiver, self._sender):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.exception("closing the KV transport")

    # --- status ---
    async def kv_events(self, since: int, epoch: str | None) -> KVEvents:
        """The prefix cache's events after `since` (the engine's log, read on its thread)."""
        if self.loop is None:
            raise Rejected(503, "the model is still loading" if self.load_error is None else self.load_error)
        batch = await self.loop.acall(lambda engine: engine.kv_events(since, epoch))
        return KVEvents(epoch=batch.epoch, next=batch.next,
                        stored_evicted=[(kind, h.hex()) for kind, h in batch.events],
                        snapshot=None if batch.snapshot is None else [h.hex() for h in batch.snapshot])

    def info(self) -> WorkerInfo:
        stats: dict[str, Any] = {}
        if self.loop is not None:
            stats = dict(vars(self.loop.stats))
        engine = self.engine
        return WorkerInfo(
            model=self.model_name, role=self.cfg.role, pool=self.cfg.pool,
            layout_hash=engine.kv_layout.layout_hash() if engine else "",
            kv_address=self.kv_address, transport=self.transport,
            max_model_len=engine.max_model_len if engine else 0, block_size=self.cfg.block_size,
            ready=self.ready, draining=self.draining, load_progress=self.load_progress, in_flight=self.busy(),
            stats=stats)

    def metrics_text(self) -> bytes:
        return self.telemetry.render()  # the transfer series share this registry (see _start_transport)

    def _on_step(self, outputs: list[Any], stats: Any) -> None:  # engine thread
        t = self.telemetry
        queued = stats.num_waiting + (stats.num_running if self.cfg.role == "prefill" else 0)
        t.set(m.PREFILL_QUEUE_REQUESTS, queued)
        t.set(m.PREFILL_QUEUE_TOKENS, stats.queued_prompt_tokens)
        t.set(m.RUNNING_REQUESTS, stats.num_running)
        t.set(m.WAITING_REQUESTS, stats.num_waiting)
        t.set(m.KV_USAGE_RATIO, stats.kv_usage)
        t.set(m.KV_FREE_BLOCKS, stats.num_free_blocks)
        t.set(m.KV_TOTAL_BLOCKS, stats.num_total_blocks)
        q0, h0 = self._prefix_seen
        t.inc(m.PREFIX_CACHE_QUERIES, stats.prefix_cache_queries - q0)
        t.inc(m.PREFIX_CACHE_HITS, stats.prefix_cache_hits - h0)
        self._prefix_seen = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        t.inc(m.PREEMPTIONS, stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions

    # --- shared helpers ---
    def _require(self, *roles: str) -> EngineLoop:
        if self.loop is None:
            raise Rejected(503, "the model is still loading" if self.load_error is None else self.load_error)
        if self.cfg.role not in roles:
            raise Rejected(400, f"this is a {self.cfg.role} worker; this call needs role {' or '.join(roles)}")
        return self.loop

    def _admit(self, *roles: str) -> EngineLoop:
        loop = self._require(*roles)
        if self.draining:
            raise Rejected(503, "this worker is draining and takes no new requests")
        return loop

    @staticmethod
    def _params(s: Sampling, **update: Any) -> Any:
        from tandem.worker.engine import SamplingParams

        return SamplingParams(**{**s.model_dump(), **update})

    @staticmethod
    async def _compile_grammar(loop: EngineLoop, params: Any) -> None:
        """Compile a request's grammar off the engine thread (a large schema takes a while; the engine
        then finds it in the compiler's cache). ValueError: the grammar is invalid."""
        if params.grammar is not None:
            await asyncio.to_thread(loop.engine.grammars.compile, params.grammar)

    async def _add(self, loop: EngineLoop, request_id: str, prompt: list[int], sampling: Sampling,
                   sampled_before: int = 0, **update: Any) -> Subscription:
        try:
            params = self._params(sampling, **update)
            await self._compile_grammar(loop, params)
            sub = loop.subscribe(request_id)
        except ValueError as exc:
            raise Rejected(400, str(exc)) from None
        try:
            await loop.acall(lambda e: e.add_request(request_id, prompt, params, sampled_before=sampled_before))
        except Exception as exc:
            loop.unsubscribe(request_id)
            raise self._refusal(loop, request_id, exc) from None
        return sub

    @staticmethod
    def _refusal(loop: EngineLoop, request_id: str, exc: Exception) -> Rejected:
        """The answer to a request the engine would not add: 400 for what it names as wrong with the
        request; 503 if the engine is gone (this worker's failure: the router may try another); and for
        anything else, which this request alone caused on a live engine, 422 (it would fail anywhere)."""
        if isinstance(exc, ValueError):
            return Rejected(400, str(exc))
        if not loop.alive:
            return Rejected(503, "the engine is not running")
        log.error("request %s: the engine could not add it", request_id, exc_info=exc)
        return Rejected(422, "the engine could not take this request (the worker's log has the details)")

    async def _pump(self, loop: EngineLoop, request_id: str, sub: Subscription, deadline: float,
                    first: StreamChunk | None = None) -> AsyncIterator[bytes]:
        """NDJSON of a request's outputs until it finishes; aborts it if the caller goes away."""
        finished = False
        last: float | None = None
        telemetry = self._request_telemetry(request_id)
        try:
            if first is not None:
                yield first.model_dump_json().encode() + b"\n"
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    yield StreamChunk(finished=True, error="the request's deadline passed on the worker").model_dump_json().encode() + b"\n"
                    return
                try:
                    out = await asyncio.wait_for(sub.queue.get(), min(left, STREAM_HEARTBEAT_S))
                except TimeoutError:
                    yield b"\n"  # a heartbeat: this process is alive (protocol.py)
                    continue
                if isinstance(out, EngineFailure):
                    finished = True
                    yield StreamChunk(finished=True, error=out.message).model_dump_json().encode() + b"\n"
                    return
                now = time.monotonic()
                if out.finish_reason == "error":  # this request alone failed (request_error: not the worker)
                    finished = True
                    self._finished(out, now - sub.arrival, telemetry)
                    yield StreamChunk(finished=True, finish_reason="error", error=out.error, request_error=True,
                                      num_prompt_tokens=out.num_prompt_tokens).model_dump_json().encode() + b"\n"
                    return
                if out.new_token_ids:
                    if last is None and first is None:
                        telemetry.observe(m.TTFT, now - sub.arrival)
                    elif last is not None:
                        telemetry.observe(m.ITL, (now - last) / len(out.new_token_ids))
                    last = now
                    telemetry.inc(m.GENERATION_TOKENS, len(out.new_token_ids))
                chunk = StreamChunk(token_ids=list(out.new_token_ids), logprobs=out.logprobs,
                                    top_logprobs=out.top_logprobs, prompt_logprobs=out.prompt_logprobs,
                                    prompt_top_logprobs=out.prompt_top_logprobs, finished=out.finished,
                                    finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                                    num_cached_tokens=out.num_cached_tokens)
                yield chunk.model_dump_json().encode() + b"\n"
                if out.finished:
                    finished = True
                    self._finished(out, now - sub.arrival, telemetry)
                    return
        finally:
            loop.unsubscribe(request_id)
            if not finished:
                loop.call(lambda e: e.abort(request_id))

    def _finished(self, out: Any, e2e: float, telemetry: Telemetry | _NoTelemetry) -> None:
        telemetry.observe(m.E2E, e2e)
        telemetry.inc(m.PROMPT_TOKENS, out.num_prompt_tokens)
        telemetry.inc(m.REQUESTS, reason=str(out.finish_reason))

    def _request_telemetry(self, request_id: str) -> Telemetry | _NoTelemetry:
        """Where a request's own metrics go: nowhere for the router's canary probes (protocol.CANARY_ID_PREFIX)."""
        return _NO_TELEMETRY if request_id.startswith(CANARY_ID_PREFIX) else self.telemetry

    # --- control API ---
    async def generate(self, req: GenerateRequest) -> AsyncIterator[bytes]:
        loop = self._admit("both", "decode")
        sub = await self._add(loop, req.request_id, req.prompt_token_ids, req.sampling, req.sampled_before)
        return self._pump(loop, req.request_id, sub, time.monotonic() + req.deadline_s)

    async def reserve(self, req: ReserveRequest, caller_gone: Callable[[], Awaitable[bool]] | None = None,
                      peer: str = "") -> ReserveResponse:
        """Set blocks aside for incoming KV. `caller_gone` (the HTTP request's is_disconnected) says
        whether the router stopped waiting for the answer; then the reservation is given back at once.
        `peer` (the caller's address) is who the reservation counts against (kv_link.PeerQuota)."""
        loop = self._admit("decode")
        assert self.intake is not None and self.kv_address is not None
        if req.request_id in self.intake.reservations:
            raise Rejected(409, f"request {req.request_id!r} already has a reservation here")
        if req.num_tokens >= self.engine.max_model_len:  # a size no request has: refused before the quota
            raise Rejected(400, f"{req.num_tokens} prompt tokens leave no room to decode within max_model_len "
                           f"{self.engine.max_model_len}")
        num_blocks = math.ceil(req.num_tokens / self.cfg.block_size)
        refused = self.intake.quota.take(peer, num_blocks)
        if refused is not None:
            raise Rejected(429, refused)
        try:
            blocks = await loop.acall(lambda e: e.reserve_kv(req.request_id, req.num_tokens))
        except Exception as exc:
            self.intake.quota.give_back(peer, num_blocks)
            raise self._refusal(loop, req.request_id, exc) from None
        if blocks is None:
            self.intake.quota.give_back(peer, num_blocks)
            raise Rejected(503, f"no room for {req.num_tokens} tokens of KV on this worker now")
        # The prompt's KV fills exactly these blocks; that is what the prefill side sends.
        blocks = list(blocks)[:num_blocks]
        try:
            res = self.intake.open(req.request_id, blocks, req.deadline_s, peer, num_blocks)
        except Exception as exc:
            self.intake.quota.give_back(peer, num_blocks)
            self._cancel_reservation(req.request_id)
            log.error("request %s: could not expect its KV transfer", req.request_id, exc_info=exc)
            raise Rejected(500, "could not expect the KV transfer (the worker's log has the details)") from None
        # From here on the intake owns the reservation (and its quota): cancel() gives both back.
        if self.intake.cancelled_early(req.request_id):  # its cancel came first (or while the engine worked)
            self.intake.cancel(req.request_id)
            raise Rejected(409, f"request {req.request_id!r} was cancelled before its reservation was made")
        if caller_gone is not None and await caller_gone():
            # The router gave up on this call (this worker was frozen or too slow) and went elsewhere:
            # nobody would claim or cancel these blocks before the reservation expires.
            log.warning("request %s: the router went away before its reservation was made; freeing %d blocks",
                        req.request_id, len(res.block_ids))
            self.intake.cancel(req.request_id)
            raise Rejected(503, "the caller went away before the reservation was made")
        return ReserveResponse(transfer_id=res.transfer_id, kv_address=self.kv_address, block_ids=res.block_ids,
                               layout_hash=self.engine.kv_layout.layout_hash())

    def _cancel_reservation(self, request_id: str) -> None:
        if self.loop is not None:
            self.loop.call(lambda e: e.cancel_reservation(request_id))

    async def cancel(self, request_id: str) -> bool:
        self._require("decode")
        assert self.intake is not None
        return self.intake.cancel(request_id)

    async def abort(self, request_id: str) -> None:
        loop = self._require("both", "decode", "prefill")
        if self.intake is not None:
            self.intake.cancel(request_id)
        await loop.acall(lambda e: e.abort(request_id))

    async def decode(self, req: DecodeRequest) -> AsyncIterator[bytes]:
        """Continue after the first token; reservations made before a drain are still honoured."""
        loop = self._require("decode")
        assert self.intake is not None
        deadline = time.monotonic() + req.deadline_s
        res = self.intake.claim(req.request_id)
        error: str | None = None if res is not None else "no reservation for this request here"
        given_up: str | None = None  # failure reason when this side abandons a transfer still pending
        unbound = False  # the KV arrived but is not the KV of this request's prompt
        if res is not None and req.kv_ready:
            try:
                outcome = await asyncio.wait_for(asyncio.shield(res.outcome),
                                                 min(self.cfg.kv_wait_timeout, deadline - time.monotonic()))
                error = None if outcome is None else str(outcome)
            except TimeoutError:
                error, given_up = "the KV did not arrive in time", TIMEOUT
            if error is None:
                try:
                    error = self._unbound_kv(req.prompt_token_ids, res.prompt_digest)
                except ValueError as exc:
                    self.intake.drop(res)
                    raise Rejected(400, str(exc)) from None
                unbound = error is not None
        elif res is not None:
            error, given_up = "the prefill worker could not ship the KV", ABANDONED
        if error is None and res is not None:
            try:
                params = self._params(req.sampling, prompt_logprobs=None)  # the prefill worker computed the prompt
                await self._compile_grammar(loop, params)
            except ValueError as exc:
                self.intake.drop(res)
                raise Rejected(400, str(exc)) from None
            try:
                sub = loop.subscribe(req.request_id)
            except ValueError as exc:
                self.intake.drop(res)
                raise Rejected(409, str(exc)) from None
            try:
                await loop.acall(lambda e: e.add_prefilled_request(req.request_id, req.prompt_token_ids,
                                                                   req.first_token_id, params))
            except Exception as exc:
                loop.unsubscribe(req.request_id)
                self.intake.drop(res)
                raise self._refusal(loop, req.request_id, exc) from None
            return self._pump(loop, req.request_id, sub, deadline, StreamChunk(num_prompt_tokens=len(req.prompt_token_ids)))
        # Fallback: prefill prompt + first token here. Slower, same tokens under greedy sampling.
        log.warning("request %s: %s; prefilling locally", req.request_id, error)
        if res is not None:
            if given_up is not None and self._receiver is not None:
                # Counted in tandem_kv_transfer_failures_total unless the receiver already
                # reported this transfer's outcome (then it was counted there).
                self._receiver.cancel(res.transfer_id, reason=given_up)
            if unbound and self.transfer_telemetry is not None:
                self.transfer_telemetry.failed(self.transport, PROMPT_MISMATCH)
            self.intake.drop(res)  # the blocks go back to the pool unregistered: never in the prefix cache
        self.telemetry.inc(m.FALLBACK_PREFILLS)
        sub = await self._add(loop, req.request_id, [*req.prompt_token_ids, req.first_token_id], req.sampling,
                              sampled_before=1, max_tokens=req.sampling.max_tokens - 1, prompt_logprobs=None)
        return self._pump(loop, req.request_id, sub, deadline,
                          StreamChunk(num_prompt_tokens=len(req.prompt_token_ids), fallback=True))

    @staticmethod
    def _unbound_kv(prompt: list[int], declared: bytes | None) -> str | None:
        """Why KV that arrived must not be used (nor cached) for `prompt`, or None when it may.

        The prefill worker declared in the transfer's BEGIN the digest of the tokens it computed this KV
        from; the caller of /decode names the prompt. Different digests mean the blocks hold another
        prompt's KV: decoding on them gives a wrong answer, and registering them in the prefix cache
        under this prompt's tokens would hand them to every later request that shares the prefix."""
        if declared is None:
            return ("the KV that arrived carries no prompt digest (its sender did not say which prompt it was "
                    "computed from): it is neither used nor cached")
        mine = prompt_digest(prompt)  # ValueError: ids no prompt has (the caller answers 400)
        if mine == declared:
            return None
        return (f"the KV that arrived was computed for another prompt: the prefill worker's prompt digest "
                f"{declared.hex()[:16]}... is not the digest {mine.hex()[:16]}... of this request's "
                f"{len(prompt)} prompt tokens; it is neither used nor cached")

    async def prefill(self, req: PrefillRequest,
                      caller_gone: Callable[[], Awaitable[bool]] | None = None) -> PrefillResponse:
        """Prefill, ship the KV to req.target, return the first token. `caller_gone` (the HTTP request's
        is_disconnected) is asked while the engine works: a router that stopped waiting (its client
        left) gets the prompt dropped instead of computed for nobody."""
        loop = self._admit("prefill")
        if caller_gone is not None and await caller_gone():  # it waited in a queue (or a frozen process)
            raise Rejected(499, "the caller went away before the prefill started")
        rid, deadline = req.request_id, time.monotonic() + req.deadline_s
        ship_error: str | None = None
        shipping = False
        if req.target is not None:
            if self.cfg.fault == "drop-kv":
                ship_error = "fault injection: this worker drops KV transfers"
            elif req.target.layout_hash != self.engine.kv_layout.layout_hash():
                ship_error = (f"layout hash mismatch: decode has {req.target.layout_hash}, this worker "
                              f"{self.engine.kv_layout.layout_hash()}")
            else:
                assert self.shipper is not None
                try:
                    # Bound to what the engine prefills: the digest of the very token ids it is given below.
                    digest = prompt_digest(req.prompt_token_ids)
                    await asyncio.to_thread(self.shipper.begin, rid, req.target.kv_address, req.target.transfer_id,
                                            req.target.block_ids, len(req.prompt_token_ids), req.deadline_s,
                                            digest)
                    shipping = True
                except Exception as exc:
                    ship_error = f"cannot start the KV transfer: {exc}"
        try:
            sub = await self._add(loop, rid, req.prompt_token_ids, req.sampling)
        except Rejected:
            if shipping:
                self.shipper.abort(rid, "the prefill request was rejected")  # type: ignore[union-attr]
            raise
        finished = False
        look_in = FIRST_CALLER_CHECK_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Rejected(504, "the prefill deadline passed")
                try:
                    out = await asyncio.wait_for(sub.queue.get(), min(left, look_in))
                except TimeoutError:
                    if caller_gone is not None and await caller_gone():
                        raise Rejected(499, "the caller went away before the prefill finished") from None
                    look_in = CALLER_CHECK_S
                    continue
                if isinstance(out, EngineFailure):
                    raise Rejected(500, out.message)
                if out.finish_reason == "error":  # this request's own failure: it would fail on any worker
                    self._finished(out, time.monotonic() - sub.arrival, self._request_telemetry(rid))
                    raise Rejected(422, out.error or "this request failed")
                if out.finished:
                    finished = True
                    break
            telemetry = self._request_telemetry(rid)
            telemetry.observe(m.TTFT, time.monotonic() - sub.arrival)
            telemetry.inc(m.GENERATION_TOKENS, len(out.new_token_ids))
            self._finished(out, time.monotonic() - sub.arrival, telemetry)
            if shipping:
                try:
                    await asyncio.to_thread(self.shipper.finish, rid, list(out.kv_block_ids or []))  # type: ignore[union-attr]
                except Exception as exc:
                    ship_error = f"KV transfer failed: {exc}"
            if not out.new_token_ids:
                raise Rejected(500, "the engine finished the prefill without a token")
            return PrefillResponse(first_token_id=out.new_token_ids[0],
                                   logprob=out.logprobs[0] if out.logprobs else None,
                                   top_logprobs=out.top_logprobs[0] if out.top_logprobs else None,
                                   prompt_logprobs=out.prompt_logprobs, prompt_top_logprobs=out.prompt_top_logprobs,
                                   num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                                   kv_sent=shipping and ship_error is None, error=ship_error)
        except TimeoutError:
            raise Rejected(504, "the prefill deadline passed") from None
        finally:
            loop.unsubscribe(rid)
            if shipping and not finished:
                self.shipper.abort(rid, "the prefill did not complete")  # type: ignore[union-attr]
            if finished:
                loop.call(lambda e: e.release_kv(rid))
            else:
                loop.call(lambda e: e.abort(rid))

    # --- drain ---
    def busy(self) -> int:
        """In-flight work: subscribed requests plus reservations not yet claimed."""
        if self.loop is None:
            return 0
        return self.loop.num_subscribers() + (len(self.intake.reservations) if self.intake else 0)

    async def drain(self) -> None:
        """Stop taking work, let in-flight requests finish (bounded), then free what is left."""
        self.draining = True
        self.telemetry.set(m.WORKER_READY, 0)
        log.info("draining: %d requests in flight", self.busy())
        limit = time.monotonic() + self.cfg.drain_timeout
        while self.busy() and time.monotonic() < limit:
            await asyncio.sleep(0.05)
        if self.busy():
            log.warning("drain timeout: aborting %d requests", self.busy())
        if self.intake is not None:
            for rid in list(self.intake.reservations):
                self.intake.cancel(rid)
        log.info("drained")


class _NoTelemetry:
    """Request metrics that go nowhere (the canary's probes)."""

    def observe(self, d: m.MetricDef, value: float, **extra: str) -> None:
        pass

    def inc(self, d: m.MetricDef, amount: float = 1.0, **extra: str) -> None:
        pass


_NO_TELEMETRY = _NoTelemetry()
