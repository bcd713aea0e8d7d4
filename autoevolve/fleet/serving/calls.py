"""Served model calls: a request made under a slot's harness (or as sent), and the reply read back as tool calls.

Under a harness the conversation is rendered as a task of the environment would be: its first user message is the
task's request, the request's ``metadata`` fills the memory template, and each requested tool is shown as the
harness shows it (its own spec of that name, as trained). A request that opens with a system message, or a slot
with no harness on record, goes to the chat template as sent, with the request's tools native, as vLLM serves it.
Tool call ids are of OpenAI's shape (``call_`` and 24 letters and digits); the fleet keeps which served name made
each call, so the turn goes on there when the result comes back.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from autoevolve.fleet.serving.wire import ChatBody, WireError
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import calls_in, constraint
from autoevolve.harness.toolcall import PARALLEL_CALLS, CallError, check_arguments, parse, parse_all
from autoevolve.policy import CallConstraint, ChatRequest, Completion
from autoevolve.records import Message, Task, ToolCall

RAW_MAX_TOKENS = 256  # a completion's limit when neither the request nor a harness sets one
SHARED_CONTEXT = "router"  # the KV cache key of calls in the entry expert's context (switch: shared, shared_kv)


@dataclass
class View:
    """How one model call was made, to read its reply: the harness and task (None when served raw), the tools."""

    hcp: HCPConfig | None
    task: Task | None
    tools: list[dict[str, Any]]
    parallel: bool


def harnessed_call(
    hcp: HCPConfig | None, body: ChatBody, history: list[Message], system: str | None, routing: dict[str, Any] | None
) -> tuple[ChatRequest, View]:
    """A model call under a slot's harness ``hcp``, or as sent (when the request brings a system message, or no
    harness is known); ``routing``: the entry expert's change_model tool."""
    forced = body.forced_tool()
    offered = [] if body.tool_choice == "none" else list(body.tools or [])
    if forced and forced not in {t["function"]["name"] for t in offered}:
        raise WireError(f"tool_choice: {forced!r} is not one of the request's tools", param="tool_choice")
    shaped = body.json_value()
    if shaped is not None and (offered or routing):
        raise WireError(
            "response_format: a JSON reply is served without tools (and not through the router); send one of them",
            param="response_format",
        )
    seed = body.seed or 0
    if system is not None or hcp is None:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [_wire(m) for m in history]
        tools = _only(offered, forced)
        parallel = body.parallel_tool_calls
        calls = _forced(tools, "json", parallel, body) or _strict(tools, "json", parallel, body)
        constrain = calls if tools else _shaped(shaped)
        request = ChatRequest(
            messages=messages,
            tools=tools or None,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            max_new_tokens=body.max_new or RAW_MAX_TOKENS,
            seed=seed,
            constrain=constrain,
            logprobs=body.scores(),
            **body.extras(),
        )
        return request, View(None, None, tools, parallel)
    if routing:  # the entry expert: change_model, and of the request's tools those its harness was trained with
        offered = [routing] + [t for t in offered if t["function"]["name"] in hcp.tool_names]
    tools = _only([_theirs(hcp, t) if t is not routing else t for t in offered], forced)
    config = hcp.model_copy(update={"tools": tools})
    task = _task(body, history)
    messages, native = config.render(task, history)
    syntax = "json" if config.tool_format == "native" else config.call_syntax
    parallel = bool(task.metadata.get(PARALLEL_CALLS))
    if tools:
        constrain = _forced(tools, syntax, parallel, body) or constraint(config, task)
        constrain = constrain or _strict(tools, syntax, parallel, body)
    else:
        constrain = _shaped(shaped)
    request = _sampled(config, body, messages, native, constrain=constrain)
    return request, View(config, task, tools, parallel)


def in_context(
    hcp: HCPConfig,
    body: ChatBody,
    turn: list[Message],
    routing: dict[str, Any],
    answering: bool,
    keep_kv: bool,
    reuse: str | None = None,
) -> tuple[ChatRequest, View]:
    """A call in the entry expert's context (``switch: shared``): its harness, offering change_model and every tool
    of the request, over the turn so far. The expert that answers continues those very tokens (it gets no
    change_model to call), from the keys and values the adapter ``reuse`` names when given. ``keep_kv``: calls
    keep what they computed for later ones (``switch: shared_kv``)."""
    if body.json_value() is not None:
        raise WireError("response_format: a JSON reply is not served through the router", param="response_format")
    offered = [] if body.tool_choice == "none" else list(body.tools or [])
    tools = [routing] + [_theirs(hcp, t) for t in offered]
    config = hcp.model_copy(update={"tools": tools})
    task = _task(body, turn)
    messages, native = config.render(task, turn)
    request = _sampled(config, body, messages, native, cache_key=SHARED_CONTEXT if keep_kv else None, reuse_kv_of=reuse)
    return request, View(config, task, tools[1:] if answering else tools, bool(task.metadata.get(PARALLEL_CALLS)))


def _sampled(config: HCPConfig, body: ChatBody, messages: list, native: Any, **extra: Any) -> ChatRequest:
    """A rendered call sampled as the harness says, unless the request sets a knob itself."""
    s = config.sampling
    return ChatRequest(
        messages=messages,
        tools=native,
        temperature=s.temperature if body.temperature is None else body.temperature,
        top_p=s.top_p if body.top_p is None else body.top_p,
        max_new_tokens=body.max_new or s.max_new_tokens,
        seed=body.seed or 0,
        logprobs=body.scores(),
        **body.extras(),
        **extra,
    )


def _task(body: ChatBody, history: list[Message]) -> Task:
    """The task a harness renders a served conversation as: its first user message, the request's metadata."""
    metadata = dict(body.metadata or {})
    if "parallel_tool_calls" in body.model_fields_set:
        metadata[PARALLEL_CALLS] = body.parallel_tool_calls
    first = next(m.content for m in history if m.role == "user")
    return Task(id="served", env="served", split="test", tier=1, request=first, metadata=metadata)


def _theirs(hcp: HCPConfig, tool: dict[str, Any]) -> dict[str, Any]:
    """A requested tool as the harness shows it: the harness's own spec of that name (its evolved descriptions,
    as trained), else the request's."""
    name = tool.get("function", {}).get("name")
    return next((t for t in hcp.tools if t["function"]["name"] == name), tool)


def _only(tools: list[dict[str, Any]], forced: str | None) -> list[dict[str, Any]]:
    return [t for t in tools if t["function"]["name"] == forced] if forced else tools


def _shaped(schema: dict[str, Any] | None) -> CallConstraint | None:
    """The grammar of a reply that is one JSON value of ``schema`` (``response_format``)."""
    return None if schema is None else CallConstraint(tools=[], syntax="json", json_value=schema)


def _forced(tools: list[dict[str, Any]], syntax: str, parallel: bool, body: ChatBody) -> CallConstraint | None:
    """The grammar of a reply that must be a call (``tool_choice`` required or a named function)."""
    if body.tool_choice != "required" and body.forced_tool() is None:
        return None
    return CallConstraint(tools=tools, syntax=syntax, parallel=parallel)


def _strict(tools: list[dict[str, Any]], syntax: str, parallel: bool, body: ChatBody) -> CallConstraint | None:
    """Under ``tool_choice: auto``, when a requested tool is ``strict``: the grammar of a reply that is text or
    calls of the offered tools held to their schemas. JSON calls only; calls in a harness's Python syntax are
    checked against their schemas once written, as every call is."""
    if syntax != "json" or not any((t.get("function") or {}).get("strict") for t in body.tools or []):
        return None
    return CallConstraint(tools=tools, syntax=syntax, parallel=parallel, or_text=True)


def read_calls(completion: Completion, view: View) -> list[ToolCall]:
    """The reply's tool calls, each checked against its tool's schema; [] when the reply is text (or a call the
    offered tools cannot take, which then goes back as the text the model wrote)."""
    if not view.tools:
        return []
    names = [t["function"]["name"] for t in view.tools]
    try:
        if view.hcp is not None:
            found = calls_in(completion, view.hcp, view.task)
        else:
            found = (
                parse_all(completion.text, names)
                if view.parallel
                else [c for c in [parse(completion.text, names)] if c]
            )
        calls = []
        for name, arguments in found:
            spec = next((t for t in view.tools if t["function"]["name"] == name), None)
            if spec is None:
                return []
            calls.append(ToolCall.make(f"call_{uuid.uuid4().hex[:24]}", name, check_arguments(spec, arguments)))
        return calls
    except CallError:
        return []


def cut(text: str, stops: list[str]) -> str:
    """The text up to its first stop sequence."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def _wire(message: Message) -> dict[str, Any]:
    """A canonical message as the chat-completions reference writes it."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out
