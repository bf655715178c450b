"""The router's HTTP surface: OpenAI endpoints, health, readiness, metrics, worker status."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from tandem.worker import metrics as m
from tandem.worker.model.tokenizer import Tokenizer
from tandem.worker.router import canary, errors, tokenize_api
from tandem.worker.router.auth import ApiKeyMiddleware, ApiKeys
from tandem.worker.router.canary import DEFAULT_INTERVAL_S as DEFAULT_CANARY_INTERVAL_S
from tandem.worker.router.discovery import Discovery
from tandem.worker.router.dispatch import DECODE_ROLES, PREFILL_ROLES, Dispatcher, PromptShare, TokenEvent
from tandem.worker.router.errors import APIError
from tandem.worker.router.limits import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_QUEUE_TIMEOUT_S,
    Admission,
    Ticket,
)
from tandem.worker.router.openai_api import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    choice_sampling,
    grammar_of,
    parse_body,
    prompts_of,
    resolve_max_tokens,
    sampling_from,
    tools_of,
    top_logprobs_of,
)
from tandem.worker.router.placement import DEFAULT_BALANCE, DEFAULT_PLACEMENT
from tandem.worker.router.responses import Shape, full_response, merge_choices, sse, stream_chunk, usage_chunk
from tandem.worker.router.structured import ToolUse
from tandem.worker.router.telemetry import RouterTelemetry
from tandem.worker.router.tokens import Delta, TextAssembler, chars_per_token_bound, encode, fetch_tokenizer
from tandem.worker.router.tool_calls import chat_message, parse_output
from tandem.worker.router.workers import WorkerRegistry
from tandem.worker.server.control_auth import RefusalLog, presented_token, refusal
from tandem.worker.server.control_token import ControlTokens
from tandem.worker.server.protocol import Sampling

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # a 32 MiB JSON body is millions of tokens: more than any context
# A stream whose client reads nothing is closed this long after the request's deadline (the stream's own
# deadline error comes first for a client that still reads).
STALLED_CLIENT_GRACE_S = 5.0
CLIENT_CHECK_S = 0.25  # how often a request waiting for its first token looks whether its client is still there


@dataclass
class RouterConfig:
    model_name: str | None
    discovery: Discovery
    model_dir: Path | None = None  # where to read the tokenizer; otherwise fetched from a worker
    request_timeout: float = 600.0
    stall_timeout: float = 60.0
    poll_interval: float = 0.5
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    chat_template: str | None = None  # replaces the model's chat template (--chat-template)
    # The worker control token: sent on every call to a worker, and wanted by /workers (None: --insecure-control-api).
    control: ControlTokens | None = None
    api_keys: ApiKeys | None = None  # --api-key: every route but the probes and /metrics needs one
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS  # see limits.Admission
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S
    canary_interval: float = DEFAULT_CANARY_INTERVAL_S  # seconds between output canary probes; 0: off (canary.py)
    placement: str = DEFAULT_PLACEMENT  # prefill placement policy (placement.PLACEMENTS)
    placement_balance: float = DEFAULT_BALANCE  # prefix placement: bound on max/mean recent load


class RouterState:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.control_headers = cfg.control.headers if cfg.control is not None else {}
        self.registry = WorkerRegistry(cfg.discovery, cfg.model_name, cfg.poll_interval, headers=self.control_headers)
        self.telemetry = RouterTelemetry(cfg.model_name)
        self.dispatcher = Dispatcher(self.registry, self.telemetry, set(), stall_timeout=cfg.stall_timeout,
                                     headers=self.control_headers, placement=cfg.placement,
                                     balance=cfg.placement_balance)
        self.registry.on_kv_events = self.dispatcher.placer.observe_cache  # the workers' account of their caches
        self.control_refusals = RefusalLog("router call")
        self.admission = Admission(cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout)
        self._tokenizer: Tokenizer | None = None
        self.chars_per_token: float | None = None  # see tokens.chars_per_token_bound
        self._tok_lock = asyncio.Lock()
        self.canary = (canary.Canary(self.dispatcher, self.telemetry, self._encode_probe, cfg.canary_interval)
                       if cfg.canary_interval > 0 else None)

    async def _encode_probe(self, text: str) -> list[int]:
        tok = await self.tokenizer()
        self.learn_model()  # the probe's count needs the model's name on the metrics
        return await asyncio.to_thread(encode, tok, text)

    def learn_model(self) -> str | None:
        """The served model's name (given, or what a loaded worker serves); labels the metrics once known."""
        name = self.cfg.model_name
        if not name and (info := self.registry.any_info()) is not None:
            name = info.model
        if name:
            self.telemetry.bind(name)
        return name

    def model_name(self) -> str:
        name = self.learn_model()
        if name is None:
            raise errors.unavailable("no worker has loaded the model yet, so it is not known")
        return name

    def max_model_len(self) -> int:
        info = self.registry.any_info()
        if info is None:
            raise errors.unavailable("no worker has loaded the model yet")
        return info.max_model_len

    async def tokenizer(self) -> Tokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        async with self._tok_lock:
            if self._tokenizer is None:
                if self.cfg.model_dir is not None:
                    tok = await asyncio.to_thread(Tokenizer, self.cfg.model_dir)
                    eos = set(tok.eos_token_ids)
                else:
                    tok, eos = await self._fetch_tokenizer()
                if self.cfg.chat_template is not None:
                    tok.chat_template = self.cfg.chat_template
                info = self.registry.any_info()
                self.dispatcher.eos_token_ids = eos
                self.dispatcher.block_size = info.block_size if info else 16
                self.chars_per_token = await asyncio.to_thread(chars_per_token_bound, tok)
                if self.chars_per_token is None:
                    log.info("this tokenizer gives no characters-per-token bound: every prompt is counted exactly")
                self._tokenizer = tok
        return self._tokenizer

    async def _fetch_tokenizer(self) -> tuple[Tokenizer, set[int]]:
        async with httpx.AsyncClient(headers=self.control_headers) as client:
            for w in self.registry.workers.values():
                if w.up:
                    try:
                        return await fetch_tokenizer(client, w.url)
                    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
                        log.warning("could not load the tokenizer from %s: %s", w.url, exc)
        raise errors.unavailable("no worker could provide the tokenizer yet")

    def ready(self) -> bool:
        """Requests can be served: a usable worker to prefill and one to decode (a `both` worker is each)."""
        return bool(self.registry.usable(PREFILL_ROLES)) and bool(self.registry.usable(DECODE_ROLES))


def create_app(cfg: RouterConfig) -> FastAPI:
    state = RouterState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.registry.start()
        state.learn_model()
        async with canary.running(state.canary):
            yield
        await state.registry.close()
        await state.dispatcher.close()

    app = FastAPI(title="tandem router", lifespan=lifespan)
    app.state.router = state
    if cfg.api_keys is not None and cfg.api_keys.enabled:
        app.add_middleware(ApiKeyMiddleware, keys=cfg.api_keys,
                           refused=lambda reason: state.telemetry.inc(m.ROUTER_AUTH_FAILURES, reason=reason))

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown path (404), wrong method (405), ...: OpenAI's shape, not FastAPI's {"detail": ...}.
        if exc.status_code == 404:
            message = f"there is no {request.url.path} here (see /v1/models, /v1/completions, /v1/chat/completions)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(APIError(exc.status_code, message, type_=type_).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return errors.bad_request(f"invalid request: {exc.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The client gets a reference to the log line, never the exception's text: that may hold
        # worker addresses, paths or pieces of other requests.
        ref = uuid.uuid4().hex[:12]
        log.error("unexpected error %s on %s %s", ref, request.method, request.url.path, exc_info=exc)
        return errors.internal(f"internal error (reference {ref} in the router's log)").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "workers": _worker_counts(state)}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = state.ready()
        return JSONResponse({"ready": ok, "workers": _worker_counts(state)}, status_code=200 if ok else 503)

    @app.get("/workers", response_model=None)
    async def workers(request: Request) -> list[dict[str, Any]] | JSONResponse:
        # Worker URLs, KV addresses and layout hashes: for the model's own processes (the control token), not clients.
        if cfg.control is not None and (reason := cfg.control.check(presented_token(request.scope))) is not None:
            state.telemetry.inc(m.CONTROL_AUTH_FAILURES, reason=reason)
            state.control_refusals.refused(reason, request.method, request.url.path,
                                           request.client.host if request.client else "")
            return refusal(reason)
        return [{"url": w.url, "up": w.up, "usable": w.usable, "role": w.role, "error": w.last_error,
                 "info": w.info.model_dump() if w.info else None} for w in state.registry.workers.values()]

    @app.get("/metrics")
    async def metrics() -> Response:
        state.learn_model()
        state.telemetry.set(m.ROUTER_ACTIVE_REQUESTS, state.admission.running)
        state.telemetry.set(m.ROUTER_QUEUED_REQUESTS, state.admission.queued)
        state.telemetry.initialise_workers(w.url for w in state.registry.workers.values() if w.role == "prefill")
        return Response(state.telemetry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = state.model_name()
        entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "tandem"}
        info = state.registry.any_info()
        if info:
            entry["max_model_len"] = info.max_model_len
        return {"object": "list", "data": [entry]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = tokenize_api.parse(await _read_body(request, state.cfg.max_request_bytes, _deadline(state)),
                                 tokenize_api.TokenizeCompletion)
        _check_model(state, req.model)
        tok, max_model_len = await state.tokenizer(), state.max_model_len()
        return await asyncio.to_thread(tokenize_api.tokenize, req, tok, max_model_len)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = tokenize_api.parse(await _read_body(request, state.cfg.max_request_bytes, _deadline(state)),
                                 tokenize_api.Detokenize)
        _check_model(state, req.model)
        return tokenize_api.detokenize(req, await state.tokenizer())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return tokenize_api.version()

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _serve(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, chat=True)

    def openapi() -> dict[str, Any]:
        # The bodies are parsed by hand (parse_body: a 413 before reading, OpenAI's error shape), so FastAPI
        # knows no model for them: the schemas the routes' requestBody refers to are added here.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatRequest):
                body = _json_schema_bounds(model.model_json_schema(ref_template=REF_TEMPLATE))
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


REF_TEMPLATE = "#/components/schemas/{model}"


# pydantic writes a bound it could not place (a Field(ge=1) on `Int | None`, whose Int has a BeforeValidator)
# under its own name, which JSON Schema ignores; the validation itself applies it.
_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_bounds(schema: Any) -> Any:
    """`schema` with pydantic's ge/le/gt/lt renamed to JSON Schema's minimum/maximum/exclusive*."""
    if isinstance(schema, list):
        return [_json_schema_bounds(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    numeric = schema.get("type") in ("integer", "number")
    return {(_BOUNDS[k] if numeric and k in _BOUNDS else k): _json_schema_bounds(v) for k, v in schema.items()}


def _json_body(model: type[CompletionRequest] | type[ChatRequest]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads `model` from its JSON body (see create_app's openapi)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}}


def _deadline(state: RouterState) -> float:
    return time.monotonic() + state.cfg.request_timeout


def _check_model(state: RouterState, model: str | None) -> None:
    """vLLM's tokenizer endpoints take `model` as optional; when given it must be this server's."""
    served = state.model_name()
    if model is not None and model != served:
        raise errors.not_found(f"the model {model!r} does not exist; this server serves {served!r}", "model")


def _worker_counts(state: RouterState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for w in state.registry.workers.values():
        key = f"{w.role or 'unknown'}_{'ready' if w.usable else 'not_ready'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


async def _serve(state: RouterState, request: Request, chat: bool) -> Response:
    """A place in admission first (429 when full, before the body is read); the running slot once the
    prompt is tokenized; both given back when the answer is complete (a stream's, when it closes)."""
    arrival = time.monotonic()
    try:
        ticket = state.admission.enter()
    except APIError:
        state.telemetry.inc(m.ROUTER_OVERLOADED, reason="queue_full")
        state.telemetry.inc(m.REQUESTS, reason="error")
        raise
    try:
        response = await _serve_admitted(state, request, chat, ticket, arrival)
    except BaseException:
        ticket.release()
        raise
    if isinstance(response, _EventStream):
        response.ticket = ticket
    else:
        ticket.release()
    return response


async def _serve_admitted(state: RouterState, request: Request, chat: bool, ticket: Ticket,
                          arrival: float) -> Response:
    deadline = arrival + state.cfg.request_timeout
    try:
        raw = await _read_body(request, state.cfg.max_request_bytes, deadline)
        req: ChatRequest | CompletionRequest = parse_body(raw, ChatRequest if chat else CompletionRequest)
        del raw
        served = state.model_name()
        if req.model != served:
            raise errors.not_found(f"the model {req.model!r} does not exist; this server serves {served!r}", "model")
        tok = await state.tokenizer()
        max_model_len = state.max_model_len()
        # Tokenizing a long prompt takes seconds: off the event loop, so /health and every other
        # request keep being served meanwhile (encode releases the GIL; see tokens.encode).
        use = tools_of(req)
        grammar = grammar_of(req, use)
        if use is not None and use.parsed and req.n > 1:
            raise errors.bad_request("n > 1 is not supported with tools", "n")
        prompts = await asyncio.to_thread(_prompts, req, tok, max_model_len, state.chars_per_token, use)
        if isinstance(req, ChatRequest):
            requested, want_logprobs, default_max = req.max_completion_tokens or req.max_tokens, req.logprobs, None
        else:
            requested, want_logprobs = req.max_tokens, req.logprobs is not None
            default_max = DEFAULT_COMPLETION_MAX_TOKENS
        drop_output = isinstance(req, CompletionRequest) and req.echo and requested == 0
        choices = []  # a batch's prompts in order, each with its n choices
        for prompt, echo in prompts:
            max_tokens = resolve_max_tokens(requested, len(prompt), max_model_len, default_max)
            sampling = sampling_from(req, max_tokens, want_logprobs, top_logprobs_of(req), tok.vocab_size, grammar)
            # The n choices compute and hold the prompt's KV once (dispatch.PromptShare); not when they want the
            # prompt's logprobs, which a prefix-cache hit cannot give.
            share = PromptShare() if req.n > 1 and sampling.prompt_logprobs is None else None
            choices += [_Choice(prompt, choice_sampling(sampling, i), echo, drop_output, share, i == 0)
                        for i in range(req.n)]
    except APIError:
        state.telemetry.inc(m.REQUESTS, reason="error")  # refused before it started: counted all the same
        raise
    try:
        await ticket.start(deadline)
    except APIError:
        state.telemetry.inc(m.ROUTER_OVERLOADED, reason="queue_timeout")
        state.telemetry.inc(m.REQUESTS, reason="error")
        raise
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    shape = Shape(request_id, served, chat, want_logprobs, req.return_token_ids)
    prompt_tokens = sum(len(prompt) for prompt, _ in prompts)  # each prompt of a batch once, whatever n
    if len(choices) > 1 and not req.stream:
        return await _collect_n(state, request, request_id, choices, deadline, tok, shape, arrival, prompt_tokens)
    if len(choices) > 1:
        return await _stream_n(state, request, request_id, choices, req, deadline, tok, shape, arrival,
                               prompt_tokens)
    choice = choices[0]
    prompt = choice.prompt
    events = state.dispatcher.generate(request_id, prompt, choice.sampling, deadline)
    timer = _Timer(state.telemetry, arrival, len(prompt))
    asm = choice.assembler(tok)
    if use is not None and use.parsed:  # the whole output decides whether it is a call: collected first
        body = _tool_calls_body(use, await _collect_body(request, events, asm, shape, timer, len(prompt)), asm)
        if not req.stream:
            return JSONResponse(body)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_replay(body, include_usage), media_type="text/event-stream")
    if not req.stream:
        return await _collect(request, events, asm, shape, timer, len(prompt))
    try:
        first = await _first_event(request, events)  # errors before the first token still get a proper status code
    except APIError:
        timer.done("error")
        raise
    if first is None:
        timer.done("error")
        raise errors.internal("the workers finished without producing a token")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _EventStream(_stream(request, first, events, asm, shape, timer, len(prompt), include_usage), events,
                        deadline)


async def _first_event(request: Request, events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
    """The request's first event (None if there is none). Until it comes the handler only waits, and
    nothing cancels a waiting handler when its client leaves: look every CLIENT_CHECK_S and, once it has
    left, cancel the wait (the dispatcher's calls to the workers are cancelled with it: the prefill worker
    drops the prompt, the decode worker's reservation is cancelled) and end with a 499."""
    waiting = asyncio.ensure_future(anext(events, None))
    try:
        while not (await asyncio.wait({waiting}, timeout=CLIENT_CHECK_S))[0]:
            if await request.is_disconnected():
                raise _client_gone()
        return waiting.result()
    finally:
        if not waiting.done():
            waiting.cancel()
            await asyncio.wait({waiting})  # its clean-up runs to the end before the generator is closed
        if not waiting.cancelled():
            waiting.exception()  # retrieved: an error after the client left is nobody's to see


def _client_gone() -> APIError:
    # nginx's 499: nobody reads this answer, but the request is counted (as an error) like any other.
    return APIError(499, "the client closed the connection", code="client_closed_request")


async def _read_body(request: Request, limit: int, deadline: float) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes. A client that
    stalls half-way gets 408 at the request's deadline; one that goes away half-way is a 499."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise errors.too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise errors.too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive before the request's deadline ({size} bytes came)",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise _client_gone() from None
    return b"".join(chunks)


def _tool_calls_body(use: ToolUse, body: dict[str, Any], asm: TextAssembler) -> dict[str, Any]:
    """A chat answer with its output read for tool calls (tool_calls.parse_output: the text, and its token
    ids for markers that are special tokens): then finish_reason tool_calls."""
    choice = body["choices"][0]
    content, calls = parse_output(use, choice["message"]["content"], asm.tokenizer, asm.prompt_ids, asm.token_ids)
    choice["message"] = chat_message(content, calls)
    if calls and choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"
    return body


async def _replay(body: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A collected chat answer as OpenAI streams one: the role, the content or each tool call (id, name and
    all its arguments in one delta), the finish reason, the usage if asked for, [DONE]. The answer's
    logprobs, when asked for, come whole with the first chunk (clients concatenate the chunks' lists)."""
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice, message = body["choices"][0], body["choices"][0]["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse(head | {"choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": "" if message.get("tool_calls") else message["content"]},
                logprobs=choice.get("logprobs"))
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    if message.get("tool_calls") and message["content"]:
        yield chunk({"content": message["content"]})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield sse(head | {"choices": [], "usage": body["usage"]})
    yield sse("[DONE]")


@dataclass
class _Choice:
    """One choice of an answer: a generation of its own on the workers."""

    prompt: list[int]
    sampling: Sampling
    echo: str | None = None  # completions' echo: the prompt's text, which the choice's text starts with
    drop_output: bool = False  # echo with max_tokens 0: the one token the workers generate is left out
    share: PromptShare | None = None  # n > 1: the prompt's choices share its KV
    leader: bool = True  # the choice that computes the prompt (the others wait for its worker)

    def events(self, dispatcher: Dispatcher, request_id: str, deadline: float) -> AsyncIterator[TokenEvent]:
        return dispatcher.generate(request_id, self.prompt, self.sampling, deadline, self.share, self.leader)

    def assembler(self, tok: Tokenizer) -> TextAssembler:
        return TextAssembler(tok, self.prompt, self.sampling.stop, echo=self.echo, drop_output=self.drop_output,
                             want_prompt_logprobs=self.sampling.prompt_logprobs is not None)


def _push(asm: TextAssembler, ev: TokenEvent) -> Delta:
    """An event's tokens into a choice's text; the prompt's logprobs (echo) and cached tokens come with the first."""
    if asm.num_cached_tokens is None and not asm.token_ids:
        asm.num_cached_tokens = ev.num_cached_tokens
    if ev.prompt_logprobs is not None:
        asm.prompt_logprobs, asm.prompt_top_logprobs = ev.prompt_logprobs, ev.prompt_top_logprobs
    elif asm.want_prompt_logprobs and asm.prompt_logprobs is None:
        raise errors.internal("the workers answered without the prompt's logprobs (echo)")
    if asm.drop_output:  # max_tokens 0: the answer is the prompt alone
        return asm.push([], None, "length")
    return asm.push(ev.token_ids, ev.logprobs, ev.finish_reason, ev.top_logprobs)


def _prompts(req: ChatRequest | CompletionRequest, tok: Tokenizer, max_model_len: int,
             chars_per_token: float | None, use: ToolUse | None = None) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids (one, or a completions batch's), with its text when the answer echoes it
    (runs in a worker thread)."""
    if isinstance(req, ChatRequest):
        return [(_prompt_ids(req, tok, max_model_len, chars_per_token, use), None)]
    out: list[tuple[list[int], str | None]] = []
    for prompt in prompts_of(req):
        ids = _prompt_ids(prompt, tok, max_model_len, chars_per_token)
        echo = None
        if req.echo:  # a text prompt as it was given; token ids as they decode (special tokens included)
            echo = prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
        out.append((ids, echo))
    return out


def _prompt_ids(req: ChatRequest | str | list[int], tok: Tokenizer, max_model_len: int,
                chars_per_token: float | None, use: ToolUse | None = None) -> list[int]:
    """The prompt's token ids: a chat's, or one completions prompt's (text or token ids). A text that
    cannot fit however it encodes is refused before the tokenizer spends time on it. The chat template
    gets the tools, as transformers passes them (`tools`, a list of {"type": "function", "function": {...}})."""
    if isinstance(req, ChatRequest):
        try:
            extra: dict[str, Any] = {"tools": use.tools} if use is not None else {}
            text = tok.apply_chat_template(chat_messages(req), **extra)
        except ValueError as exc:
            raise errors.bad_request(str(exc), "messages") from None
        _check_could_fit(text, max_model_len, chars_per_token)
        return encode(tok, text, add_special_tokens=False)
    if isinstance(req, str):
        _check_could_fit(req, max_model_len, chars_per_token)
        return encode(tok, req)
    prompt = list(req)  # token ids
    if len(prompt) >= max_model_len:  # before looking at every id of a huge list
        resolve_max_tokens(None, len(prompt), max_model_len, None)
    if any(not 0 <= t < tok.vocab_size for t in prompt):
        raise errors.bad_request(f"prompt token ids must be in 0..{tok.vocab_size - 1}", "prompt")
    return prompt


def _check_could_fit(text: str, max_model_len: int, chars_per_token: float | None) -> None:
    if chars_per_token is not None and len(text) > max_model_len * chars_per_token:
        # Each token stands for at most chars_per_token characters, so this text has more than
        # max_model_len tokens: the exact count would refuse it too, only seconds later.
        raise APIError(400, f"the prompt has {len(text)} characters, which is more than {max_model_len} tokens "
                       f"for this tokenizer (at most {chars_per_token:g} characters per token); this model's "
                       f"maximum context length is {max_model_len} tokens", param="prompt",
                       code="context_length_exceeded")


class _Timer:
    """Per-request latency metrics as the router sees them."""

    def __init__(self, telemetry: RouterTelemetry, arrival: float, prompt_tokens: int, counted: bool = True) -> None:
        # counted=False: another choice (n > 1) of a request whose first choice counts the request.
        self.t, self.arrival, self.counted = telemetry, arrival, counted
        self.last: float | None = None
        if counted:
            telemetry.inc(m.PROMPT_TOKENS, prompt_tokens)

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        if self.last is None:
            self.t.observe(m.TTFT, now - self.arrival)
        else:
            self.t.observe(m.ITL, (now - self.last) / max(1, n))
        self.last = now
        self.t.inc(m.GENERATION_TOKENS, n)

    def done(self, reason: str) -> None:
        if self.counted:
            self.t.observe(m.E2E, time.monotonic() - self.arrival)
            self.t.inc(m.REQUESTS, reason=reason)


async def _collect(request: Request, events: AsyncIterator[TokenEvent], asm: TextAssembler, shape: Shape,
                   timer: _Timer, prompt_tokens: int) -> Response:
    return JSONResponse(await _collect_body(request, events, asm, shape, timer, prompt_tokens))


async def _collect_n(state: RouterState, request: Request, request_id: str, choices: list[_Choice], deadline: float,
                     tok: Tokenizer, shape: Shape, arrival: float, prompt_tokens: int) -> Response:
    """n > 1 or a batch of prompts (not streamed): the choices' generations side by side, one answer. Each
    is a request to the workers of its own; a prompt's choices after the first run where the first
    decodes and share its KV there (dispatch.PromptShare). Seeded: a prompt's choice i uses seed + i, so
    they differ and repeat."""
    async def one(i: int, choice: _Choice) -> dict[str, Any]:
        events = choice.events(state.dispatcher, f"{request_id}-{i}", deadline)
        timer = _Timer(state.telemetry, arrival, prompt_tokens, counted=i == 0)
        return await _collect_body(request, events, choice.assembler(tok), shape, timer, len(choice.prompt))

    try:
        async with asyncio.TaskGroup() as group:  # one choice failing cancels the others (their KV is freed)
            tasks = [group.create_task(one(i, choice)) for i, choice in enumerate(choices)]
    except* APIError as failed:
        raise failed.exceptions[0] from None
    answers = [t.result() for t in tasks]
    cached = _cached_tokens(choices, [a["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
                                      for a in answers])
    return JSONResponse(merge_choices(answers, prompt_tokens, cached))


def _cached_tokens(choices: list[_Choice], values: list[int | None]) -> int | None:
    """A request's cached prompt tokens: each prompt's once, its leading choice's (None when a worker did not say)."""
    leading = [v for c, v in zip(choices, values, strict=True) if c.leader]
    return None if any(v is None for v in leading) else sum(v for v in leading if v is not None)


async def _collect_body(request: Request, events: AsyncIterator[TokenEvent], asm: TextAssembler, shape: Shape,
                        timer: _Timer, prompt_tokens: int) -> dict[str, Any]:
    deltas: list[Delta] = []
    reason: str | None = None
    try:
        ev = await _first_event(request, events)
        while ev is not None:
            timer.tokens(len(ev.token_ids))
            delta = _push(asm, ev)
            deltas.append(delta)
            if delta.finish_reason is not None:
                reason = delta.finish_reason
                break
            # Nothing cancels a plain (non-streaming) handler when its client goes away: look after every
            # event, or the workers would generate up to max_tokens for nobody.
            if await request.is_disconnected():
                raise _client_gone()
            ev = await anext(events, None)
    except APIError:
        timer.done("error")
        raise
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    timer.done(reason or "error")
    return full_response(shape, asm, deltas, reason, prompt_tokens)


STOP_CHOICES_S = 10.0  # n > 1: how long an ended stream waits for its choices to stop at their next event

class _Choices:
    """The event streams of a request's n choices, closed together (as _EventStream closes one)."""

    def __init__(self, streams: list[AsyncIterator[TokenEvent]]) -> None:
        self.streams = streams

    async def aclose(self) -> None:
        for events in self.streams:
            await events.aclose()  # type: ignore[attr-defined]


async def _stream_n(state: RouterState, request: Request, request_id: str, choices: list[_Choice],
                    req: ChatRequest | CompletionRequest, deadline: float, tok: Tokenizer, shape: Shape,
                    arrival: float, prompt_tokens: int) -> Response:
    """n > 1 or a batch of prompts, streamed: the choices' chunks interleaved as they come, each with its
    index (as OpenAI's); one usage chunk (with include_usage) and [DONE] at the end."""
    streams = [c.events(state.dispatcher, f"{request_id}-{i}", deadline) for i, c in enumerate(choices)]
    timers = [_Timer(state.telemetry, arrival, prompt_tokens, counted=i == 0) for i in range(len(choices))]
    asms = [c.assembler(tok) for c in choices]
    # The leaders' first events decide the status code; a sharing choice's first event waits for its leader
    # to decode (its second event), so it is read in the choice's own stream.
    try:
        leaders = await asyncio.gather(*(_first_event(request, events)
                                         for c, events in zip(choices, streams, strict=True) if c.leader))
    except APIError:
        for timer in timers:
            timer.done("error")
        await _Choices(streams).aclose()
        raise
    if any(first is None for first in leaders):
        await _Choices(streams).aclose()
        raise errors.internal("the workers finished without producing a token")
    led = iter(leaders)
    firsts = [next(led) if c.leader else None for c in choices]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stop = asyncio.Event()
    bodies = [_stream(request, first, events, asm, shape, timer, prompt_tokens, False, index=i, final=False,
                      stop=stop)
              for i, (first, events, asm, timer) in enumerate(zip(firsts, streams, asms, timers, strict=True))]
    return _EventStream(_interleave(bodies, stop, shape, asms, choices, prompt_tokens, include_usage), _Choices(streams),  # type: ignore[arg-type]
                        deadline)


async def _interleave(bodies: list[AsyncIterator[bytes]], stop: asyncio.Event, shape: Shape, asms: list[TextAssembler],
                      choices: list[_Choice],
                      prompt_tokens: int, include_usage: bool) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(body: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in body:
                await queue.put(chunk)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(body)) for body in bodies]
    try:
        left = len(tasks)
        while left:
            chunk = await queue.get()
            if chunk is None:
                left -= 1
            else:
                yield chunk
        if include_usage:
            yield sse(usage_chunk(shape, prompt_tokens, sum(asm.num_tokens for asm in asms),
                                  _cached_tokens(choices, [asm.num_cached_tokens for asm in asms])))
        yield sse("[DONE]")
    finally:
        # The choices stop at their next event, as a single stream stops when its client leaves: cancelled, one
        # could be cut off in its hand-off to the decode worker and leave its KV reservation to expire.
        stop.set()
        with anyio.CancelScope(shield=True):
            _, pending = await asyncio.wait(tasks, timeout=STOP_CHOICES_S) if tasks else (set(), set())
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(request: Request, first: TokenEvent | None, events: AsyncIterator[TokenEvent], asm: TextAssembler,
                  shape: Shape, timer: _Timer, prompt_tokens: int, include_usage: bool, index: int = 0,
                  final: bool = True, stop: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """One choice's SSE chunks; `final`: the request's only stream, which ends with usage and [DONE].
    `first` None: read it here (a choice sharing its leader's prompt; its errors become an error chunk)."""
    reason: str | None = None
    try:
        ev: TokenEvent | None = first if first is not None else await anext(events, None)
        if ev is None:
            raise errors.internal("the workers finished without producing a token")
        is_first = handoff = True
        while ev is not None:
            timer.tokens(len(ev.token_ids))
            delta = _push(asm, ev)
            if delta.text or delta.finish_reason or is_first or shape.token_ids or (shape.logprobs and delta.logprobs):
                yield sse(stream_chunk(shape, asm, delta, is_first, index))
                is_first = False
            if delta.finish_reason is not None:
                reason = delta.finish_reason
                break
            if await request.is_disconnected():  # sending to a gone client does not fail: look before asking for more
                break
            if stop is not None and stop.is_set():  # n > 1: the request's stream has ended
                break
            # Starlette cancels this generator when the client goes away. The event after the first is where a
            # disaggregated request moves to its decode worker, whose /decode call claims the KV reservation:
            # cancelled half-way, the call might never reach the worker, and the reservation would hold its
            # blocks until it expires. So that one call is not cancelled; the next look above ends the stream.
            with anyio.CancelScope(shield=handoff):
                ev = await anext(events, None)
            handoff = False
        if include_usage:
            yield sse(usage_chunk(shape, prompt_tokens, asm.num_tokens, asm.num_cached_tokens))
    except APIError as exc:
        yield sse(exc.body())
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled scope would cancel the workers' clean-up calls too
            await events.aclose()  # type: ignore[attr-defined]
        timer.done(reason or "error")
    if final:
        yield sse("[DONE]")


class _EventStream(StreamingResponse):
    """A request's SSE stream. However it ends, its generators are closed (the workers release the
    request's KV), and it ends at the request's deadline even when the client reads nothing: that
    client's send would otherwise wait forever."""

    def __init__(self, body: AsyncIterator[bytes], events: AsyncIterator[TokenEvent], deadline: float) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.events, self.deadline = events, deadline
        self.ticket: Ticket | None = None  # the request's admission, given back when the stream ends

    async def stream_response(self, send: Send) -> None:
        with anyio.move_on_after(max(0.0, self.deadline + STALLED_CLIENT_GRACE_S - time.monotonic())) as scope:
            await super().stream_response(send)
        if scope.cancelled_caught:
            log.warning("closing a stream whose client read nothing until past the request's deadline")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.events.aclose()  # type: ignore[attr-defined]
            if self.ticket is not None:
                self.ticket.release()
