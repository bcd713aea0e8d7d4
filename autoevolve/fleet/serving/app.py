"""The HTTP face of the fleet: OpenAI's chat completions and model list, and vLLM's runtime LoRA endpoints.

``POST /v1/chat/completions`` (``stream: true`` answers server-sent events), ``GET /v1/models``,
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (what ``hooks.VLLMHook`` calls on a promotion
or rollback), ``GET /health``. Errors are the reference's error object with the HTTP status: 400 for a request the
server refuses (the message names the field), 401 without the key, 404 for an unknown model, 500 when generation
failed. A streamed reply is generated whole, then sent in word-sized chunks.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from autoevolve.fleet.serving.fleet import Fleet
from autoevolve.fleet.serving.wire import ChatBody, WireError, sse


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


def create_app(fleet: Fleet, api_key: str | None = None) -> FastAPI:
    """The server's routes over a fleet; with ``api_key`` every route but /health wants ``Authorization: Bearer``."""
    app = FastAPI(title="autoevolve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        given = request.headers.get("authorization", "")
        if api_key and request.url.path != "/health" and not secrets.compare_digest(given, f"Bearer {api_key}"):
            return _error(WireError("Incorrect API key: send Authorization: Bearer KEY", status=401))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": fleet.cards()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            body = await _body(request, ChatBody)
            reply = await asyncio.to_thread(fleet.reply, body)
        except WireError as exc:
            return _error(exc)
        if not body.stream:
            return JSONResponse(reply.completion())
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(iter(sse(reply.chunks(usage))), media_type="text/event-stream")

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        try:
            body = await _body(request, LoadBody)
            await asyncio.to_thread(fleet.load, body.lora_name, body.lora_path, body.load_inplace)
        except WireError as exc:
            return _error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        try:
            body = await _body(request, UnloadBody)
            await asyncio.to_thread(fleet.unload, body.lora_name)
        except WireError as exc:
            return _error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return app


async def _body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as ``model``; WireError naming the first bad field."""
    try:
        return model.model_validate(await request.json())
    except ValueError as exc:  # a body that is not JSON
        if not isinstance(exc, ValidationError):
            raise WireError(f"the body is not JSON: {exc}") from None
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise WireError(f"{where}: {first['msg'].removeprefix('Value error, ')}", param=where) from None


def _error(exc: WireError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def run_server(fleet: Fleet, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(create_app(fleet, api_key), host=host, port=port, log_level="info")
