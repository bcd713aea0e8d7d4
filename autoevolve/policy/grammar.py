"""Constrained decoding of tool calls: a grammar built from a task's tool specs, applied token by token.

Under ``decoding.constrain: tool_call`` (an HCP component) every reply is a call of one of the offered functions in
the config's call syntax: argument names from the function's schema (required ones first, in schema order, then
any optional ones, in order), values of the declared types (enums as their listed values). A task that allows
several calls in one reply (``Task.metadata[PARALLEL_CALLS]``) gets a list of one or more calls.

The grammar is written in llguidance's Lark dialect and run by llguidance: a Rust matcher with no Python
dependencies, whose token mask over SmolLM2's 49k-token vocabulary takes a fraction of a millisecond on CPU
(``bench/rollout_throughput.py --grammar-only``). Of the other maintained libraries, xgrammar requires triton and
a TVM runtime, and outlines-core compiles regular expressions only (a nested argument value needs recursive
rules). JSON calls embed the functions' JSON schemas (``%json``); Python calls are written out rule by rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from autoevolve.harness.toolcall import python_literal
from autoevolve.policy import CallConstraint

MAX_OPTIONAL_FREE = 8  # optional parameters of a function with no required one, written as any ordered subset

STRING = r'/"([^"\\\n]|\\[^\n])*"/'
INTEGER = r"/-?(0|[1-9][0-9]*)/"
NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"
# Any Python literal a tool argument can hold (when the schema gives no type).
ANY_VALUE = f"""
value: string | number | "True" | "False" | "None" | list | dict
list: "[" (value (", " value)*)? "]"
dict: "{{" (string ": " value (", " string ": " value)*)? "}}"
string: {STRING}
number: {NUMBER}
"""


# A reply that is not a call: anything whose first character past any whitespace does not open a JSON call.
TEXT = r"TEXT: /\s*[^\s{\[][\s\S]*/" + "\n"

# JSON calls exactly as the harness writes them (json.dumps: ", " and ": ", no other whitespace). Flexible whitespace
# would let a model pad a call forever inside the grammar (a random model does, until max_tokens).
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lark(spec: CallConstraint) -> str:
    """The constraint as a grammar in llguidance's Lark dialect; ValueError when it offers no tool."""
    if spec.json_value is not None:
        return f"start: %json {json.dumps(spec.json_value | {'x-guidance': COMPACT})}\n"
    if not spec.tools:
        raise ValueError("decoding.constrain 'tool_call' needs tools to call, and this request offers none")
    functions = [t["function"] for t in spec.tools]
    plan = '("Plan: " /[^\\n]*/ "\\n")? ' if spec.plan_line else ""
    lines = 'call ("\\n" call)*' if spec.parallel else "call"  # several calls: one per line, as the harness writes
    if spec.syntax == "json":
        one = json_schema(spec.model_copy(update={"parallel": False})) | {"x-guidance": COMPACT}
        calls = f"{plan}{lines}\ncall: %json {json.dumps(one)}\n"
        return f"start: calls | TEXT\ncalls: {calls}{TEXT}" if spec.or_text else f"start: {calls}"
    if spec.or_text:
        raise ValueError(f"a reply of text or a call is held to its grammar in JSON call syntax, not {spec.syntax!r}")
    rules = [_python_function(i, fn) for i, fn in enumerate(functions)]
    one = " | ".join(f"f{i}" for i in range(len(rules)))
    if spec.syntax == "python_list":
        lines = '"[" call (", " call)* "]"' if spec.parallel else '"[" call "]"'
    return f"start: {plan}{lines}\ncall: {one}\n" + "\n".join(rules) + ANY_VALUE


def json_schema(spec: CallConstraint) -> dict[str, Any]:
    """The JSON schema of a reply in JSON call syntax: one call object of an offered function (a non-empty list of
    them when parallel: one JSON value, as a server's structured outputs take it)."""
    calls = {"anyOf": [_json_call(t["function"]) for t in spec.tools]}
    return {"type": "array", "items": calls, "minItems": 1} if spec.parallel else calls


def _json_call(fn: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call object: {"name": <this function>, "arguments": {...}}."""
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": _json_schema(_parameters(fn))},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """A parameter schema reduced to what a grammar enforces (type, enum, properties, required, items)."""
    out: dict[str, Any] = {}
    if node.get("type") in ("string", "integer", "number", "boolean", "array", "object", "null"):
        out["type"] = node["type"]
    if isinstance(node.get("enum"), list) and node["enum"]:
        out["enum"] = node["enum"]
    if isinstance(node.get("properties"), dict):
        out["properties"] = {k: _json_schema(v) for k, v in node["properties"].items() if isinstance(v, dict)}
        out["required"] = [r for r in node.get("required", []) if r in out["properties"]]
        out["additionalProperties"] = False
    if isinstance(node.get("items"), dict):
        out["items"] = _json_schema(node["items"])
    return out


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters object (an empty object schema when it has none)."""
    params = fn.get("parameters") or {}
    return {"type": "object", "properties": params.get("properties") or {}, "required": params.get("required") or []}


def _python_function(index: int, fn: dict[str, Any]) -> str:
    """Rules for one function: ``f<i>: "name(" arguments ")"`` and a value rule per parameter."""
    params = _parameters(fn)
    props: dict[str, Any] = params["properties"]
    required = [p for p in props if p in params["required"]]
    optional = [p for p in props if p not in required]
    rules, items = [], {}
    for j, (name, schema) in enumerate(props.items()):
        value = f"f{index}_p{j}"
        rules += _python_value(value, schema if isinstance(schema, dict) else {})
        items[name] = f'"{name}=" {value}'
    if required:
        body = ' ", " '.join(items[p] for p in required) + "".join(f' (", " {items[p]})?' for p in optional)
    else:
        body = _ordered_subset([items[p] for p in optional[:MAX_OPTIONAL_FREE]])
    name = json.dumps(f"{fn['name']}(")
    return "\n".join([f'f{index}: {name} {body} ")"', *rules])


def _ordered_subset(items: list[str]) -> str:
    """Any ordered subset of ``items`` (none included), comma-separated."""
    if not items:
        return ""
    options = []
    for i, first in enumerate(items):
        rest = "".join(f' (", " {item})?' for item in items[i + 1 :])
        options.append(f"{first}{rest}")
    return "(" + " | ".join(f"({o})" for o in options) + ")?"


def _python_value(rule: str, schema: dict[str, Any]) -> list[str]:
    """Rules for a Python literal of a JSON schema type, named ``rule`` (nested rules get suffixes)."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return [f"{rule}: " + " | ".join(json.dumps(python_literal(v)) for v in schema["enum"])]
    kind = schema.get("type")
    if kind == "string":
        return [f"{rule}: string"]
    if kind == "integer":
        return [f"{rule}: {INTEGER}"]
    if kind == "number":
        return [f"{rule}: number"]
    if kind == "boolean":
        return [f'{rule}: "True" | "False"']
    if kind == "array":
        item = f"{rule}_i"
        rules = _python_value(item, schema.get("items") or {})
        return [f'{rule}: "[" ({item} (", " {item})*)? "]"', *rules]
    if kind == "object" and schema.get("properties"):
        props = [(k, v) for k, v in schema["properties"].items() if isinstance(v, dict)]
        rules = []
        for j, (_, sub) in enumerate(props):
            rules += _python_value(f"{rule}_{j}", sub)
        entries = [f'"\\"{json.dumps(k)[1:-1]}\\": " {rule}_{j}' for j, (k, _) in enumerate(props)]
        return [f'{rule}: "{{" ({_ordered_subset(entries) or ""}) "}}"', *rules]
    if kind == "object":
        return [f"{rule}: dict"]
    return [f"{rule}: value"]


@dataclass
class Guide:
    """One row's matcher: which tokens may come next."""

    matcher: Any
    vocab: int

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place (one row); nothing once it failed."""
        if self.matcher.is_error():
            return
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        if allowed.shape[0] < logits.shape[-1]:
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))
        logits.masked_fill_(torch.from_numpy(~allowed[: logits.shape[-1]]).to(logits.device), float("-inf"))

    def take(self, tokens: list[int]) -> None:
        """Advance past tokens the model picked (under the mask, so the grammar accepts them)."""
        for token in tokens:
            if self.matcher.is_stopped() or self.matcher.is_error():
                return
            self.matcher.consume_token(token)


class Grammars:
    """Compiled tool-call grammars for one tokenizer; ``guide(spec)`` gives a fresh matcher for one row."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)  # a whole call ends with its EOS
        self.vocab = vocab
        self._compiled: dict[str, str] = {}

    def guide(self, spec: CallConstraint) -> Guide:
        """A matcher at the start of a reply under the constraint's grammar; ValueError if it does not compile."""
        key = spec.model_dump_json()
        if key not in self._compiled:
            grammar = self._llg.LLMatcher.grammar_from_lark(lark(spec))
            is_error, problems = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
            if is_error:
                what = "JSON schema" if spec.json_value is not None else "tool-call grammar"
                raise ValueError(f"the {what} does not compile: {'; '.join(problems)}")
            self._compiled[key] = grammar
        matcher = self._llg.LLMatcher(self.tokenizer, self._compiled[key], log_level=0)
        if matcher.is_error():
            raise ValueError(f"tool-call grammar: {matcher.get_error()}")
        return Guide(matcher, self.vocab)
