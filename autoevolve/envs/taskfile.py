"""Task sets from ``datasets`` files: rows of a local JSONL / JSON / Parquet / CSV file (or a cached dataset),
checked row by row, and split into train, dev and test the same way for the same file and seed.

Rows are read with the ``datasets`` library, as TRL reads them, so an environment sees each row exactly as it
would under TRL. A row's prompt is a string or a list of {role, content} messages ending with a user message.
Rows count from 1 (a CSV's header is not a row); every error names ``file:row``, the column and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from autoevolve.records import Message, Split, ToolCall

READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> datasets builder
SPLIT_ORDER: tuple[Split, ...] = ("test", "dev", "train")  # held-out splits stay put when only n_train changes
FALLBACK_SHARES = {"test": 0.2, "dev": 0.2}  # the rest trains, when the file is smaller than the asked sizes
SPLIT_NAMES: dict[str, Split] = {"train": "train", "dev": "dev", "validation": "dev", "test": "test"}
PROMPT_ROLES = {"system", "user", "assistant"}
PROMPT_FIX = (
    "give a string or a list of {role, content} messages (roles system, user, assistant) ending with a user one"
)
REFERENCE_FIX = (
    "give a list of OpenAI-format messages: assistant ones with content and/or tool_calls "
    "[{id, type: 'function', function: {name, arguments}}], then tool ones with content and tool_call_id"
)


PACKAGE_FILE = re.compile(r"([A-Za-z_][\w.]*):([^:]+)")  # 'bfcl_eval:data/BFCL_v4_multiple.json'
PACKAGE_INSTALLS = {"bfcl_eval": "make bfcl (pip install --no-deps bfcl-eval)"}  # how to get packages a config reads


def data_file(spec: str | Path) -> Path:
    """A data file: a path, or 'package:relative/path' inside an installed Python package (found without importing
    it). ValueError names the file or package and how to get it."""
    text = str(spec)
    match = PACKAGE_FILE.fullmatch(text)
    if match is None or isinstance(spec, Path):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"no data file at {path}")
        return path
    package, inner = match.groups()
    found = importlib.util.find_spec(package.split(".")[0])
    if found is None or not found.submodule_search_locations:
        how = PACKAGE_INSTALLS.get(package, f"pip install {package}")
        raise ValueError(f"{text}: the package {package!r} is not installed; install it with {how}")
    path = Path(next(iter(found.submodule_search_locations)), *package.split(".")[1:], inner)
    if not path.is_file():
        raise ValueError(f"{text}: the installed package {package!r} has no file {inner} (looked at {path})")
    return path


@contextmanager
def _offline() -> Iterator[None]:
    """``datasets`` in offline mode: a run reads the local cache and never downloads data behind the user's back."""
    import datasets

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def read_rows(source: str | Path, *, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a local file (by suffix), or of ``split`` of a dataset already in the local HF cache."""
    import datasets

    path = Path(source)
    if path.is_file():
        kind = READERS.get(path.suffix.lower())
        if kind is None:
            raise ValueError(f"{path}: unknown file type {path.suffix!r}; give a {', '.join(READERS)} file")
        try:
            with _quiet():
                return datasets.load_dataset(kind, data_files=str(path), split="train").to_list()
        except Exception as exc:  # datasets and pyarrow raise many types for one cause: a file it cannot parse
            raise ValueError(f"{path}: cannot read it as {kind}: {type(exc).__name__}: {exc}") from None
    if path.suffix.lower() in READERS:
        raise ValueError(f"no file at {path}; give an existing {', '.join(READERS)} file or a cached dataset name")
    try:
        with _offline(), _quiet():
            return datasets.load_dataset(str(source), split=split).to_list()
    except Exception as exc:  # not cached shows up as ConnectionError, FileNotFoundError or DatasetNotFoundError
        raise ValueError(
            f"dataset {str(source)!r} (split {split!r}) is neither a file nor in the local HF cache ({exc}); "
            "download it first (datasets.load_dataset while online) or give a .jsonl/.json/.parquet/.csv file"
        ) from None


@contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars while reading: ``autoevolve check`` prints one line per problem on stderr, nothing else."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            enable_progress_bars()


class Columns(BaseModel):
    """Which column of a task file holds what; only ``prompt`` is required."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(default="prompt", description="A string, or {role, content} messages ending with a user one.")
    id: str | None = Field(default=None, description="Unique row ids; None: the row number.")
    tier: str | None = Field(default=None, description="Difficulty tier, a whole number >= 1; None: tier 1.")
    reference: str | None = Field(default=None, description="A solution: OpenAI-format messages after the prompt.")
    split: str | None = Field(default=None, description="train, dev (or validation) or test; None: a seeded split.")

    def check(self, rows: list[dict[str, Any]], where: str) -> None:
        """Every mapped column exists (ValueError naming the file, the column and the columns there are)."""
        if not rows:
            raise ValueError(f"{where}: no rows; a task file needs at least one")
        available = list(rows[0])
        for field, column in self.model_dump().items():
            if column is not None and column not in available:
                raise ValueError(
                    f"{where}: no column {column!r} (mapped as {field}); available columns: {', '.join(available)}"
                )


@dataclass(frozen=True)
class Row:
    """One checked row: its number in the file, id, tier, prompt messages, reference, split and every column."""

    number: int
    id: str
    tier: int
    prompt: list[dict[str, str]]
    reference: list[Message] | None
    split: Split | None
    data: dict[str, Any]


def parse_rows(rows: list[dict[str, Any]], columns: Columns, *, where: str) -> list[Row]:
    """Checked rows in file order; a malformed one raises ValueError '{file}:{row}: column ...: what; fix'."""
    columns.check(rows, where)
    out, seen = [], set()
    for number, data in enumerate(rows, start=1):
        at = f"{where}:{number}"
        row_id = str(number) if columns.id is None else _row_id(data[columns.id], at, columns.id)
        if row_id in seen:
            raise ValueError(f"{at}: column '{columns.id}': duplicate id {row_id!r}; ids must be unique in a file")
        seen.add(row_id)
        given = data[columns.reference] if columns.reference is not None else None  # None: this row has none
        reference = None if given is None else reference_messages(given, f"{at}: column '{columns.reference}'")
        out.append(
            Row(
                number=number,
                id=row_id,
                tier=1 if columns.tier is None else _tier(data[columns.tier], at, columns.tier),
                prompt=_prompt(data[columns.prompt], at, columns.prompt),
                reference=reference,
                split=None if columns.split is None else _split_name(data[columns.split], at, columns.split),
                data=data,
            )
        )
    return out


def _row_id(value: Any, at: str, column: str) -> str:
    """A row's id as text; empty or missing is an error."""
    if value is None or isinstance(value, bool) or not str(value).strip():
        raise ValueError(f"{at}: column '{column}': missing id {value!r}; give every row a unique, non-empty id")
    return str(value)


def _tier(value: Any, at: str, column: str) -> int:
    """A tier: a whole number >= 1 (2.0 counts: Parquet stores a column with gaps as floats)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        raise ValueError(f"{at}: column '{column}': tier {value!r} is not a positive integer; give 1, 2, 3, ...")
    return int(value)


def _split_name(value: Any, at: str, column: str) -> Split:
    """train, dev or test from a split cell ('validation' is dev)."""
    name = SPLIT_NAMES.get(str(value).strip().lower()) if isinstance(value, str) else None
    if name is None:
        raise ValueError(f"{at}: column '{column}': unknown split {value!r}; use train, dev (or validation) or test")
    return name


def _prompt(value: Any, at: str, column: str) -> list[dict[str, str]]:
    """The prompt as {role, content} messages; a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    ok = isinstance(value, list) and bool(value)
    ok = ok and all(
        isinstance(m, dict) and m.get("role") in PROMPT_ROLES and isinstance(m.get("content"), str) for m in value
    )
    if not ok or value[-1]["role"] != "user":
        what = "does not end with a user message" if ok else f"is not a string or a list of messages ({value!r:.80})"
        raise ValueError(f"{at}: column '{column}': the prompt {what}; {PROMPT_FIX}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def reference_messages(value: Any, where: str) -> list[Message]:
    """OpenAI-format messages (or their JSON text, as a CSV holds them) as autoevolve Messages; ValueError naming
    ``where`` and the message when one is malformed."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc}); {REFERENCE_FIX}") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {value!r:.80}; {REFERENCE_FIX}")
    out: list[Message] = []
    pending: list[str] = []  # ids of the last assistant message's calls that no tool message answered yet
    for i, message in enumerate(value, start=1):
        at = f"{where}: message {i}"
        role = message.get("role") if isinstance(message, dict) else None
        content = (message.get("content") or "") if isinstance(message, dict) else None  # None: calls only
        if role not in ("assistant", "tool") or not isinstance(content, str):
            raise ValueError(f"{at}: expected an assistant or tool message with text content; {REFERENCE_FIX}")
        if role == "assistant":
            made = sum(len(m.tool_calls) for m in out)  # numbers calls that have no id across the conversation
            calls = [_call(c, f"{at}: call {j}", made + j) for j, c in enumerate(message.get("tool_calls") or [], 1)]
            pending = [c.id for c in calls]
            out.append(Message(role="assistant", content=content, tool_calls=calls))
            continue
        call_id = message.get("tool_call_id") or (pending[0] if pending else None)
        if call_id is None:
            raise ValueError(f"{at}: a tool message that answers no call; {REFERENCE_FIX}")
        if call_id in pending:
            pending.remove(call_id)
        out.append(Message(role="tool", content=content, tool_call_id=str(call_id)))
    return out


def _call(call: Any, at: str, number: int) -> ToolCall:
    """One OpenAI-format tool call; arguments as a JSON string or an object."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    args = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            args = None
    elif isinstance(args, dict):
        # Arrow gives every row's arguments the union of all rows' keys, the missing ones set to None.
        args = {k: v for k, v in args.items() if v is not None}
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        raise ValueError(
            f"{at}: expected {{function: {{name, arguments}}}} with JSON-object arguments; {REFERENCE_FIX}"
        )
    return ToolCall.make(str(call.get("id") or f"call_{number}"), name, args)


def split_rows(rows: list[Row], *, seed: int, n_train: int, n_dev: int, n_test: int) -> dict[Split, list[Row]]:
    """Train, dev and test rows, each in file order: by the split column when mapped, else a seeded shuffle
    taking test, then dev, then train (shares of the file when it is smaller than the sizes asked)."""
    sizes: dict[Split, int] = {"train": n_train, "dev": n_dev, "test": n_test}
    if min(sizes.values()) < 0:
        raise ValueError(f"split sizes must be >= 0, got {sizes}")
    if any(r.split is not None for r in rows):
        # The column decides each row's split; a split with more rows than asked keeps a seeded sample of them.
        splits: dict[Split, list[Row]] = {}
        for split in SPLIT_ORDER:
            own = [i for i, r in enumerate(rows) if r.split == split]
            random.Random(f"taskfile:{seed}:{split}").shuffle(own)
            splits[split] = [rows[i] for i in sorted(own[: sizes[split]])]
        return splits
    picks = seeded_split(len(rows), sizes, f"taskfile:{seed}")
    return {split: [rows[i] for i in picked] for split, picked in picks.items()}


def seeded_split(n: int, sizes: dict[Split, int], salt: str) -> dict[Split, list[int]]:
    """Indices of n items per split: a shuffle seeded by ``salt``, sliced test, dev, then train (held-out splits
    stay put when only n_train changes), each split in item order; shares when n is smaller than the sizes."""
    if sum(sizes.values()) > n:
        n_test, n_dev = (round(n * FALLBACK_SHARES[s]) for s in ("test", "dev"))
        sizes = {"test": n_test, "dev": n_dev, "train": n - n_test - n_dev}
    order = list(range(n))
    random.Random(salt).shuffle(order)
    splits, start = {}, 0
    for split in SPLIT_ORDER:
        splits[split] = sorted(order[start : start + sizes[split]])
        start += sizes[split]
    return splits
