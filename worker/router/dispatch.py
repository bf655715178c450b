"""The request path behind the OpenAI API: placement, prefill -> KV -> decode, fallback, migration.

`Dispatcher.generate` yields `TokenEvent`s (token ids as the workers produce them); the API layer
turns them into text. Guarantees, in order of importance:
- never a wrong token: a failed KV transfer makes decode prefill locally, a lost decode worker is
  replaced by replaying prompt + tokens so far on another one (token-level migration; identical
  under greedy sampling);
- never a hang: every hop has a timeout and the whole request a deadline;
- a prefill worker that is draining or gone is skipped before anything reached the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from tandem.worker import metrics as m
from tandem.worker.router import errors
from tandem.worker.router.placement import PrefixAffinity, pick_decode, pick_prefill, prefix_key
from tandem.worker.router.telemetry import RouterTelemetry
from tandem.worker.router.workers import WorkerRegistry, WorkerState
from tandem.worker.server.protocol import (
    DecodeRequest,
    GenerateRequest,
    KVTarget,
    PrefillRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    Sampling,
    StreamChunk,
)

log = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=BaseModel)

DECODE_ROLES = ("decode", "both")
MAX_MIGRATIONS = 3
RESERVE_TIMEOUT_S = 5.0
WAIT_FOR_WORKER_S = 10.0


@dataclass
class TokenEvent:
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last event


class WorkerLost(Exception):
    """A worker failed mid-request in a way another worker can make up for."""


class WorkerRejected(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, telemetry: RouterTelemetry, eos_token_ids: set[int],
                 block_size: int = 16, stall_timeout: float = 60.0) -> None:
        self.registry = registry
        self.telemetry = telemetry
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.stall_timeout = stall_timeout
        self.affinity = PrefixAffinity()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(stall_timeout, connect=3.0), limits=limits)

    async def close(self) -> None:
        await self.client.aclose()

    # --- public ---
    async def generate(self, request_id: str, prompt: list[int], sampling: Sampling,
                       deadline: float) -> AsyncIterator[TokenEvent]:
        generated: list[int] = []
        lost: set[str] = set()
        decode = await self._wait_for(lambda: self._pick_decode(lost), deadline)
        if decode.role == "decode" and self.registry.usable(("prefill",)):
            first = await self._disaggregated_start(request_id, prompt, sampling, decode, deadline)
            if first is None:  # no prefill worker made it: the decode worker does it all
                stream = self._generate_stream(decode, request_id, prompt, sampling, deadline)
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
                    body = DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                         first_token_id=generated[0], sampling=sampling, kv_ready=kv_ready,
                                         deadline_s=_left(deadline))
                    stream = self._stream(decode, "/decode", body, deadline)
                    released = True  # nothing awaits before the stream's POST claims the reservation
                finally:
                    if not released:
                        await self._cancel(decode, request_id)
        else:
            stream = self._generate_stream(decode, request_id, prompt, sampling, deadline)

        migrations = 0
        while True:
            try:
                async for event in stream:
                    generated += event.token_ids
                    yield event
                    if event.finish_reason is not None:
                        return
                raise WorkerLost(f"{decode.url} ended the stream without finishing the request")
            except WorkerLost as exc:
                if time.monotonic() >= deadline:  # the worker gave up because the deadline passed: not its fault
                    raise errors.timeout("the request's deadline passed before it finished") from None
                migrations += 1
                lost.add(decode.url)
                self.registry.mark_down(decode.url, str(exc))
                if migrations > MAX_MIGRATIONS:
                    raise errors.internal(f"request failed on {migrations} workers; last: {exc}") from None
                decode = await self._wait_for(lambda: self._pick_decode(lost), deadline)
                log.warning("request %s: %s; migrating to %s after %d tokens", request_id, exc, decode.url,
                            len(generated))
                self.telemetry.inc(m.MIGRATIONS)
                left = sampling.max_tokens - len(generated)
                if left <= 0:  # the worker died after the last token but before saying so
                    yield TokenEvent([], None, "length")
                    return
                rest = sampling.model_copy(update={"max_tokens": left})
                stream = self._generate_stream(decode, f"{request_id}-m{migrations}", prompt + generated, rest,
                                               deadline, sampled_before=len(generated))

    # --- placement ---
    def _pick_decode(self, lost: set[str]) -> WorkerState | None:
        workers = self.registry.usable(DECODE_ROLES)
        # Prefer pure decode workers when a prefill pool exists; `both` workers otherwise.
        pure = [w for w in workers if w.role == "decode"]
        pool = pure if pure and self.registry.usable(("prefill",)) else workers
        cand = pick_decode([w.candidate() for w in pool], exclude=lost)
        return self.registry.workers.get(cand.url) if cand else None

    async def _wait_for(self, pick: object, deadline: float) -> WorkerState:
        assert callable(pick)
        limit = min(deadline, time.monotonic() + WAIT_FOR_WORKER_S)
        while True:
            found = pick()
            if found is not None:
                return found  # type: ignore[no-any-return]
            if time.monotonic() >= deadline:
                raise errors.timeout("the request's deadline passed while waiting for a worker")
            if time.monotonic() >= limit:
                raise errors.unavailable("no ready worker can take this request now; retry later")
            await self.registry.wait_for_change(min(1.0, limit - time.monotonic()))

    # --- disaggregated start: reserve on decode, prefill ships KV, first token back ---
    async def _disaggregated_start(self, request_id: str, prompt: list[int], sampling: Sampling,
                                   decode: WorkerState, deadline: float
                                   ) -> tuple[TokenEvent, WorkerState, bool] | None:
        reservation, decode = await self._reserve(request_id, len(prompt), decode, deadline)
        target = None
        layout_hash = decode.info.layout_hash if decode.info else ""
        if reservation is not None:
            target = KVTarget(kv_address=reservation.kv_address, transfer_id=reservation.transfer_id,
                              block_ids=reservation.block_ids, layout_hash=reservation.layout_hash)
        key = prefix_key(prompt, self.block_size)
        tried: set[str] = set()
        while True:
            prefills = [w for w in self.registry.usable(("prefill",)) if w.url not in tried]
            cand = pick_prefill([w.candidate() for w in prefills], layout_hash, self.affinity.get(key))
            if cand is None:
                break
            worker = self.registry.workers[cand.url]
            tried.add(worker.url)
            body = PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                  target=target, deadline_s=_left(deadline))
            worker.prefill_started(len(prompt))
            worker.active += 1
            try:
                resp = await self._post(worker, "/prefill", body, PrefillResponse, deadline)
            except WorkerRejected as exc:
                if exc.status < 500 or time.monotonic() >= deadline:
                    await self._cancel(decode, request_id)
                    if exc.status < 500:
                        raise errors.bad_request(str(exc)) from None
                    raise errors.timeout("the request's deadline passed during prefill") from None
                continue  # draining or overloaded: try the next prefill worker
            except WorkerLost as exc:
                self.registry.mark_down(worker.url, str(exc))
                continue
            finally:
                worker.active -= 1
                worker.prefill_ended(len(prompt))
            self.affinity.put(key, worker.url)
            if resp.error:
                log.warning("request %s: KV transfer from %s failed (%s); decode prefills locally",
                            request_id, worker.url, resp.error)
            event = TokenEvent([resp.first_token_id], [resp.logprob] if resp.logprob is not None else None,
                               self._finish_after_first(resp.first_token_id, sampling))
            if event.finish_reason is not None:
                await self._cancel(decode, request_id)
            return event, decode, bool(resp.kv_sent and reservation is not None)
        if reservation is not None:
            await self._cancel(decode, request_id)
        return None

    def _finish_after_first(self, token: int, sampling: Sampling) -> str | None:
        if (not sampling.ignore_eos and token in self.eos_token_ids) or token in sampling.stop_token_ids:
            return "stop"
        return "length" if sampling.max_tokens <= 1 else None

    async def _reserve(self, request_id: str, num_tokens: int, decode: WorkerState,
                       deadline: float) -> tuple[ReserveResponse | None, WorkerState]:
        """Reserve KV blocks on the chosen decode worker, or the next one with room."""
        tried: set[str] = set()
        worker: WorkerState | None = decode
        while worker is not None:
            tried.add(worker.url)
            body = ReserveRequest(request_id=request_id, num_tokens=num_tokens, deadline_s=_left(deadline))
            try:
                resp = await self._post(worker, "/kv/reserve", body, ReserveResponse,
                                        min(deadline, time.monotonic() + RESERVE_TIMEOUT_S))
                worker.pending_blocks += len(resp.block_ids)
                return resp, worker
            except WorkerRejected:
                pass
            except WorkerLost as exc:
                self.registry.mark_down(worker.url, str(exc))
            nxt = self._pick_decode(tried)
            worker = nxt if nxt is not None and nxt.role == "decode" else None
        return None, decode

    async def _cancel(self, worker: WorkerState, request_id: str) -> None:
        try:
            await self.client.post(f"{worker.url}/kv/cancel", json={"request_id": request_id}, timeout=3.0)
        except httpx.HTTPError as exc:
            log.info("cancel of %s on %s failed (the reservation expires on its own): %s",
                     request_id, worker.url, exc)

    # --- HTTP to workers ---
    async def _post(self, worker: WorkerState, path: str, body: BaseModel, out: type[ModelT],
                    deadline: float) -> ModelT:
        try:
            async with asyncio.timeout(_left(deadline)):
                resp = await self.client.post(f"{worker.url}{path}", content=body.model_dump_json(),
                                              headers={"content-type": "application/json"})
        except TimeoutError:
            raise errors.timeout(f"deadline passed waiting for {worker.url}{path}") from None
        except httpx.HTTPError as exc:
            raise WorkerLost(f"{worker.url}{path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise WorkerRejected(resp.status_code, _detail(resp))
        try:
            return out.model_validate(resp.json())
        except (ValidationError, ValueError) as exc:
            raise WorkerLost(f"{worker.url}{path} answered something unreadable: {exc}") from None

    def _generate_stream(self, worker: WorkerState, request_id: str, prompt: list[int], sampling: Sampling,
                         deadline: float, sampled_before: int = 0) -> AsyncIterator[TokenEvent]:
        body = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                               deadline_s=_left(deadline), sampled_before=sampled_before)
        return self._stream(worker, "/generate", body, deadline)

    async def _stream(self, worker: WorkerState, path: str, body: BaseModel,
                      deadline: float) -> AsyncIterator[TokenEvent]:
        # No asyncio.timeout around a generator that yields: the deadline is checked per chunk and
        # bounds every read, so a silent worker costs at most min(stall_timeout, time left).
        worker.active += 1
        timeout = httpx.Timeout(min(self.stall_timeout, _left(deadline)), connect=3.0)
        try:
            async with self.client.stream("POST", f"{worker.url}{path}", content=body.model_dump_json(),
                                          headers={"content-type": "application/json"}, timeout=timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    if resp.status_code < 500:
                        raise errors.bad_request(_detail(resp))
                    raise WorkerLost(f"{worker.url}{path}: HTTP {resp.status_code}: {_detail(resp)}")
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    chunk = StreamChunk.model_validate(json.loads(line))
                    if chunk.error:
                        raise WorkerLost(f"{worker.url}: {chunk.error}")
                    reason = chunk.finish_reason if chunk.finished else None
                    if reason == "abort":
                        raise WorkerLost(f"{worker.url} aborted the request")
                    if chunk.token_ids or reason:
                        yield TokenEvent(chunk.token_ids, chunk.logprobs, reason)
                    if reason is None and time.monotonic() >= deadline:
                        raise errors.timeout("the request's deadline passed before it finished")
        except (httpx.HTTPError, ValidationError, json.JSONDecodeError) as exc:
            if time.monotonic() >= deadline:
                raise errors.timeout("the request's deadline passed before it finished") from None
            raise WorkerLost(f"{worker.url}{path}: {type(exc).__name__}: {exc}") from None
        finally:
            worker.active -= 1


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


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
