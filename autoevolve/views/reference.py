"""Reference tables in the docs, generated from the code they describe, so they cannot drift from it.

A doc marks a generated section with ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; ``refresh`` rewrites
every such section from ``SECTIONS`` (the ``Task`` fields, the ``Episode`` and ``Environment`` members, the HCP config's
fields and components, its placeholders). The test suite checks the docs are up to date.

Run: python -m autoevolve.views.reference docs/environments.md docs/hcp.md   (rewrites them in place)
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from autoevolve.envs import Environment, Episode
from autoevolve.harness.hcp import PLACEHOLDERS, Decoding, Demos, HCPConfig, Memory, Sampling, Scaffold
from autoevolve.records import Task

MARK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


def _type(annotation: Any) -> str:
    """A field's type as a reader writes it: 'str', 'list[dict]', 'int', a Literal's choices."""
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"\b[a-z_.]*\.([A-Z]\w*)", r"\1", text).replace("|", "\\|")


def fields(model: type[BaseModel], skip: tuple[str, ...] = ("schema_version",)) -> str:
    """A model's fields: name, type, required or its default, and the field's description."""
    rows = ["| field | type | default | what |", "| --- | --- | --- | --- |"]
    for name, f in model.model_fields.items():
        if name in skip:
            continue
        value = f.default_factory() if f.default_factory else f.default  # type: ignore[call-arg]
        what = " ".join((f.description or "").split()).replace("|", "\\|")
        if f.is_required():
            default = "required"
        elif isinstance(value, BaseModel):  # a component: its own table
            default = f"see `{type(value).__name__}`"
            what = what or " ".join((type(value).__doc__ or "").split())
        else:
            default = "" if value is PydanticUndefined else f"`{value!r}`"
        rows.append(f"| `{name}` | {_type(f.annotation)} | {default} | {what} |")
    return "\n".join(rows)


def members(protocol: type) -> str:
    """A protocol's members: each method's signature (or attribute's type) and its docstring."""
    rows = ["| member | what it must do |", "| --- | --- |"]
    hints = typing.get_type_hints(protocol)
    for name, hint in hints.items():
        rows.append(f"| `{name}: {_type(hint)}` | {_doc_of_attribute(protocol, name)} |")
    for name, fn in inspect.getmembers(protocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        signature = str(inspect.signature(fn)).replace("self, ", "").replace("(self)", "()")
        signature = re.sub(r"'([^']*)'", r"\1", signature).replace("|", "\\|")
        rows.append(f"| `{name}{signature}` | {' '.join((fn.__doc__ or '').split())} |")
    return "\n".join(rows)


def _doc_of_attribute(protocol: type, name: str) -> str:
    """The comment after a protocol attribute's annotation (``finished: bool  # ...``)."""
    source = inspect.getsource(protocol)
    found = re.search(rf"^\s*{name}:[^#\n]*#\s*(.*)$", source, re.M)
    return found.group(1).strip() if found else ""


def placeholders() -> str:
    """The system-prompt placeholders the harness fills."""
    what = {
        "tools": "the offered tools, rendered as `tool_format` says (empty for native tools)",
        "call_format": "how to write a call in `call_syntax`",
        "memory": "the task's metadata through `memory.template` (when `memory.position` is `system`)",
        "routing": "the `routing` component's text",
    }
    rows = [f"| `{{{p}}}` | {what[p]} |" for p in PLACEHOLDERS]
    return "\n".join(["| placeholder | filled with |", "| --- | --- |", *rows])


SECTIONS: dict[str, Callable[[], str]] = {
    "task-fields": lambda: fields(Task),
    "environment-members": lambda: members(Environment),
    "episode-members": lambda: members(Episode),
    "hcp-fields": lambda: fields(HCPConfig),
    "demos-fields": lambda: fields(Demos),
    "memory-fields": lambda: fields(Memory),
    "sampling-fields": lambda: fields(Sampling),
    "scaffold-fields": lambda: fields(Scaffold),
    "decoding-fields": lambda: fields(Decoding),
    "placeholders": placeholders,
}


def refresh(text: str) -> str:
    """The text with every generated section rewritten from the code (KeyError naming an unknown section)."""
    return MARK.sub(lambda m: f"{m.group(1)}{SECTIONS[m.group(2)]()}\n{m.group(4)}", text)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(refresh(path.read_text()))
        print(f"refreshed {path}")
