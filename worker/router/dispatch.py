"""The request path behind the OpenAI API: placement, prefill -> KV -> decode, fallback, migration.

`Dispatcher.generate` yields `TokenEvent`s (token ids as the workers produce them); the API layer
turns them into text. Guarantees, in order of importance:
- never a wrong token: a failed KV transfer makes decode prefill locally, a lost decode worker is
  replaced by replaying prompt + tokens so far on another one (token-level migration; identical
  under greedy sampling);
- never a hang: every hop has a timeout and the whole request a deadline;
- a prefill worker that is draining or gone is skipped before anything reached the client;
- never a field dropped: a request goes only to workers whose control API honours every sampling field
  it sets (protocol.SAMPLING_FIELDS_SINCE), so a worker older than a feature, mid-upgrade, never gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from tandem.worker import metrics as m
from tandem.worker.kv.prefix_hash import block_hashes
from tandem.worker.router import errors
from tandem.worker.router.placement import DEFAULT_BALANCE, DEFAULT_PLACEMENT, PrefillPlacer, pick_decode
from tandem.worker.router.telemetry import RouterTelemetry
from tandem.worker.router.workers import WorkerRegistry, WorkerState
from tandem.worker.server.protocol import (
    MAX_DEADLINE_S,
    MAX_RESERVE_DEADLINE_S,
    STREAM_HEARTBEAT_S,
    DecodeRequest,
    GenerateRequest,
    KVTarget,
    PrefillRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    Sampling,
    StreamChunk,
    required_api_version,
)

log = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=BaseModel)

DECODE_ROLES = ("decode", "both")
PREFILL_ROLES = ("prefill", "both")
MAX_MIGRATIONS = 3
RESERVE_TIMEOUT_S = 5.0
# A decode worker the registry has not reached for this long (its polls time out after 2 s) is given
# up on while a prefill ships KV to it: frozen or hung, it would hold the request for the prefill
# worker's whole KV silence timeout. Two failed polls, so one slow answer under load is not enough.
DECODE_SILENT_S = 4.0
KEEPALIVE_S = 10.0  # idle connections to workers are dropped after this; workers keep theirs 30 s (run.py)
CANCEL_ATTEMPTS = 3  # a reservation's cancel is sent again when its connection fails (not on a timeout)
RESERVATION_GRACE_S = 5.0  # a decode worker frees an unclaimed reservation this long after its deadline
WAIT_FOR_WORKER_S = 10.0
# A worker's token stream that stays silent this long (no token and no heartbeat) is lost: the
# process is frozen or cut off, and the stream moves to another worker. Workers older than control
# API 2 send no heartbeats; for them only the stall timeout counts.
STREAM_SILENT_S = 5 * STREAM_HEARTBEAT_S


@dataclass
class TokenEvent:
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last event
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when the sampling asks for them
    # With the first token, when sampling.prompt_logprobs: prompt tokens 1..n-1's logprobs and their most
    # likely (token id, logprob) pairs (protocol.PrefillResponse); the first token has none.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int | None = None  # the prompt tokens the worker's prefix cache served (usage)


class PromptShare:
    """The n choices of one prompt (n > 1) compute, ship and hold its KV once. The first choice (the leader)
    goes the usual way; the others wait until it decodes on a worker, then run there as local prefills:
    that worker's prefix cache (which registers the blocks a transfer delivered) serves the prompt's full
    blocks, so each of them computes only the prompt's last partial block. Nothing is shared when the
    leader ends before it decodes anywhere, the worker is gone by then, or the worker runs without a
    prefix cache (--no-prefix-caching)."""

    def __init__(self) -> None:
        self._worker: asyncio.Future[WorkerState | None] = asyncio.get_running_loop().create_future()

    def offer(self, worker: WorkerState | None) -> None:
        if not self._worker.done():
            self._worker.set_result(worker)

    async def wait(self, deadline: float) -> WorkerState | None:
        """The leader's worker, or None (the leader ended first, or the deadline came)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._worker), timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None


class WorkerLost(Exception):
    """A worker failed mid-request in a way another worker can make up for."""


class WorkerRejected(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, telemetry: RouterTelemetry, eos_token_ids: set[int],
                 block_size: int = 16, stall_timeout: float = 60.0, headers: Mapping[str, str] | None = None,
                 placement: str = DEFAULT_PLACEMENT, balance: float = DEFAULT_BALANCE) -> None:
        self.registry = registry
        self.telemetry = telemetry
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.stall_timeout = stall_timeout
        self.placer = PrefillPlacer(placement, balance)
        self._background: set[asyncio.Task[None]] = set()  # cancels in flight (_send_cancel)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_S)
        # `headers`: the worker control token, on every call (reserve, prefill, decode, generate, cancel, abort).
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(stall_timeout, connect=3.0), limits=limits,
                                        headers=dict(headers or {}))

    async def close(self) -> None:
        await self.client.aclose()

    # --- public ---
    async def generate(self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float,
                       share: PromptShare | None = None, leader: bool = True) -> AsyncIterator[TokenEvent]:
        """The request's token events, from whichever workers serve it. With `share` (n > 1), the leader
        offers the worker that holds its prompt's KV once it decodes there, and each other choice waits
        for that worker and runs on it (see PromptShare)."""
        if share is None:
            async with contextlib.aclosing(self._generate(request_id, prompt, sampling, deadline)) as events:
                async for event in events:
                    yield event
            return
        pinned = None if leader else await share.wait(deadline)
        need = required_api_version(sampling)[0]
        if pinned is not None and (pinned.role is None
                                   or pinned.url not in {w.url for w in self._usable((pinned.role,), need)}):
            pinned = None  # gone meanwhile: the choice takes the usual path
        try:
            async with contextlib.aclosing(self._generate(
                    request_id, prompt, sampling, deadline, pinned=pinned,
                    on_placed=share.offer if leader else None)) as events:
                async for event in events:
                    yield event
        finally:
            if leader:
                share.offer(None)  # ended before it decoded anywhere (or after: then a no-op)

    async def _generate(self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float,
                        pinned: WorkerState | None = None,
                        on_placed: Callable[[WorkerState], None] | None = None) -> AsyncGenerator[TokenEvent, None]:
        """`pinned`: run on this worker (a local prefill there), not through placement; `on_placed`: called
        with the worker that produces the tokens once its stream has given the first event."""
        generated: list[int] = []
        lost: dict[str, float] = {}  # decode workers this request lost, and when (see _pick_decode)
        restarts = again = 0
        first: tuple[TokenEvent, WorkerState, bool] | None = None
        rid = request_id  # a retry on another decode worker gets its own id (see below)
        need = required_api_version(sampling)  # every worker of this request honours all it asks for
        while pinned is None:
            decode = await self._wait_for(lambda: self._pick_decode(lost, need[0]), deadline, need)
            if decode.role != "decode" or not self._usable(("prefill",), need[0]):
                break
            try:
                first = await self._disaggregated_start(rid, prompt, sampling, decode, deadline)
                break
            except WorkerLost as exc:
                # The decode worker stopped answering (frozen, overloaded) before the first token: start
                # over on another one. Nothing reached the client yet. The old id may still be in flight
                # on a prefill worker that was shipping to the lost one, so the retry gets a new id.
                again += decode.url in lost  # a worker lost before and tried again (see _pick_decode)
                if again > MAX_MIGRATIONS:
                    log.error("request %s: its decode workers failed %d times; last: %s", request_id, again, exc)
                    raise errors.unavailable("no decode worker could take the request; retry later") from None
                lost[decode.url] = time.monotonic()
                self.registry.mark_down(decode.url, str(exc))
                restarts += 1
                rid = f"{request_id}-r{restarts}"
                log.warning("request %s: %s; starting over on another decode worker", request_id, exc)
        if pinned is not None:
            decode = pinned
        if first is None:  # pinned, no prefill pool, or no prefill worker made it: the decode worker does it all
            stream = self._generate_stream(decode, rid, prompt, sampling, deadline)
        else:
            event, decode, kv_ready = first
            generated += event.token_ids
            # Until /decode claims it, the decode worker's reservation is ours to release: also when
            # the first token ends the request in a way only the caller sees (a stop string in its
            # text) or the caller goes away, which both close this generator at the yield below.
            released = event.finish_reason is not None  # _disaggregated_start cancelled it already
            try:
                yield event
                if event.finish_reason is not None:
                    return
                body = DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                     first_token_id=generated[0], sampling=_after_prompt(sampling),
                                     kv_ready=kv_ready, deadline_s=_left(deadline))
                stream = self._stream(decode, "/decode", body, deadline)
                released = True  # nothing awaits before the stream's POST claims the reservation
            finally:
                if not released:
                    await self._cancel(decode, rid)

        migrations = 0
        while True:
            try:
                async with contextlib.aclosing(stream):  # closed now, not when garbage-collected
                    async for event in stream:
                        generated += event.token_ids
                        if on_placed is not None:  # the request runs on `decode` now, its prompt's KV there
                            on_placed(decode)
                            on_placed = None
                        yield event
                        if event.finish_reason is not None:
                            return
                raise WorkerLost(f"{decode.url} ended the stream without finishing the request")
            except WorkerLost as exc:
                if time.monotonic() >= deadline:  # the worker gave up because the deadline passed: not its fault
                    raise errors.timeout("the request's deadline passed before it finished") from None
                migrations += 1
                lost[decode.url] = time.monotonic()
                self.registry.mark_down(decode.url, str(exc))
                if migrations > MAX_MIGRATIONS:
                    log.error("request %s failed on %d workers; last: %s", request_id, migrations, exc)
                    raise errors.internal(f"the request failed on {migrations} workers in a row; retry later") from None
                decode = await self._wait_for(lambda: self._pick_decode(lost, need[0]), deadline, need)
                log.warning("request %s: %s; migrating to %s after %d tokens", request_id, exc, decode.url,
                            len(generated))
                self.telemetry.inc(m.MIGRATIONS)
                left = sampling.max_tokens - len(generated)
                if left <= 0:  # the worker died after the last token but before saying so
                    yield TokenEvent([], None, "length")
                    return
                # The prompt's logprobs came with the first token: a continuation computes none.
                rest = (_after_prompt(sampling) if generated else sampling).model_copy(update={"max_tokens": left})
                stream = self._generate_stream(decode, f"{request_id}-m{migrations}", prompt + generated, rest,
                                               deadline, sampled_before=len(generated))

    async def compare_paths(self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float
                            ) -> tuple[str, str, list[int], list[int]] | None:
        """The canary's probe (canary.py): (decode url, prefill url, tokens of a local prefill on that decode
        worker, tokens when a prefill worker shipped it the KV). None when there was nothing to compare: no
        usable decode worker with a prefill worker of its layout, or the KV did not arrive."""
        decode = self._pick_decode(set())
        if decode is None or decode.role != "decode" or decode.info is None:
            return None
        layout = decode.info.layout_hash
        if not any(w.info is not None and w.info.layout_hash == layout for w in self.registry.usable(("prefill",))):
            return None
        local = await self._collect(self._generate_stream(decode, f"{request_id}-local", prompt, sampling, deadline))
        try:
            first = await self._disaggregated_start(f"{request_id}-pd", prompt, sampling, decode, deadline)
        except WorkerLost as exc:
            raise errors.unavailable(f"a worker was lost during the probe: {exc}") from None
        if first is None:
            return None
        event, used, kv_ready = first
        shipped = list(event.token_ids)
        if event.finish_reason is None:
            body = DecodeRequest(request_id=f"{request_id}-pd", prompt_token_ids=prompt, first_token_id=shipped[0],
                                 sampling=sampling, kv_ready=kv_ready, deadline_s=_left(deadline))
            shipped += await self._collect(self._stream(used, "/decode", body, deadline))
        prefill = self.placer.holder(block_hashes(prompt, self.block_size)) or "?"
        if not kv_ready or used.url != decode.url:  # decoded from its own prefill, or on another worker
            return None
        return decode.url, prefill, local, shipped

    async def _collect(self, stream: AsyncGenerator[TokenEvent, None]) -> list[int]:
        tokens: list[int] = []
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    tokens += event.token_ids
        except WorkerLost as exc:
            raise errors.unavailable(f"a worker was lost during the probe: {exc}") from None
        return tokens

    # --- placement ---
    def _usable(self, roles: tuple[str, ...], need: int) -> list[WorkerState]:
        """The registry's usable workers of `roles` whose control API is version `need` or later."""
        return [w for w in self.registry.usable(roles) if w.info is not None and w.info.api_version >= need]

    def _pick_decode(self, lost: Mapping[str, float] | set[str], need: int = 1) -> WorkerState | None:
        """The best usable decode worker this request has not lost. When it lost every usable one, one
        the registry has polled healthy since is tried again (`lost` maps a worker to when it was lost):
        in a rollout on busy nodes the only new decode worker can miss one reserve deadline, and the
        request should not wait for a worker that is not coming. Only workers of control API `need` or
        later count (required_api_version)."""
        workers = self._usable(DECODE_ROLES, need)
        # Prefer pure decode workers when a prefill pool exists; `both` workers otherwise.
        pure = [w for w in workers if w.role == "decode"]
        pool = pure if pure and self._usable(("prefill",), need) else workers
        cands = [w.candidate() for w in pool]
        cand = pick_decode(cands, exclude=set(lost))
        if cand is None and isinstance(lost, Mapping):
            back = {w.url for w in pool if w.url in lost and w.last_poll > lost[w.url]}
            cand = pick_decode(cands, exclude=set(lost) - back)
        return self.registry.workers.get(cand.url) if cand else None

    async def _wait_for(self, pick: object, deadline: float, need: tuple[int, list[str]] = (1, [])) -> WorkerState:
        assert callable(pick)
        limit = min(deadline, time.monotonic() + WAIT_FOR_WORKER_S)
        while True:
            found = pick()
            if found is not None:
                return found  # type: ignore[no-any-return]
            if time.monotonic() >= deadline:
                raise errors.timeout("the request's deadline passed while waiting for a worker")
            if time.monotonic() >= limit:
                raise errors.unavailable(self._none_new_enough(need) or "no ready worker can take this request "
                                         "now; retry later")
            self.registry.discover_soon()
            await self.registry.wait_for_change(min(1.0, limit - time.monotonic()))

    def _none_new_enough(self, need: tuple[int, list[str]]) -> str | None:
        """Why no worker could take a request when ready ones exist but are all older than it needs."""
        version, fields = need
        ready = self.registry.usable(DECODE_ROLES)
        if version <= 1 or not ready or self._usable(DECODE_ROLES, version):
            return None
        have = sorted({w.info.api_version for w in ready if w.info is not None})
        names = {"grammar": "grammar (response_format, guided_*, a required or named tool_choice)",
                 "prompt_logprobs": "prompt_logprobs (echo with logprobs)"}
        asked = ", ".join(names.get(f, f) for f in fields)
        return (f"this request's {asked} needs workers of control API version {version} or later, and the ready "
                f"workers are older (version {', '.join(map(str, have))}), which would ignore it: retry once "
                "they are upgraded")

    # --- disaggregated start: reserve on decode, prefill ships KV, first token back ---
    async def _disaggregated_start(self, request_id: str, prompt: list[int], sampling: Sampling,
                                   decode: WorkerState, deadline: float
                                   ) -> tuple[TokenEvent, WorkerState, bool] | None:
        need = required_api_version(sampling)[0]
        reservation, decode = await self._reserve(request_id, len(prompt), decode, deadline, need)
        target = None
        layout_hash = decode.info.layout_hash if decode.info else ""
        if reservation is not None:
            target = KVTarget(kv_address=reservation.kv_address, transfer_id=reservation.transfer_id,
                              block_ids=reservation.block_ids, layout_hash=reservation.layout_hash)
        # The engine's own chained block hashes: the prefix placement's keys (about 1 ms for 16k tokens).
        hashes = block_hashes(prompt, self.block_size)
        self.placer.retain(self.registry.workers)
        tried: set[str] = set()
        while True:
            prefills = [w for w in self._usable(("prefill",), need) if w.url not in tried]
            cand = self.placer.choose([w.candidate() for w in prefills], layout_hash, len(prompt), self.block_size,
                                      hashes)
            if cand is None:
                break
            placement = self.placer.placed(cand, len(prompt), hashes)  # now: requests right behind it see it
            worker = self.registry.workers[cand.url]
            tried.add(worker.url)
            body = PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                  target=target, deadline_s=_left(deadline))
            worker.prefill_started(len(prompt))
            worker.active += 1
            try:
                call = self._post(worker, "/prefill", body, PrefillResponse, deadline)
                resp = await (self._unless_lost(decode, call) if target is not None else call)
                self.placer.prefilled(placement)  # its cache holds the prompt: the blocks stay in the picture
                self.telemetry.prefilled(worker.url, len(prompt), placement.expected_hit_tokens(self.block_size))
            except (asyncio.CancelledError, errors.APIError):
                # The caller went away or the deadline passed: nobody will claim the reservation.
                if reservation is not None:
                    self._cancel_later(decode, request_id, deadline)
                raise
            except WorkerRejected as exc:
                if exc.status < 500 or time.monotonic() >= deadline:
                    await self._cancel(decode, request_id)
                    if exc.status < 500:  # the request's own fault or failure: the same on any worker
                        raise _refused(exc.status, str(exc)) from None
                    raise errors.timeout("the request's deadline passed during prefill") from None
                continue  # draining or overloaded: try the next prefill worker
            except WorkerLost as exc:
                if target is not None and not decode.usable:
                    # A prefill worker waits for the receiver's confirmation before it answers: a decode
                    # worker that stopped answering holds it up, and would hold up the next one too.
                    raise self._abandon(decode, request_id, deadline, f"stopped answering while {worker.url} "
                                        f"prefilled for it ({exc})") from None
                self.registry.mark_down(worker.url, str(exc))
                continue
            finally:
                self.placer.failed(placement)  # not prefilled: what it claimed goes (after prefilled: nothing)
                worker.active -= 1
                worker.prefill_ended(len(prompt))
            kv_ready = bool(resp.kv_sent and reservation is not None)
            if resp.error:
                log.warning("request %s: KV transfer from %s failed (%s); decode prefills locally",
                            request_id, worker.url, resp.error)
            event = TokenEvent([resp.first_token_id], [resp.logprob] if resp.logprob is not None else None,
                               self._finish_after_first(resp.first_token_id, sampling),
                               [resp.top_logprobs] if resp.top_logprobs is not None else None,
                               resp.prompt_logprobs, resp.prompt_top_logprobs, resp.num_cached_tokens)
            if reservation is not None and not kv_ready and not decode.usable and event.finish_reason is None:
                # Its /decode would only wait out the stall timeout: start over instead.
                raise self._abandon(decode, request_id, deadline, "stopped answering and the KV did not reach it")
            if event.finish_reason is not None:
                await self._cancel(decode, request_id)
            return event, decode, kv_ready
        if reservation is not None:
            if not decode.usable:
                raise self._abandon(decode, request_id, deadline, "stopped answering during prefill")
            await self._cancel(decode, request_id)
        return None

    async def _unless_lost(self, decode: WorkerState, call: Awaitable[ModelT]) -> ModelT:
        """Await a /prefill that ships KV to `decode`, giving it up (WorkerLost) once the registry's
        polls have not reached `decode` for DECODE_SILENT_S: the prefill worker answers only after
        the decode worker confirms the KV, and would wait its whole silence timeout for a frozen one."""
        task = asyncio.ensure_future(call)
        try:
            while not task.done():
                silent = time.monotonic() - decode.last_poll
                if not decode.up and silent >= DECODE_SILENT_S:
                    raise WorkerLost(f"{decode.url} has not answered for {silent:.1f}s ({decode.last_error})")
                change = asyncio.ensure_future(self.registry.changed.wait())  # set after every poll round
                try:
                    await asyncio.wait({task, change}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change.cancel()
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    def _finish_after_first(self, token: int, sampling: Sampling) -> str | None:
        if (not sampling.ignore_eos and token in self.eos_token_ids) or token in sampling.stop_token_ids:
            return "stop"
        return "length" if sampling.max_tokens <= 1 else None

    async def _reserve(self, request_id: str, num_tokens: int, decode: WorkerState,
                       deadline: float, need: int = 1) -> tuple[ReserveResponse | None, WorkerState]:
        """Reserve KV blocks on the chosen decode worker, or the next one with room. Without room
        anywhere: no reservation, and the first decode worker that answered. Raises WorkerLost when
        none answered (frozen, overloaded or gone: each is marked down)."""
        tried: set[str] = set()
        answered: WorkerState | None = None
        worker: WorkerState | None = decode
        while worker is not None:
            tried.add(worker.url)
            body = ReserveRequest(request_id=request_id, num_tokens=num_tokens,
                                  deadline_s=min(_left(deadline), MAX_RESERVE_DEADLINE_S))
            try:
                resp = await self._post(worker, "/kv/reserve", body, ReserveResponse, deadline,
                                        hop_timeout=RESERVE_TIMEOUT_S)
                worker.pending_blocks += len(resp.block_ids)
                return resp, worker
            except WorkerRejected:
                answered = answered or worker
            except asyncio.CancelledError:
                self._cancel_later(worker, request_id, deadline)  # it may have reserved before the call was cut
                raise
            except WorkerLost as exc:
                self.registry.mark_down(worker.url, str(exc))
            nxt = self._pick_decode(tried, need)
            worker = nxt if nxt is not None and nxt.role == "decode" else None
        if answered is None:
            raise WorkerLost(f"no decode worker answered /kv/reserve within {RESERVE_TIMEOUT_S:g}s")
        return None, answered

    async def _cancel(self, worker: WorkerState, request_id: str) -> None:
        """Cancel a reservation and wait for the answer. A caller cancelled meanwhile (its client left)
        does not cut the call: the reservation would hold its blocks until it expires."""
        await asyncio.shield(self._send_cancel(worker, request_id, timeout=3.0))

    def _send_cancel(self, worker: WorkerState, request_id: str, timeout: float) -> asyncio.Task[None]:
        task = asyncio.create_task(self._post_cancel(worker, request_id, timeout))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _post_cancel(self, worker: WorkerState, request_id: str, timeout: float) -> None:
        give_up_at = time.monotonic() + timeout
        for attempt in range(1, CANCEL_ATTEMPTS + 1):
            try:
                await self.client.post(f"{worker.url}/kv/cancel", json={"request_id": request_id},
                                       timeout=max(0.001, give_up_at - time.monotonic()))
                return
            except httpx.HTTPError as exc:
                # Not a timeout: most often a pooled connection the worker closed while idle (its
                # keep-alive ran out just before it froze, say). A new connection gets through.
                if isinstance(exc, httpx.TimeoutException) or attempt == CANCEL_ATTEMPTS:
                    log.info("cancel of %s on %s failed (the reservation expires on its own): %s: %s",
                             request_id, worker.url, type(exc).__name__, exc)
                    return
                log.info("cancel of %s on %s failed (%s: %s); sending it again", request_id, worker.url,
                         type(exc).__name__, exc)

    def _abandon(self, decode: WorkerState, request_id: str, deadline: float, why: str) -> WorkerLost:
        """Give up on a decode worker that stopped answering before the first token: its reservation is
        cancelled (later) and the returned error makes generate() start over on another one."""
        self._cancel_later(decode, request_id, deadline)
        return WorkerLost(f"{decode.url} {why}")

    def _cancel_later(self, worker: WorkerState, request_id: str, deadline: float) -> None:
        """Cancel a reservation on a worker that stopped answering, without waiting. The call stays
        open until the reservation would expire anyway: a frozen worker reads it when it resumes (it
        drops a call whose caller already went away)."""
        self._send_cancel(worker, request_id, _left(deadline) + RESERVATION_GRACE_S)

    # --- HTTP to workers ---
    async def _post(self, worker: WorkerState, path: str, body: BaseModel, out: type[ModelT],
                    deadline: float, hop_timeout: float | None = None) -> ModelT:
        """POST and parse the answer. A worker that does not answer within `hop_timeout` (or the
        stall timeout) is lost for this call; only the request's own deadline is a 504."""
        wait = _left(deadline) if hop_timeout is None else min(_left(deadline), hop_timeout)
        try:
            async with asyncio.timeout(wait):
                resp = await self.client.post(f"{worker.url}{path}", content=body.model_dump_json(),
                                              headers={"content-type": "application/json"})
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise errors.timeout(f"deadline passed waiting for {worker.url}{path}") from None
            raise WorkerLost(f"{worker.url}{path}: no answer within {wait:.3g}s") from None
        except httpx.HTTPError as exc:
            raise WorkerLost(f"{worker.url}{path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise WorkerRejected(resp.status_code, _detail(resp))
        try:
            return out.model_validate(resp.json())
        except (ValidationError, ValueError) as exc:
            raise WorkerLost(f"{worker.url}{path} answered something unreadable: {exc}") from None

    def _generate_stream(self, worker: WorkerState, request_id: str, prompt: list[int], sampling: Sampling,
                         deadline: float, sampled_before: int = 0) -> AsyncGenerator[TokenEvent, None]:
        body = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                               deadline_s=_left(deadline), sampled_before=sampled_before)
        return self._stream(worker, "/generate", body, deadline)

    async def _stream(self, worker: WorkerState, path: str, body: BaseModel,
                      deadline: float) -> AsyncGenerator[TokenEvent, None]:
        # No asyncio.timeout around a generator that yields: each read has its own. Until the answer
        # starts, a silent worker costs at most min(stall_timeout, time left) (a /decode answers once
        # its KV arrived); after that, STREAM_SILENT_S without a line (workers send heartbeats), and
        # the stall timeout without a token (a hung engine in a live process).
        worker.active += 1
        timeout = httpx.Timeout(min(self.stall_timeout, _left(deadline)), connect=3.0)
        heartbeats = worker.info is not None and worker.info.api_version >= 2
        silence = min(STREAM_SILENT_S, self.stall_timeout) if heartbeats else self.stall_timeout
        try:
            async with self.client.stream("POST", f"{worker.url}{path}", content=body.model_dump_json(),
                                          headers={"content-type": "application/json"}, timeout=timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    if resp.status_code < 500:
                        raise _refused(resp.status_code, _detail(resp))
                    raise WorkerLost(f"{worker.url}{path}: HTTP {resp.status_code}: {_detail(resp)}")
                lines = resp.aiter_lines()
                last_token = time.monotonic()
                while True:
                    try:
                        async with asyncio.timeout(min(silence, _left(deadline))):
                            line = await anext(lines)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        if time.monotonic() >= deadline:
                            raise errors.timeout("the request's deadline passed before it finished") from None
                        raise WorkerLost(f"{worker.url}{path}: silent for {silence:.3g}s mid-stream (frozen or "
                                         "cut off)") from None
                    if not line.strip():  # a heartbeat
                        now = time.monotonic()
                        if now >= deadline:
                            raise errors.timeout("the request's deadline passed before it finished")
                        if now - last_token >= self.stall_timeout:
                            raise WorkerLost(f"{worker.url}{path}: alive but no token for {self.stall_timeout:.3g}s")
                        continue
                    chunk = StreamChunk.model_validate(json.loads(line))
                    if chunk.error and chunk.request_error:  # this request's own: not the worker's fault
                        raise errors.request_failed(chunk.error)
                    if chunk.error:
                        raise WorkerLost(f"{worker.url}: {chunk.error}")
                    reason = chunk.finish_reason if chunk.finished else None
                    if reason == "abort":
                        raise WorkerLost(f"{worker.url} aborted the request")
                    if chunk.token_ids or reason:
                        last_token = time.monotonic()
                        yield TokenEvent(chunk.token_ids, chunk.logprobs, reason, chunk.top_logprobs,
                                         chunk.prompt_logprobs, chunk.prompt_top_logprobs, chunk.num_cached_tokens)
                    if reason is None and time.monotonic() >= deadline:
                        raise errors.timeout("the request's deadline passed before it finished")
        except (httpx.HTTPError, ValidationError, json.JSONDecodeError) as exc:
            if time.monotonic() >= deadline:
                raise errors.timeout("the request's deadline passed before it finished") from None
            raise WorkerLost(f"{worker.url}{path}: {type(exc).__name__}: {exc}") from None
        finally:
            worker.active -= 1


def _after_prompt(sampling: Sampling) -> Sampling:
    """The sampling of a request's continuation once its first token (and with it any prompt logprobs)
    is out: the decode worker's /decode and a migration's /generate compute no prompt logprobs."""
    if sampling.prompt_logprobs is None:
        return sampling
    return sampling.model_copy(update={"prompt_logprobs": None})


def _left(deadline: float) -> float:
    """Seconds left until `deadline`, as a worker takes them (it refuses more than MAX_DEADLINE_S)."""
    return min(MAX_DEADLINE_S, max(0.001, deadline - time.monotonic()))


def _refused(status: int, message: str) -> errors.APIError:
    """A worker's 4xx as the client's error: a request failure (422) or a bad request. Either is the
    request's own and would be the same on any worker: it is neither retried nor counted against one."""
    if status == 422:
        return errors.request_failed(message)
    return errors.bad_request(message)


def _detail(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict):
                return str(err.get("message"))
            if "detail" in data:
                return str(data["detail"])
    except ValueError:
        pass
    return resp.text[:300] or f"HTTP {resp.status_code}"
