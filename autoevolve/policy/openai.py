"""OpenAIPolicy: any OpenAI-compatible server (vLLM, SGLang, llama.cpp server, OpenAI).

The adapter is chosen by model name, exactly as vLLM's multi-LoRA serving selects it; None means the base
model. Requests run concurrently up to a bound, each with a timeout, through one client per policy whose
connections are reused from batch to batch. Retries are the openai client's own: a dropped connection, a
timeout, HTTP 408/409/429 or 5xx is sent again after its exponential backoff, honouring the server's
``Retry-After`` and ``x-should-retry``; any other failure (a 400 stays a 400) is final at once. Every attempt is
counted as it leaves (an httpx request hook), so ``stats`` and each error say how many were sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from typing import Any

from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import ToolCall

_ATTEMPTS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("autoevolve_attempts")  # one request's count


async def _count_attempt(request: Any) -> None:
    """httpx request hook: one more attempt of the request being sent (each request runs in its own context)."""
    counter = _ATTEMPTS.get(None)
    if counter is not None:
        counter[0] += 1


class OpenAIPolicy:
    """Chat completions against an OpenAI-compatible endpoint, with counted retries.

    ``stats`` holds cumulative counters over the policy's life: ``requests`` (requests completed, failed or not),
    ``retries`` (extra attempts the client sent after a retryable failure; attempts = requests + retries) and
    ``failed`` (requests that came back with an error).
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        load_adapters: bool = False,
    ) -> None:
        self.model, self.base_url, self.load_adapters = model, base_url, load_adapters
        self.api_key = os.environ.get(api_key_env) or "EMPTY"  # local servers accept any key
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries
        self.stats = {"requests": 0, "retries": 0, "failed": 0}
        self.adapters: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the client's connections belong to one event loop
        self._client: Any = None

    def close(self) -> None:
        """Close the client's connections and its event loop (a later call opens new ones)."""
        if self._loop is not None:
            if self._client is not None:
                self._loop.run_until_complete(self._client.close())
            self._loop.close()
        self._loop = self._client = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the connections go with the process
            pass

    def _redact(self, text: str) -> str:
        """The text with the API key blanked out: errors go to the store, the logs and the report."""
        return text.replace(self.api_key, "***") if self.api_key != "EMPTY" else text

    def add_adapter(self, name: str, path: str) -> None:
        """Serve an adapter under ``name``: with ``load_adapters``, load it into the server (vLLM's runtime LoRA
        updating; the folder must be visible to the server at ``path``); without, the server must serve it already.
        """
        if self.load_adapters and self.adapters.get(name) != path:
            self._load(name, path)
        self.adapters[name] = path

    def _load(self, name: str, path: str) -> None:
        """POST /load_lora_adapter; 'already loaded' is fine, anything else stops the run with the fix."""
        import httpx

        url = f"{self.base_url.rstrip('/')}/load_lora_adapter"
        headers = {"Authorization": f"Bearer {self.api_key}"}
        try:
            answer = httpx.post(url, json={"lora_name": name, "lora_path": path}, headers=headers, timeout=300)
        except httpx.HTTPError as exc:
            raise RuntimeError(
                self._redact(f"could not load adapter {name!r} at {url}: {type(exc).__name__}: {exc}")
            ) from None
        if answer.status_code == 400 and "already been loaded" in answer.text:
            return
        if answer.status_code != 200:
            body = " ".join(self._redact(answer.text).split())[:200]
            raise RuntimeError(
                f"could not load adapter {name!r} from {path} at {url}: HTTP {answer.status_code} {body} (start vLLM "
                "with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and make the folder visible to it)"
            )

    def remove_adapter(self, name: str) -> None:
        """Stop serving an adapter: with ``load_adapters``, unload it from the server (vLLM's
        /v1/unload_lora_adapter; a name the server does not hold is fine); without, only forget it here."""
        if self.adapters.pop(name, None) is None or not self.load_adapters:
            return
        import httpx

        url = f"{self.base_url.rstrip('/')}/unload_lora_adapter"
        headers = {"Authorization": f"Bearer {self.api_key}"}
        try:
            answer = httpx.post(url, json={"lora_name": name}, headers=headers, timeout=60)
        except httpx.HTTPError as exc:
            raise RuntimeError(
                self._redact(f"could not unload adapter {name!r} at {url}: {type(exc).__name__}: {exc}")
            ) from None
        if answer.status_code != 200 and "cannot be found" not in answer.text:  # vLLM: 404, or 400 before 0.8
            body = " ".join(self._redact(answer.text).split())[:200]
            raise RuntimeError(f"could not unload adapter {name!r} at {url}: HTTP {answer.status_code} {body}")

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        """Complete every request; failures come back as completions with an error."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self._all(requests, adapter or self.model))

    async def _all(self, requests: list[ChatRequest], model: str) -> list[Completion]:
        """Run requests concurrently under a semaphore, through the policy's one client."""
        if self._client is None:
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient

            http = DefaultAsyncHttpxClient(event_hooks={"request": [_count_attempt]})
            self._client = AsyncOpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                timeout=self.timeout_s,
                max_retries=self.max_retries,
                http_client=http,
            )
        gate = asyncio.Semaphore(self.concurrency)
        return list(await asyncio.gather(*(self._one(gate, r, model) for r in requests)))

    async def _one(self, gate: asyncio.Semaphore, request: ChatRequest, model: str) -> Completion:
        """One chat completion (the client retries what may succeed again); the last failure becomes an error."""
        if request.prompt is not None:
            return Completion(error="a raw prompt (no chat template) is generated by a local policy only")
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": request.messages,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_tokens": request.max_new_tokens,
            "seed": request.seed,
        }
        if request.tools:
            kwargs["tools"] = request.tools
        extras = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}  # vLLM's knobs, sent only when set
        if changed := {k: getattr(request, k) for k, off in extras.items() if getattr(request, k) != off}:
            kwargs["extra_body"] = changed
        if request.constrain is not None:
            try:
                kwargs |= constrained(request)
            except ValueError as exc:
                return Completion(error=str(exc))
        attempts = [0]
        _ATTEMPTS.set(attempts)  # this request's task has its own context: the hook counts its attempts alone
        # The client's backoff sleeps inside the gate: a struggling server (429, 5xx) gets fewer requests, not more.
        async with gate:
            started = time.perf_counter()
            try:
                completion = _completion(await self._client.chat.completions.create(**kwargs))
            except Exception as exc:  # noqa: BLE001 - network and server failures are data
                plural = "" if attempts[0] == 1 else "s"
                error = f"{type(exc).__name__} after {attempts[0]} attempt{plural}: {exc}"
                completion = Completion(error=self._redact(error))  # a server may echo the key it was sent
        self.stats["requests"] += 1
        self.stats["retries"] += max(attempts[0] - 1, 0)
        self.stats["failed"] += bool(completion.error)
        return completion.model_copy(update={"latency_s": time.perf_counter() - started})


def constrained(request: ChatRequest) -> dict[str, Any]:
    """The chat-completion parameters that hold a reply to a tool call, by the OpenAI spec: with native tools,
    ``tool_choice: "required"`` (and ``parallel_tool_calls`` as the task allows); with calls written as JSON text,
    ``response_format`` with the calls' JSON schema (structured outputs). A reply of text or calls (``or_text``) is
    ``tool_choice: "auto"`` over native tools marked ``strict``. Other cases have no equivalent in the API:
    ValueError says what to change."""
    spec = request.constrain
    if spec.or_text and request.tools:
        strict = [_strict(t) for t in request.tools]
        return {"tool_choice": "auto", "tools": strict, "parallel_tool_calls": spec.parallel}
    if spec.or_text:
        raise ValueError(
            "a reply of text or a JSON call written as text has no equivalent in the API: use native tools"
        )
    if request.tools:
        return {"tool_choice": "required", "parallel_tool_calls": spec.parallel}
    if spec.syntax != "json":
        raise ValueError(
            f"decoding.constrain 'tool_call' with call_syntax {spec.syntax!r}: an OpenAI-compatible server has no "
            "grammar for calls in Python syntax; use tool_format 'native' or call_syntax 'json', or a local model"
        )
    from autoevolve.policy.grammar import json_schema

    schema = {"name": "tool_call", "schema": json_schema(spec), "strict": False}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _strict(tool: dict[str, Any]) -> dict[str, Any]:
    """A native tool whose calls the server holds to its schema."""
    return {**tool, "function": {**tool["function"], "strict": True}}


def _completion(response: Any) -> Completion:
    """A Completion from a chat-completion response (a malformed one raises, and is then a failed request)."""
    message = response.choices[0].message
    calls = [
        ToolCall(id=c.id, function={"name": c.function.name, "arguments": c.function.arguments or "{}"})
        for c in (message.tool_calls or [])
    ]
    usage = response.usage
    return Completion(
        text=message.content or "",
        tool_calls=calls,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
    )
