"""OpenAIPolicy: any OpenAI-compatible server (vLLM, SGLang, llama.cpp server, OpenAI).

The adapter is chosen by model name, exactly as vLLM's multi-LoRA serving selects it; None means the base
model. Requests run concurrently up to a bound, each with a timeout. Retries are ours, not the client's, so
they are explicit and counted: a dropped or refused connection, a timeout, HTTP 408/409/429 or 5xx is tried
again after an exponential backoff with jitter; any other failure (a 400 stays a 400) is final at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import ToolCall

MAX_BACKOFF_S = 8.0  # a retry later than this rarely helps; the caller's whole batch waits on the slowest request
RETRY_STATUS = frozenset({408, 409, 429})  # besides 5xx: request timeout, lock conflict, rate limit


def retryable(exc: BaseException) -> bool:
    """Whether a failed call may succeed when sent again: a connection error, a timeout, 408/409/429 or 5xx."""
    import openai

    if isinstance(exc, openai.APIConnectionError):  # APITimeoutError is a subclass
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in RETRY_STATUS or exc.status_code >= 500
    return False


def backoff_delay(retry: int, backoff_s: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``retry`` (1-based): doubling from backoff_s, capped, plus 0-50% jitter."""
    delay = min(backoff_s * 2 ** (retry - 1), MAX_BACKOFF_S)
    # Jitter only lengthens the wait, so the doubled delay is a lower bound a test can measure.
    return delay * (1.0 + 0.5 * rng.random())


class OpenAIPolicy:
    """Chat completions against an OpenAI-compatible endpoint, with counted retries.

    ``stats`` holds cumulative counters over the policy's life: ``requests`` (requests completed, failed or not),
    ``retries`` (extra attempts sent after a retryable failure; attempts = requests + retries) and ``failed``
    (requests that came back with an error).
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        load_adapters: bool = False,
    ) -> None:
        self.model, self.base_url, self.load_adapters = model, base_url, load_adapters
        self.api_key = os.environ.get(api_key_env) or "EMPTY"  # local servers accept any key
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries
        self.backoff_s = backoff_s
        # Jitter only spreads retries in time, it never changes a completion; a fixed seed keeps runs repeatable.
        self.rng = random.Random(0)
        self.stats = {"requests": 0, "retries": 0, "failed": 0}
        self.adapters: dict[str, str] = {}

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
            raise RuntimeError(f"could not load adapter {name!r} at {url}: {type(exc).__name__}: {exc}") from None
        if answer.status_code == 400 and "already been loaded" in answer.text:
            return
        if answer.status_code != 200:
            raise RuntimeError(
                f"could not load adapter {name!r} from {path} at {url}: HTTP {answer.status_code} "
                f"{' '.join(answer.text.split())[:200]} (start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and make the folder visible to it)"
            )

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        """Complete every request; failures come back as completions with an error."""
        return asyncio.run(self._all(requests, adapter or self.model))

    async def _all(self, requests: list[ChatRequest], model: str) -> list[Completion]:
        """Run requests concurrently under a semaphore, with one client for the batch."""
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s, max_retries=0)
        gate = asyncio.Semaphore(self.concurrency)
        try:
            return list(await asyncio.gather(*(self._one(client, gate, r, model) for r in requests)))
        finally:
            await client.close()

    async def _one(self, client: Any, gate: asyncio.Semaphore, request: ChatRequest, model: str) -> Completion:
        """One chat completion, retried while the failure is retryable; the last failure becomes an error."""
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
        # The backoff sleeps inside the gate: a struggling server (429, 5xx) gets fewer requests, not more.
        async with gate:
            started = time.perf_counter()
            attempts = 0
            while True:
                attempts += 1
                try:
                    completion = _completion(await client.chat.completions.create(**kwargs))
                    break
                except Exception as exc:  # noqa: BLE001 - network and server failures are data
                    if attempts > self.max_retries or not retryable(exc):
                        plural = "" if attempts == 1 else "s"
                        error = f"{type(exc).__name__} after {attempts} attempt{plural}: {exc}"
                        completion = Completion(error=error)
                        break
                    self.stats["retries"] += 1
                    await asyncio.sleep(backoff_delay(attempts, self.backoff_s, self.rng))
        self.stats["requests"] += 1
        self.stats["failed"] += bool(completion.error)
        return completion.model_copy(update={"latency_s": time.perf_counter() - started})


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
