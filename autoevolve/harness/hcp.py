"""The HCP config (Harness Context Protocol): everything the model sees around the frozen weights.

A config is a set of named components (system prompt, tools, how tools are shown, call syntax, demos, memory
layout, routing text, sampling, scaffold). Its id is a hash of its content. ``render(task, history)`` gives the
exact chat messages (and, for native tool calling, the tool list) the model sees at the next step.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from autoevolve.harness.toolcall import python_literal
from autoevolve.records import Message, Task

COMPONENTS = (
    "system_prompt",
    "tools",
    "tool_format",
    "call_syntax",
    "demos",
    "memory",
    "routing",
    "sampling",
    "scaffold",
    "decoding",
)


class Strict(BaseModel):
    """Unknown keys are an error: a typo in a config must not pass silently."""

    model_config = ConfigDict(extra="forbid")


class Demo(Strict):
    """A few-shot demonstration: a canonical conversation of one train task."""

    task_id: str
    messages: list[Message]


class Demos(Strict):
    """Few-shot demonstrations and how they are chosen for a task."""

    items: list[Demo] = Field(default_factory=list)
    select: Literal["all", "nearest"] = Field(
        default="all", description="all: every demo, in order; nearest: the k demos whose requests share most words."
    )
    k: int = Field(default=3, ge=1, le=32, description="Demos shown per task when select is 'nearest'.")
    style: Literal["full", "first_call"] = Field(
        default="full", description="full: whole conversations; first_call: request and first reply only (shorter)."
    )
    order: Literal["nearest_last", "nearest_first"] = Field(
        default="nearest_last", description="With 'nearest': the most similar demo just before the request, or first."
    )
    match: Literal["request", "request_and_tools"] = Field(
        default="request",
        description="With 'nearest': similarity of the request's words alone, or also of the function schemas (the "
        "task's tool and parameter names against those the demo calls).",
    )

    def for_task(self, task: Task) -> list[Demo]:
        """The demos to show before a task, never the task's own."""
        pool = [d for d in self.items if d.task_id != task.id]
        if self.select == "all":
            return pool
        words = _words(task.request)
        if self.match == "request_and_tools":
            words |= _schema_words(task.tools)
        ranked = sorted(pool, key=lambda d: -len(words & self._words_of(d)))  # stable: ties keep order
        return ranked[: self.k][::-1] if self.order == "nearest_last" else ranked[: self.k]

    def _words_of(self, demo: Demo) -> set[str]:
        """What a demo is matched on: its request's words, and the names of the calls it makes when asked."""
        words = _words(demo.messages[0].content)
        if self.match == "request_and_tools":
            calls = [c for m in demo.messages for c in m.tool_calls or []]
            words |= _words(" ".join(f"{c.name} {' '.join(c.arguments)}" for c in calls))
        return words


def _words(text: str) -> set[str]:
    """Lower-cased word set of a text, for demo retrieval (names split at underscores and dots)."""
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _schema_words(tools: list[dict[str, Any]]) -> set[str]:
    """The words of tool specs' function and parameter names."""
    names = []
    for tool in tools:
        fn = tool.get("function", {})
        names += [fn.get("name", ""), *fn.get("parameters", {}).get("properties", {})]
    return _words(" ".join(names))


class Memory(Strict):
    """Where and how task metadata (the user's memory) is shown."""

    position: Literal["system", "user", "none"] = "system"
    template: str = Field(default="", description="Formatted with the task's metadata, e.g. 'Today is {today}.'")


class Sampling(Strict):
    """Decoding knobs for every model call."""

    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=96, gt=0, le=4096)


class Scaffold(Strict):
    """Limits and shapes of the tool loop."""

    max_steps: int = Field(default=4, gt=0, le=64, description="Model calls per episode before it is cut off.")
    tool_result_role: Literal["tool", "user"] = Field(default="tool", description="Role that carries tool results.")
    plan_first: bool = Field(default=False, description="Ask for one 'Plan:' line before each tool call.")
    retry_bad_calls: int = Field(
        default=0,
        ge=0,
        le=8,
        description="Calls per episode the harness cannot run (unreadable, unknown tool, bad arguments) that are "
        "answered with the error, so the model can write the call again; 0: such a call ends the episode.",
    )


class Decoding(Strict):
    """How replies are decoded: freely, or under a grammar of the offered tool calls (see autoevolve.policy.grammar)."""

    constrain: Literal["none", "tool_call"] = Field(
        default="none",
        description="tool_call: every reply is a call of an offered function, argument names from its schema, values "
        "of the declared types, in the call syntax (local models: a token grammar; OpenAI servers: their own "
        "structured outputs). Stage 1 may switch it on; the original config keeps it off, so distillation teaches "
        "the weights what the grammar enforced.",
    )


ToolFormat = Literal["native", "json", "python", "compact"]
CallSyntax = Literal["json", "python", "python_list"]


PLACEHOLDERS = ("tools", "call_format", "memory", "routing")  # what ``HCPConfig._system`` fills in


class HCPConfig(Strict):
    """A harness config. Mutators change components; the environment's scorer is never part of it."""

    name: str = Field(default="config", description="A label; not part of the id.")
    system_prompt: str = Field(description="Template; {tools}, {call_format}, {memory} and {routing} are filled in.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Tool specs in the OpenAI function schema; left out of a file: the environment's own.",
    )
    tool_format: ToolFormat = Field(
        default="json",
        description="native: tools= to the chat template or server; json/python/compact: listed in the prompt.",
    )
    call_syntax: CallSyntax = Field(default="json", description="How calls are written when tools are in the prompt.")
    demos: Demos = Field(default_factory=Demos)
    memory: Memory = Field(default_factory=Memory)
    routing: str = Field(default="", description="Routing instructions (which expert handles what).")
    sampling: Sampling = Field(default_factory=Sampling)
    scaffold: Scaffold = Field(default_factory=Scaffold)
    decoding: Decoding = Field(default_factory=Decoding)

    @field_validator("system_prompt")
    @classmethod
    def _known_placeholders(cls, text: str) -> str:
        """A ``{name}`` the harness does not fill would reach the model as it is: refuse it."""
        unknown = sorted(set(re.findall(r"\{([A-Za-z_]\w*)\}", text)) - set(PLACEHOLDERS))
        if unknown:
            known = ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
            raise ValueError(f"unknown placeholder {{{unknown[0]}}}; the harness fills {known}: rename or remove it")
        return text

    @property
    def id(self) -> str:
        """Content hash of every component (the name excluded)."""
        body = self.model_dump(mode="json", exclude={"name"})
        # Knobs added later leave the ids of configs that do not use them as they were.
        if not self.scaffold.retry_bad_calls:
            del body["scaffold"]["retry_bad_calls"]
        if self.decoding == Decoding():
            del body["decoding"]
        if self.demos.match == "request":
            del body["demos"]["match"]
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def tool_names(self) -> list[str]:
        """Names of the tools this config offers."""
        return [t["function"]["name"] for t in self.tools]

    def sampled(self, temperature: float) -> HCPConfig:
        """The same config decoding at ``temperature`` (for rejection samples), named '<name>-sampled'."""
        knobs = self.sampling.model_copy(update={"temperature": temperature})
        return self.model_copy(update={"name": f"{self.name}-sampled", "sampling": knobs})

    def retrying(self, bad_calls: int) -> HCPConfig:
        """The same config answering up to ``bad_calls`` bad calls per episode with their errors, with as many more
        model calls allowed."""
        scaffold = self.scaffold.model_copy(
            update={"retry_bad_calls": bad_calls, "max_steps": min(64, self.scaffold.max_steps + bad_calls)}
        )
        return self.model_copy(update={"scaffold": Scaffold.model_validate(scaffold.model_dump())})

    def with_env_tools(self, env_tools: list[dict[str, Any]]) -> HCPConfig:
        """This config offering the environment's tools: all of them when it lists none of its own; else its own,
        each a tool the environment has, with parameters it takes (descriptions are the config's: evolvable text).
        ValueError names the first tool or parameter the environment lacks."""
        if "tools" not in self.model_fields_set:
            return self.model_copy(update={"tools": env_tools})
        known = {t["function"]["name"]: t["function"] for t in env_tools}
        for i, tool in enumerate(self.tools):
            fn = tool.get("function", {})
            name = fn.get("name")
            if name not in known:
                has = ", ".join(known) or "none of its own (its tasks bring theirs)"
                raise ValueError(f"tools[{i}]: the environment has no tool {name!r} (it has: {has}); remove or rename")
            theirs = known[name].get("parameters", {})
            ours = fn.get("parameters", {}).get("properties", {})
            takes = theirs.get("properties", {})
            for param in ours:
                if param not in takes:
                    raise ValueError(
                        f"tools[{i}] ({name}): the environment's {name} takes no parameter {param!r} "
                        f"(it takes: {', '.join(takes) or 'none'})"
                    )
            for param in theirs.get("required", []):
                if param not in ours:
                    raise ValueError(f"tools[{i}] ({name}): required parameter {param!r} is missing; add it")
        return self

    def tools_for(self, task: Task) -> list[dict[str, Any]]:
        """The tools offered on a task: the config's, then the task's own (e.g. one function-calling question's)."""
        return self.tools + task.tools if task.tools else self.tools

    def render(self, task: Task, history: list[Message] = ()) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """The messages (OpenAI dicts) and native tool list the model sees for a task after ``history``.

        ``history`` is the canonical conversation so far, starting with the user's request; when empty,
        the request alone is used.
        """
        history = list(history) or [Message(role="user", content=task.request)]
        messages: list[dict[str, Any]] = [{"role": "system", "content": self._system(task)}]
        for demo in self.demos.for_task(task):
            shown = demo.messages[:2] if self.demos.style == "first_call" else demo.messages
            messages += [self._message(m, None) for m in shown]
        messages += [self._message(m, task if i == 0 else None) for i, m in enumerate(history)]
        return messages, (self.tools_for(task) if self.tool_format == "native" else None)

    def _system(self, task: Task) -> str:
        """Fill the system prompt template."""
        filled = {  # the keys of PLACEHOLDERS
            "{tools}": render_tools(self.tools_for(task), self.tool_format),
            "{call_format}": self._call_format(),
            "{memory}": self._memory(task) if self.memory.position == "system" else "",
            "{routing}": self.routing,
        }
        text = self.system_prompt
        for key, value in filled.items():
            text = text.replace(key, value)
        return re.sub(r"\n{3,}", "\n\n", text).strip()  # empty placeholders leave no blank runs

    def _call_format(self) -> str:
        """How to write a call (text-rendered tools only), with the plan-first instruction when asked for."""
        text = "" if self.tool_format == "native" else CALL_FORMATS[self.call_syntax]
        return f"{text} {PLAN_FIRST}".strip() if self.scaffold.plan_first else text

    def _memory(self, task: Task) -> str:
        """Task metadata through the memory template; unknown fields are left empty."""
        return self.memory.template.format_map(_Blank(task.metadata)) if self.memory.template else ""

    def _message(self, message: Message, first_of: Task | None) -> dict[str, Any]:
        """One canonical message as the model sees it under this config."""
        if message.role == "user":
            content = message.content
            if first_of is not None and self.memory.position == "user" and self.memory.template:
                content = f"{self._memory(first_of)}\n{content}"
            return {"role": "user", "content": content}
        # By the chat-completions spec a tool message answers, by id, a ``tool_calls`` entry of the assistant
        # message before it: so whenever results go back as tool messages, the calls go out as tool_calls too (with
        # text-rendered tools, beside the call text the model wrote; templates that ignore tool_calls see the text).
        as_tool = self.tool_format == "native" or self.scaffold.tool_result_role == "tool"
        if message.role == "tool":
            if as_tool:
                return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
            return {"role": "user", "content": f"Tool result: {message.content}"}
        if message.role == "assistant" and message.tool_calls:
            text = message.content
            if self.tool_format != "native":
                text = format_calls(message.tool_calls, self.call_syntax)
            if not as_tool:
                return {"role": "assistant", "content": text}
            return {"role": "assistant", "content": text, "tool_calls": [c.model_dump() for c in message.tool_calls]}
        return {"role": message.role, "content": message.content}

    @classmethod
    def from_yaml(cls, path: str | Path) -> HCPConfig:
        """Load a config from YAML (pydantic errors name the bad field)."""
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def to_yaml(self) -> str:
        """Serialise to YAML, components in their declared order."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=120)


class _Blank(dict):
    """format_map helper: a missing key renders as an empty string."""

    def __missing__(self, key: str) -> str:
        return ""


PLAN_FIRST = "Before each tool call, write one short line starting with 'Plan:' that says which tool and why."
CALL_FORMATS = {
    "json": 'To use a tool, reply with only a JSON object: {"name": "<tool name>", "arguments": {<arguments>}}.',
    "python": 'To use a tool, reply with only a call like tool_name(arg="value", number=2).',
    "python_list": 'To use a tool, reply with only the call in a list, like [tool_name(arg="value", number=2)]; '
    'several calls go in one list: [func_a(x=1), func_b(y="z")].',
}


def render_tools(tools: list[dict[str, Any]], tool_format: ToolFormat) -> str:
    """Show tool specs as text: JSON schema lines, Python-style signatures, or a compact list."""
    if tool_format == "native":
        return ""
    lines = []
    for tool in tools:
        fn = tool["function"]
        if tool_format == "json":
            lines.append(json.dumps(fn, separators=(",", ":")))
            continue
        props = fn.get("parameters", {}).get("properties", {})
        required = set(fn.get("parameters", {}).get("required", []))
        if tool_format == "python":
            args = ", ".join(
                f"{p}: {_PY_TYPES.get(s.get('type'), 'str')}{'' if p in required else ' = None'}"
                for p, s in props.items()
            )
            lines.append(f'def {fn["name"]}({args}):\n    """{fn.get("description", "")}"""')
        else:
            args = ", ".join(p if p in required else f"{p}?" for p in props)
            lines.append(f"- {fn['name']}({args}): {fn.get('description', '')}")
    return "\n".join(lines)


_PY_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list", "object": "dict"}


def format_call(call: Any, syntax: CallSyntax) -> str:
    """Write a tool call in a call syntax (the exact text a demo or a distilled turn contains); values in Python
    syntax are Python literals (True, None), which the call parser reads back."""
    args = call.arguments
    if syntax == "json":
        return json.dumps({"name": call.name, "arguments": args})
    written = f"{call.name}({', '.join(f'{k}={python_literal(v)}' for k, v in args.items())})"
    return f"[{written}]" if syntax == "python_list" else written


def format_calls(calls: list[Any], syntax: CallSyntax) -> str:
    """The text of one reply holding these calls: one list under python_list (BFCL's ``[f(a=1), g(b=2)]``), else
    one call per line."""
    if syntax == "python_list":
        return "[" + ", ".join(format_call(c, "python") for c in calls) + "]"
    return "\n".join(format_call(c, syntax) for c in calls)


def diff(a: HCPConfig, b: HCPConfig) -> str:
    """A readable per-component diff from ``a`` to ``b``; empty when the contents are equal."""
    parts = []
    dumped_a, dumped_b = a.model_dump(mode="json"), b.model_dump(mode="json")
    for name in COMPONENTS:
        if dumped_a[name] == dumped_b[name]:
            continue
        old = yaml.safe_dump({name: dumped_a[name]}, sort_keys=False, width=120).splitlines()
        new = yaml.safe_dump({name: dumped_b[name]}, sort_keys=False, width=120).splitlines()
        body = difflib.unified_diff(old, new, f"{a.id}/{name}", f"{b.id}/{name}", lineterm="", n=2)
        parts.append("\n".join(body))
    return "\n".join(parts)
