"""OpenAIPolicy: any OpenAI-compatible server (vLLM, SGLang, llama.cpp server, OpenAI).

The adapter is chosen by model name, exactly as vLLM's multi-LoRA serving selects it; None means the base
model. Requests run concurrently up to a bound, each with a timeout and retries (the client's own backoff).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import ToolCall


class OpenAIPolicy:
    """Chat completions against an OpenAI-compatible endpoint."""

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
    ) -> None:
        self.model, self.base_url = model, base_url
        self.api_key = os.environ.get(api_key_env) or "EMPTY"  # local servers accept any key
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries
        self.adapters: dict[str, str] = {}

    def add_adapter(self, name: str, path: str) -> None:
        """Note an adapter name; the server must already serve it (see the vllm promotion hook)."""
        self.adapters[name] = path

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        """Complete every request; failures come back as completions with an error."""
        return asyncio.run(self._all(requests, adapter or self.model))

    async def _all(self, requests: list[ChatRequest], model: str) -> list[Completion]:
        """Run requests concurrently under a semaphore, with one client for the batch."""
        from openai import AsyncOpenAI

        client = AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s, max_retries=self.max_retries
        )
        gate = asyncio.Semaphore(self.concurrency)
        try:
            return list(await asyncio.gather(*(self._one(client, gate, r, model) for r in requests)))
        finally:
            await client.close()

    async def _one(self, client: Any, gate: asyncio.Semaphore, request: ChatRequest, model: str) -> Completion:
        """One chat completion; any exception becomes an error completion."""
        async with gate:
            started = time.perf_counter()
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
            try:
                response = await client.chat.completions.create(**kwargs)
            except Exception as exc:  # noqa: BLE001 - network and server failures are data
                return Completion(error=f"{type(exc).__name__}: {exc}", latency_s=time.perf_counter() - started)
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
                latency_s=time.perf_counter() - started,
            )
