"""Parse tool calls out of model text, generously, and check their arguments against the tool schema.

Small models drift from any rigid format, so the parser takes the first JSON object in the text (with
``name``/``tool``/``function`` and ``arguments``/``parameters``) or a Python-style call of a known tool.
``parse_all`` reads every call of a reply instead, for tasks that allow several calls in one reply (BFCL's
parallel questions): a JSON list of call objects, call objects in a row, or Python calls such as
``[f(a=1), g(b="x")]``. A task opts in with ``Task.metadata[PARALLEL_CALLS] = True``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

PARALLEL_CALLS = "parallel_calls"  # Task.metadata key: True when one text reply may hold several calls, all run
TOOL_KEYS = ("name", "tool", "function")  # a JSON object with one of these keys is a call


class CallError(ValueError):
    """A tool call that cannot be run: unparseable, unknown tool, or bad arguments."""


def parse(text: str, tool_names: list[str]) -> tuple[str, dict[str, Any]] | None:
    """The (name, arguments) of the first tool call in ``text``; None when the text is a plain reply."""
    obj = _first_json_object(text)
    if obj is not None:
        return _from_json(obj)
    if "{" in text and re.search(r'"(name|tool|function)"\s*:', text):
        raise CallError(f"unparseable tool call: {clip(text)}")
    return next(_python_calls(text, tool_names), None)


def parse_all(text: str, tool_names: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every tool call in ``text``, in order: JSON calls (a list of them, or several in a row), else Python calls of
    known tools (``[f(a=1), g(b="x")]`` or one per line); [] for a plain reply. Its first call is ``parse``'s."""
    objects, rest = _json_calls(text)
    if objects:
        # A call the model began but that is not valid JSON must not vanish silently: the count would be wrong.
        if re.search(r'\{\s*"(name|tool|function)"\s*:', rest):
            raise CallError(f"unparseable tool call after {len(objects)} readable one(s): {clip(rest)}")
        return [_from_json(obj) for obj in objects]
    if "{" in text and re.search(r'"(name|tool|function)"\s*:', text):
        raise CallError(f"unparseable tool call: {clip(text)}")
    return list(_python_calls(text, tool_names))


def _json_calls(text: str) -> tuple[list[dict[str, Any]], str]:
    """The JSON call objects in the text (a list's items count one by one), and the text outside them."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    rest, end = [], 0
    for match in re.finditer(r"[\[{]", text):
        if match.start() < end:  # inside a value already read
            continue
        try:
            value, stop = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        items = value if isinstance(value, list) else [value]
        if items and all(_is_call(item) for item in items):
            calls += items
            rest.append(text[end : match.start()])
            end = stop
    rest.append(text[end:])
    return calls, " ".join(rest)


def _is_call(value: Any) -> bool:
    """Whether a JSON value is a call object (names a tool)."""
    return isinstance(value, dict) and any(k in value for k in TOOL_KEYS)


def _first_json_object(text: str) -> dict[str, Any] | None:
    """The first decodable JSON object in the text that names a tool."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if _is_call(obj):
            return obj
    return None


def _from_json(obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Read name and arguments from the usual JSON call shapes."""
    name = obj.get("name") or obj.get("tool") or obj.get("function")
    if isinstance(name, dict):  # {"function": {"name": ..., "arguments": ...}}
        obj, name = name, name.get("name")
    args = obj.get("arguments", obj.get("parameters", obj.get("args", {})))
    if isinstance(args, str):  # the OpenAI wire format carries arguments as a JSON string
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as exc:
            raise CallError(f"arguments of {name!r} are not valid JSON: {exc}") from None
    if not isinstance(name, str) or not isinstance(args, dict):
        raise CallError(f"tool call needs a string name and an object of arguments, got {clip(json.dumps(obj))}")
    return name, args


def _python_calls(text: str, tool_names: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Calls like ``book_table(restaurant_id="R-1", party_size=2)`` of known tools, in order (lazily: ``parse``
    stops at the first, so a broken later call does not fail it)."""
    after = 0
    for match in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", text):
        if match.group(1) not in tool_names or match.start() < after:
            continue
        end = _closing_paren(text, match.end() - 1)
        if end is None:
            raise CallError(f"unparseable tool call: {clip(text[match.start() :])}")
        try:
            call = ast.parse(text[match.start() : end + 1], mode="eval").body
            assert isinstance(call, ast.Call) and not call.args
            args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        except (SyntaxError, ValueError, AssertionError):
            raise CallError(f"unparseable tool call: {clip(text[match.start() : end + 1])}") from None
        after = end + 1
        yield match.group(1), args


def _closing_paren(text: str, start: int) -> int | None:
    """Index of the parenthesis closing the one at ``start``, skipping quoted strings."""
    depth, quote = 0, None
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = None if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    return None


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def check_arguments(spec: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Validate arguments against a tool's JSON schema; integers written as digit strings are accepted."""
    params = spec["function"].get("parameters", {})
    props: dict[str, Any] = params.get("properties", {})
    name = spec["function"]["name"]
    missing = [p for p in params.get("required", []) if p not in args]
    if missing:
        raise CallError(f"{name}: missing required argument(s) {', '.join(missing)}")
    unknown = [a for a in args if a not in props]
    if unknown:
        raise CallError(f"{name}: unknown argument(s) {', '.join(unknown)} (expected {', '.join(props)})")
    clean = {}
    for key, value in args.items():
        kind = props[key].get("type", "string")
        if kind == "integer" and isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        ok = isinstance(value, _JSON_TYPES.get(kind, (object,)))
        if not ok or (kind in ("integer", "number") and isinstance(value, bool)):
            raise CallError(f"{name}: argument {key} should be {kind}, got {value!r}")
        clean[key] = value
    return clean


def clip(text: str, limit: int = 160) -> str:
    """Text on one line, shortened to ``limit`` characters (for error messages and prompts)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def python_literal(value: Any) -> str:
    """A JSON value as the Python literal a call in Python syntax holds: True, None, "text", [1, 2], {"k": 1}."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)
