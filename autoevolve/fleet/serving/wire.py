"""The OpenAI chat-completions wire format: the request body the server reads and the JSON it answers with.

Requests follow the chat-completions reference: ``messages`` (system/developer, user, assistant with
``tool_calls``, tool with ``tool_call_id``), ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``temperature``,
``top_p``, ``max_tokens``/``max_completion_tokens``, ``seed``, ``stop``, ``stream`` with ``stream_options``, ``n``
(up to ``MAX_CHOICES``, not streamed), ``logprobs`` with ``top_logprobs``, ``response_format``; ``/v1/completions``
takes its own body (``CompletionBody``). vLLM's sampling extras ``top_k``, ``min_p`` and ``repetition_penalty`` are
honoured too. Fields the server cannot honour (``logprobs`` with ``stream``, a ``response_format`` that is not text,
json_object or json_schema) are refused with a 400 naming the field; fields that do not change the reply (``user``,
``store``, ...) are ignored, as vLLM does.
``metadata`` (a string map in the reference) fills the harness's memory template (e.g. ``today``, ``user``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoevolve.records import Message, ToolCall


class WireError(ValueError):
    """A request the server refuses: HTTP ``status``, the message names the field and the fix."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after

    def body(self) -> dict[str, Any]:
        """The error object of the OpenAI reference."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        code = {404: "model_not_found", 429: "rate_limit_exceeded"}.get(self.status)
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": code}}


MAX_MESSAGES = 1024  # messages in one request
MAX_TOOLS = 128  # tools offered in one request (OpenAI's own limit)
MAX_CHOICES = 16  # n: choices of one request (each generated as a request of its own, batched together)


class SamplingBody(BaseModel):
    """What the chat and the text completions requests share: the model, the decoding knobs, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's sampling extras (-1 or 0: all tokens)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_choice_as_sampled(self) -> SamplingBody:
        """Refuse what the server would otherwise silently ignore."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n: 1 to {MAX_CHOICES} choices per request are served")
        if self.n > 1 and self.stream:
            raise ValueError("n: several choices are served without stream; send n=1 to stream")
        return self

    def extras(self) -> dict[str, Any]:
        """vLLM's sampling extras as a request's fields (unset: off)."""
        return {
            "top_k": max(self.top_k or 0, 0),
            "min_p": self.min_p or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
        }

    @property
    def max_new(self) -> int | None:
        """The completion's token limit, if the request sets one."""
        return self.max_tokens

    @property
    def stops(self) -> list[str]:
        """Stop sequences (at most four, as the reference allows)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise WireError("stop: at most 4 sequences", param="stop")
        return stops

    def scores(self) -> int | None:
        """How many alternatives each generated token's log-probability comes with (None: no log-probabilities)."""
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk of token counts (``stream_options.include_usage``)."""
        return bool((self.stream_options or {}).get("include_usage"))


class ChatBody(SamplingBody):
    """A chat-completions request body."""

    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, gt=0)
    metadata: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatBody:
        """Refuse what the server would otherwise silently ignore."""
        if self.logprobs and self.stream:
            raise ValueError("logprobs: served without stream; send stream: false for log-probabilities")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        self.json_value()  # a response_format the server cannot enforce is refused here
        if isinstance(self.tool_choice, str) and self.tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: {self.tool_choice!r} is not none, auto, required or a named function")
        return self

    @property
    def max_new(self) -> int | None:
        """The completion's token limit, if the request sets one."""
        return self.max_completion_tokens or self.max_tokens

    def scores(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def json_value(self) -> dict[str, Any] | None:
        """The JSON schema ``response_format`` holds the reply to (``json_object``: any object); None for text."""
        shape = self.response_format or {}
        kind = shape.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        inner = shape.get("json_schema")
        schema = inner.get("schema") if kind == "json_schema" and isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ValueError(
                "response_format: text, json_object, or json_schema with json_schema.schema (an object) is served"
            )
        return schema

    def forced_tool(self) -> str | None:
        """The function ``tool_choice`` names, if it names one."""
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if not name:
                raise WireError(
                    "tool_choice: a named choice is {type: function, function: {name: ...}}", param="tool_choice"
                )
            return name
        return None


class CompletionBody(SamplingBody):
    """A text completions request body (``/v1/completions``): one prompt, generated from as it is, no chat
    template and no harness."""

    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionBody:
        """Refuse what the server would otherwise silently ignore."""
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request is served; send a string")
        if self.logprobs is not None and self.stream:
            raise ValueError("logprobs: served without stream; send stream: false for log-probabilities")
        if self.suffix:
            raise ValueError("suffix: not served; leave it unset")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: one choice per request is served; leave it unset (or 1)")
        return self

    def scores(self) -> int | None:
        return self.logprobs

    @property
    def text(self) -> str:
        """The prompt."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def conversation(raw: list[dict[str, Any]]) -> tuple[list[Message], str | None]:
    """The request's messages in canonical form, and its system text (system and developer messages joined; None
    when it has none). WireError names the first message that breaks the reference's rules."""
    messages: list[Message] = []
    system: list[str] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise WireError(f"messages[{i}]: a message is an object with a role", param=f"messages[{i}]")
        role = m.get("role")
        content = _text(m.get("content"), i)
        if role in ("system", "developer"):
            system.append(content)
            continue
        if role == "user":
            messages.append(Message(role="user", content=content))
        elif role == "assistant":
            calls = [_call(c, i, j) for j, c in enumerate(m.get("tool_calls") or [])]
            messages.append(Message(role="assistant", content=content, tool_calls=calls))
        elif role == "tool":
            if not m.get("tool_call_id") or not isinstance(m["tool_call_id"], str):
                where = f"messages[{i}].tool_call_id"
                raise WireError(f"{where}: a tool message needs the id (a string) of the call it answers", param=where)
            messages.append(Message(role="tool", content=content, tool_call_id=m["tool_call_id"]))
        else:
            raise WireError(f"messages[{i}].role: {role!r} is not system, developer, user, assistant or tool")
    if not any(m.role == "user" for m in messages):
        raise WireError("messages: the conversation needs a user message", param="messages")
    return messages, "\n\n".join(system) if system else None


def _text(content: Any, i: int) -> str:
    """A message's content as text: a string, or text parts joined (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise WireError(f"messages[{i}].content: only text parts are served", param=f"messages[{i}].content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise WireError(f"messages[{i}].content: a string or a list of text parts", param=f"messages[{i}].content")


def _call(call: dict[str, Any], i: int, j: int) -> ToolCall:
    """One assistant tool call of the request."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
        where = f"messages[{i}].tool_calls[{j}]"
        raise WireError(f"{where}: needs an id and function.name (strings)", param=where)
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):  # some clients send the object itself
        arguments = json.dumps(arguments)
    return ToolCall(id=call["id"], function={"name": fn["name"], "arguments": arguments})


@dataclass
class Reply:
    """What a request produced: the answering model, its text or calls, token counts, and (routed requests) the
    routing exchange before the answer, as stored trajectories hold it."""

    model: str
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: Literal["stop", "length", "tool_calls"] = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    routing: list[Message] = field(default_factory=list)
    served: str = ""  # the served name that wrote it: where the results of its tool calls go
    logprobs: list[dict[str, Any]] | None = None  # per generated token, in the chat reference's shape
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        """The assistant message of the response."""
        out: dict[str, Any] = {"role": "assistant", "content": self.text if self.text or not self.calls else None}
        if self.calls:
            out["tool_calls"] = [c.model_dump() for c in self.calls]
        return out

    def usage(self) -> dict[str, int]:
        """Token counts of the reference's ``usage`` object."""
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    def completion(self) -> dict[str, Any]:
        """The ``chat.completion`` object."""
        scored = None if self.logprobs is None else {"content": self.logprobs, "refusal": None}
        choice = {"index": 0, "message": self.message(), "finish_reason": self.finish_reason, "logprobs": scored}
        return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}

    def chunks(self, include_usage: bool = False, sent: str | None = None) -> list[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of a streamed reply: the role, the text in pieces, each call (its
        id and name, then its arguments in pieces, as the reference streams them), the finish reason, and the usage
        when asked for (``stream_options.include_usage``). ``sent``: the role and this much text left already, as
        the reply was generated; only what follows is in these chunks."""
        deltas: list[dict[str, Any]] = [] if sent is not None else [{"role": "assistant", "content": ""}]
        rest = self.text[len(sent or "") :] if self.text.startswith(sent or "") else ""
        deltas += [{"content": piece} for piece in _pieces(rest)]
        for i, call in enumerate(self.calls):
            head = {"id": call.id, "type": "function", "function": {"name": call.function["name"], "arguments": ""}}
            deltas.append({"tool_calls": [{"index": i, **head}]})
            for piece in _pieces(call.function["arguments"]):
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        out = [self.chunk(d, include_usage) for d in deltas] + [self.chunk({}, include_usage, self.finish_reason)]
        if include_usage:
            out.append({**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage()})
        return out

    def chunk(self, delta: dict[str, Any], include_usage: bool = False, finish: str | None = None) -> dict[str, Any]:
        """One ``chat.completion.chunk`` of this reply (``usage`` null on each when the stream ends with it)."""
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**out, "usage": None} if include_usage else out

    def text_completion(self, echo: str = "") -> dict[str, Any]:
        """The ``text_completion`` object of ``/v1/completions`` (``echo``: the prompt, before the text)."""
        choice = {"index": 0, "text": echo + self.text, "logprobs": None, "finish_reason": self.finish_reason}
        if self.logprobs is not None:  # the legacy shape: parallel lists, each token's offset in the choice's text
            offsets, at = [], len(echo)
            for entry in self.logprobs:
                offsets.append(at)
                at += len(entry["token"])
            choice["logprobs"] = {
                "tokens": [e["token"] for e in self.logprobs],
                "token_logprobs": [e["logprob"] for e in self.logprobs],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in self.logprobs],
                "text_offset": offsets,
            }
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}

    def text_chunks(self, include_usage: bool = False, sent: str = "") -> list[dict[str, Any]]:
        """The streamed ``text_completion`` objects after ``sent``: the rest of the text in pieces, the finish
        reason, and the usage when asked for."""
        rest = self.text[len(sent) :] if self.text.startswith(sent) else ""
        out = [self.text_chunk(piece, include_usage) for piece in _pieces(rest)]
        out.append(self.text_chunk("", include_usage, self.finish_reason))
        if include_usage:
            out.append({**self._head("text_completion"), "choices": [], "usage": self.usage()})
        return out

    def text_chunk(self, text: str, include_usage: bool = False, finish: str | None = None) -> dict[str, Any]:
        """One streamed ``text_completion`` object of this reply."""
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {**self._head("text_completion"), "choices": [choice]}
        return {**out, "usage": None} if include_usage else out

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _pieces(text: str) -> list[str]:
    """Text cut into word-sized pieces that join back to it exactly (each keeps the spaces before its word)."""
    pieces, start = [], 0
    for i in range(1, len(text)):
        if text[i] in " \n" and text[i - 1] not in " \n":
            pieces.append(text[start:i])
            start = i
    return [*pieces, text[start:]] if text else []


def whole(replies: list[Reply], text: bool = False, echo: str = "") -> dict[str, Any]:
    """The response body of one or more choices (``n``): a ``chat.completion`` (``text``: a ``text_completion``,
    each choice's text after ``echo``), the choices indexed in order, usage summed with the prompt counted once."""
    bodies = [r.text_completion(echo) if text else r.completion() for r in replies]
    out = bodies[0] | {"choices": [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]}
    prompt, generated = replies[0].prompt_tokens, sum(r.completion_tokens for r in replies)
    out["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    return out


def event(chunk: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(chunk)}\n\n"
