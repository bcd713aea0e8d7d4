"""The HTTP face of the fleet: OpenAI's chat and text completions, model list and cards, vLLM's token and LoRA routes.

``POST /v1/chat/completions`` (``stream: true`` answers server-sent events), ``POST /v1/completions`` (a prompt
continued as it is), ``GET /v1/models`` and ``GET /v1/models/{id}``, vLLM's ``POST /tokenize`` and
``POST /detokenize``, ``GET /metrics`` (Prometheus), ``GET /health``,
and, only with runtime loading on (``runtime_lora.RuntimeLoRA``), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (what ``hooks.VLLMHook`` calls on a promotion or rollback), run on an executor of
their own. Every error, on every route and status, is the reference's error object: 400 for a request the server
refuses (the message and ``param`` name the field), 401 without the key, 404 for an unknown model or route, 405,
413 for a body over ``MAX_BODY_BYTES``, 422 for a body that is not the route's shape, 429 (with ``Retry-After``)
when too many requests wait, 500 when generation failed (the reason goes to the server's log, not the client), 503
when no reply came in time. A streamed reply leaves as it is generated: the text of each decode step as a chunk (a
reply that may be a tool call is read whole, then its calls are sent in pieces); an error after the stream began is
one event holding the error object. A client that leaves, streamed or not, ends its generation at the next decode
step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException

from autoevolve.fleet.serving.fleet import Fleet
from autoevolve.fleet.serving.live import Live
from autoevolve.fleet.serving.metrics import CONTENT_TYPE, Metrics
from autoevolve.fleet.serving.runtime_lora import RuntimeLoRA
from autoevolve.fleet.serving.wire import (
    MAX_CHOICES,
    MAX_MESSAGES,
    ChatBody,
    CompletionBody,
    Reply,
    SamplingBody,
    WireError,
    event,
    whole,
)

MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body larger than this is refused (413) unread
CHECK_GONE_S = 0.25  # how often a request that is not streamed checks that its client is still there
log = logging.getLogger(__name__)


class LoadBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadBody(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize`` request: a prompt as it is, or messages under the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send a prompt or messages (one of them)")
        return self


class DetokenizeBody(BaseModel):
    """vLLM's ``/detokenize`` request."""

    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[int] = Field(max_length=1 << 20)


def create_app(fleet: Fleet, api_key: str | None = None, runtime: RuntimeLoRA | None = None) -> FastAPI:
    """The server's routes over a fleet; with ``api_key`` every route but /health wants ``Authorization: Bearer``;
    with ``runtime`` the runtime LoRA endpoints exist and load what it allows."""
    app = FastAPI(title="autoevolve", docs_url=None, redoc_url=None, openapi_url=None)
    controls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoevolve-lora")  # apart from chat requests
    metrics = Metrics(lambda: fleet.in_flight)
    # Each request waits for its batch on a thread of its own: as many as may wait, or the default executor's few
    # threads (6 on 2 cores) would cap every batch at a few requests.
    waiters = ThreadPoolExecutor(max_workers=fleet.max_waiting + MAX_CHOICES, thread_name_prefix="autoevolve-wait")

    if api_key:
        app.add_middleware(_KeyRequired, key=api_key)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(WireError(what.get(exc.status_code, str(exc.detail)), status=exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def _shape(request: Request, exc: RequestValidationError) -> Response:
        return _error(WireError("the request is not this route's shape", status=422))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return _error(WireError("the server failed on this request; its log says why", status=500))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": fleet.cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        card = next((c for c in fleet.cards() if c["id"] == model), None)
        if card is None:
            return _error(WireError(f"model: {model!r} is not served here", status=404, param="model"))
        return JSONResponse(card)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _answer(request, fleet, metrics, waiters, ChatBody)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(request, fleet, metrics, waiters, CompletionBody)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            body = await _body(request, TokenizeBody)
            fleet.served(body.model)
            ids = fleet.tokens(body.prompt, body.messages, body.add_generation_prompt, body.add_special_tokens)
        except WireError as exc:
            return _error(exc)
        return JSONResponse({"count": len(ids), "max_model_len": fleet.context, "tokens": ids, "token_strs": None})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            body = await _body(request, DetokenizeBody)
            fleet.served(body.model)
            return JSONResponse({"prompt": fleet.text(body.tokens)})
        except WireError as exc:
            return _error(exc)

    @app.get("/metrics")
    async def exposition() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    if runtime is None:
        return app

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        try:
            body = await _body(request, LoadBody)
            ref = runtime.identity(body.lora_name, body.lora_path)  # before anything on disk is read
            name, path, inplace, limit = body.lora_name, body.lora_path, body.load_inplace, runtime.max_loras
            await asyncio.get_running_loop().run_in_executor(
                controls, lambda: fleet.load(name, path, inplace, ref=ref, limit=limit)
            )
            metrics.loads.inc()
        except WireError as exc:
            return _error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        try:
            body = await _body(request, UnloadBody)
            await asyncio.get_running_loop().run_in_executor(controls, fleet.unload, body.lora_name)
            metrics.unloads.inc()
        except WireError as exc:
            return _error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return app


class _KeyRequired:
    """Every route but /health wants ``Authorization: Bearer KEY`` (plain ASGI, so a handler still hears its
    client leave)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.wanted = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.wanted):
                refused = _error(WireError("Incorrect API key: send Authorization: Bearer KEY", status=401))
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _answer(
    request: Request, fleet: Fleet, metrics: Metrics, waiters: ThreadPoolExecutor, kind: type[SamplingBody]
) -> Response:
    """A chat or text completion: the whole reply, or its stream (see the module docstring)."""
    started = time.monotonic()
    try:
        body = await _body(request, kind)
    except WireError as exc:
        return _error(exc)
    text = isinstance(body, CompletionBody)
    lives = [fleet.live(body, asyncio.get_running_loop()) for _ in range(body.n)]  # n choices: n requests
    live = lives[0]
    if text:
        live.id = "cmpl-" + live.id.removeprefix("chatcmpl-")
    run, loop = fleet.complete if text else fleet.reply, asyncio.get_running_loop()
    answers = [
        loop.run_in_executor(waiters, run, body.model_copy(update={"seed": (body.seed or 0) + i}), each)
        for i, each in enumerate(lives)
    ]  # each choice its own seed; they wait together, so they are batched together
    answer, count = answers[0], functools.partial(_count, metrics, body.model, live, started)
    if not body.stream:
        try:
            replies = [await _unless_gone(request, a, each) for a, each in zip(answers, lives, strict=True)]
        except WireError as exc:
            for each in lives:
                each.cancelled.set()
            count(None)
            return _error(exc)
        count(replies[0], sum(r.completion_tokens for r in replies))
        replies[0].id = live.id
        return JSONResponse(whole(replies, text, body.text if text and body.echo else ""))
    first = asyncio.ensure_future(live.pieces.get())
    await asyncio.wait({first, answer}, return_when=asyncio.FIRST_COMPLETED)
    if not first.done() and isinstance(answer.exception(), WireError):  # refused before a token left: its status
        first.cancel()
        count(None)
        return _error(answer.exception())
    shape = _Text(body.text if body.echo else "") if text else _Chat()
    return StreamingResponse(_stream(body, live, answer, first, shape, count), media_type="text/event-stream")


def _count(
    metrics: Metrics, model: str, live: Live, started: float, reply: Reply | None, generated: int | None = None
) -> None:
    """A request ended: how (``error`` when refused or failed, ``abort`` when its client left), its tokens (all its
    choices' ``generated``), times."""
    reason = "error" if reply is None else ("abort" if live.cancelled.is_set() else reply.finish_reason)
    tokens = (reply.prompt_tokens, reply.completion_tokens if generated is None else generated) if reply else (0, 0)
    metrics.finished(model, reason, started, live.first_token, *tokens)


class _Chat:
    """A streamed chat completion's chunks."""

    def opening(self, head: Reply, usage: bool) -> list[dict[str, Any]]:
        return [head.chunk({"role": "assistant", "content": ""}, usage)]

    def piece(self, head: Reply, text: str, usage: bool) -> dict[str, Any]:
        return head.chunk({"content": text}, usage)

    def rest(self, reply: Reply, usage: bool, sent: str) -> list[dict[str, Any]]:
        return reply.chunks(usage, sent=sent)


@dataclass(frozen=True)
class _Text:
    """A streamed text completion's chunks (``echo``: the prompt, sent first)."""

    echo: str = ""

    def opening(self, head: Reply, usage: bool) -> list[dict[str, Any]]:
        return [head.text_chunk(self.echo, usage)] if self.echo else []

    def piece(self, head: Reply, text: str, usage: bool) -> dict[str, Any]:
        return head.text_chunk(text, usage)

    def rest(self, reply: Reply, usage: bool, sent: str) -> list[dict[str, Any]]:
        return reply.text_chunks(usage, sent=sent)


async def _unless_gone(request: Request, answer: asyncio.Future, live: Live) -> Reply:
    """The reply; a client that disconnects while it waits ends its generation at the next decode step."""
    while not answer.done():
        await asyncio.wait({answer}, timeout=CHECK_GONE_S)
        if not answer.done() and await request.is_disconnected():
            live.cancelled.set()
    return answer.result()


async def _stream(
    body: SamplingBody,
    live: Live,
    answer: asyncio.Future,
    first: asyncio.Future,
    shape: _Chat | _Text,
    count: Callable[[Reply | None], None],
) -> AsyncIterator[str]:
    """The events of a streamed reply: its opening, each text piece as generated, then the rest of the reply (its
    calls, the finish reason, the usage), then ``[DONE]``. However it ends, its generation ends too."""
    usage, counted = body.include_usage, False
    head = Reply(model=live.model or body.model, id=live.id, created=live.created)
    try:
        for chunk in shape.opening(head, usage):
            yield event(chunk)
        piece = first
        while True:
            await asyncio.wait({piece, answer}, return_when=asyncio.FIRST_COMPLETED)
            if not piece.done():
                break
            yield event(shape.piece(head, piece.result(), usage))
            piece = asyncio.ensure_future(live.pieces.get())
        piece.cancel()
        while not live.pieces.empty():
            yield event(shape.piece(head, live.pieces.get_nowait(), usage))
        try:
            reply = answer.result()
        except WireError as exc:
            count(None)
            yield event(exc.body())
        else:
            count(reply)
            reply.id, reply.created = live.id, live.created
            for chunk in shape.rest(reply, usage, live.sent):
                yield event(chunk)
        counted = True
        yield "data: [DONE]\n\n"
    finally:
        live.cancelled.set()
        if not counted:  # the client left mid-stream
            count(None if not answer.done() or answer.exception() else answer.result())


async def _body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as ``model``; WireError naming the first bad field."""
    declared = request.headers.get("content-length") or "0"
    if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
        raise WireError(f"the body is over {MAX_BODY_BYTES} bytes (or its Content-Length is not a number)", status=413)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise WireError(f"the body is over {MAX_BODY_BYTES} bytes", status=413)
    try:
        return model.model_validate_json(raw)
    except ValueError as exc:  # a body that is not JSON
        if not isinstance(exc, ValidationError):
            raise WireError(f"the body is not JSON: {exc}") from None
        first = exc.errors()[0]
        said = first["msg"].removeprefix("Value error, ")
        named = said.split(":")[0] if said.split(":")[0] in model.model_fields else None  # a check across fields
        where = ".".join(str(p) for p in first["loc"]) or named or "body"
        if named == where:
            raise WireError(said, param=where) from None
        raise WireError(f"{where}: {said}", param=where) from None


def _error(exc: WireError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def run_server(
    fleet: Fleet,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    runtime: RuntimeLoRA | None = None,
) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(create_app(fleet, api_key, runtime), host=host, port=port, log_level="info")
