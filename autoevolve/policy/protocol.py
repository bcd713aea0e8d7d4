"""The policy protocol: chat completion with tools for a batch of requests, the LoRA adapter chosen by name, and
the request and reply records it takes and gives."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from autoevolve.records import ToolCall


class CallConstraint(BaseModel):
    """A reply that must be a tool call (``decoding.constrain: tool_call``): one of ``tools`` in ``syntax``,
    several in one reply when ``parallel``, after an optional 'Plan:' line when ``plan_line``. With ``or_text``,
    a reply may instead be text that does not open with a call (JSON syntax only: a served request's ``strict``
    tools under ``tool_choice: auto``). With ``json_value`` instead, a reply that is one JSON value of that schema
    (a served request's ``response_format``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: list[dict[str, Any]]
    syntax: Literal["json", "python", "python_list"]
    parallel: bool = False
    plan_line: bool = False
    or_text: bool = False
    json_value: dict[str, Any] | None = None


class ChatRequest(BaseModel):
    """One model call: rendered messages, native tools (or None), decoding knobs."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = Field(default=96, gt=0)
    seed: int = 0
    top_k: int = Field(default=0, ge=0, description="Sample from the k likeliest tokens only (0: all).")
    min_p: float = Field(
        default=0.0, ge=0, le=1, description="Sample only tokens at least this fraction as likely as the likeliest."
    )
    repetition_penalty: float = Field(
        default=1.0,
        gt=0,
        description="Divide the positive logits (multiply the negative) of tokens already in the prompt or the reply "
        "by this, before picking (1: off), as vLLM and transformers do.",
    )
    constrain: CallConstraint | None = Field(
        default=None, description="Decode under a tool-call grammar (local) or the server's equivalent (OpenAI)."
    )
    cache_key: str | None = Field(
        default=None,
        description="Requests with the same key may start from prompt tokens an earlier request with that key "
        "computed (a local policy's KV store); never sent to a server. The rollout engine keys each batch of episodes.",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="Return each generated token's log-probability and this many likeliest alternatives' (0: the "
        "token's only). Local policies only.",
    )
    prompt: str | None = Field(
        default=None,
        description="A raw prompt, generated from as it is, without the chat template (``/v1/completions``); "
        "``messages`` are then empty. Local policies only.",
    )
    reuse_kv_of: str | None = Field(
        default=None,
        description="Start from the keys and values another adapter ('': the bare base) computed for this prompt's "
        "stored prefix instead of computing them under this request's adapter (a local policy's decoder; an "
        "approximation). The router's option for the turn an expert takes over; never sent to a server.",
    )


class Completion(BaseModel):
    """What came back: text, native tool calls (if the backend parsed any), token counts, or an error."""

    model_config = ConfigDict(extra="forbid")

    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str = ""
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = Field(
        default=None, description="Per generated token: its id, its log-probability, the top alternatives' (id, lp)."
    )


class Policy(Protocol):
    """A model behind a chat API. Never raises for one request: a failed request is a Completion with error."""

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        """Complete every request with the named adapter (None: the bare base model), in order."""
        ...

    def add_adapter(self, name: str, path: str) -> None:
        """Make an adapter folder (PEFT format) available under a name."""
        ...

    def remove_adapter(self, name: str) -> None:
        """Stop serving an adapter added under a name (one not added: nothing to do)."""
        ...
