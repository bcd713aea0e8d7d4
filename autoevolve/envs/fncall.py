"""FncallEnv: function-calling questions in the BFCL format, scored against their accepted answers without an LLM.

Each line of a data file is one question with the functions it may call (BFCL function docs, converted to the
OpenAI tool schema and offered as the task's own tools). Its ground truth lists, per expected call, the accepted
values of each argument; BFCL keeps it inline or in ``possible_answer/<same file name>`` beside the data file.
An episode records calls and finishes once as many were made as the ground truth expects.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from autoevolve.records import Message, Split, Task, ToolCall

SAMPLE = Path(__file__).parent / "data" / "bfcl_sample.jsonl"  # a tiny hand-written set, shipped with the package
SPLIT_ORDER: tuple[Split, ...] = ("test", "dev", "train")  # held-out splits stay put when only n_train changes
FALLBACK_SHARES = {"test": 0.2, "dev": 0.2}  # the rest trains, when the file is smaller than the asked sizes
OPTIONAL = ""  # BFCL's accepted value for "this parameter may be omitted"
TYPES: dict[str, str | None] = {  # BFCL type names, lower-cased, that JSON Schema spells otherwise
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "any": None,
    "": None,
    "bool": "boolean",
    "list": "array",
}
JSON_TYPES = {"string", "integer", "number", "boolean", "array", "object", "null"}
UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")  # OpenAI function names must match ^[a-zA-Z0-9_-]+$
MAX_MATCHED = 16  # recorded calls matched to expected ones; the assignment search is exponential in this
FIX = (
    "each line must be a JSON object with 'id', 'question' (a string, a list of messages, or a list of turns) and "
    "'function' (a BFCL function doc or a list of them); ground_truth must be a list of "
    "{function_name: {param: [accepted values]}} (multi-turn categories are not supported)"
)

Expected = tuple[str, dict[str, list[Any]]]  # one expected call: original name, accepted values per parameter


def to_openai_tools(functions: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """BFCL function docs as OpenAI tool specs, and the map from each safe tool name back to the original."""
    tools, names = [], {}
    for fn in functions:
        safe = _safe_name(fn["name"], names)
        names[safe] = fn["name"]
        params = _schema(fn.get("parameters") or {"type": "dict", "properties": {}})
        spec = {"name": safe, "description": fn.get("description", ""), "parameters": params}
        tools.append({"type": "function", "function": spec})
    return tools, names


def _safe_name(name: str, taken: dict[str, str]) -> str:
    """A name OpenAI accepts ('math.factorial' -> 'math_factorial'), made unique among the names taken."""
    base = UNSAFE.sub("_", name) or "function"
    safe, n = base, 1
    while safe in taken:
        n += 1
        safe = f"{base}_{n}"
    return safe


def _schema(node: dict[str, Any]) -> dict[str, Any]:
    """One BFCL parameter schema in JSON Schema terms, nested properties and items included."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            kind = str(value) if str(value) in JSON_TYPES else TYPES.get(str(value).lower(), str(value).lower())
            if kind is not None:  # 'any': no type, any JSON value
                # A type JSON Schema lacks (a Java class such as HashMap) is passed as a string, as BFCL does.
                out["type"] = kind if kind in JSON_TYPES else "string"
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = _schema(value)
        elif key != "optional":  # BFCL-only; 'required' already says it
            out[key] = value
    return out


def matches(got: Any, want: Any) -> bool:
    """BFCL equality: numbers numerically, strings case-insensitively and stripped, lists and dicts element-wise.

    A dict in an answer holds accepted values per key, as BFCL writes them ({'min': [300, 300.0], 'note': ['']}).
    """
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want  # True is not 1
    if isinstance(got, int | float) and isinstance(want, int | float):
        return float(got) == float(want)
    if isinstance(got, str) and isinstance(want, str):
        return got.strip().casefold() == want.strip().casefold()
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(matches(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        if set(got) - set(want):
            return False
        return all(accepts(got, key, _options(options)) for key, options in want.items())
    return got == want


def accepts(arguments: dict[str, Any], key: str, options: list[Any]) -> bool:
    """Whether an argument (or its absence) is one of the accepted values."""
    if key not in arguments:
        return OPTIONAL in options or not options  # a few BFCL answers accept [] (nothing): only omission can pass
    return any(matches(arguments[key], option) for option in options)


def _options(value: Any) -> list[Any]:
    """Accepted values of a dict-answer key: BFCL lists them; a bare value is the only one."""
    return value if isinstance(value, list) else [value]


def concrete(value: Any) -> Any:
    """A plain value from an accepted one: in nested dicts, each key's first non-optional option."""
    if isinstance(value, dict):
        picked = {k: _first(_options(v)) for k, v in value.items()}
        return {k: concrete(v) for k, v in picked.items() if v is not _OMIT}
    if isinstance(value, list):
        return [concrete(v) for v in value]
    return value


_OMIT = object()


def _first(options: list[Any]) -> Any:
    """The first accepted value that is not the omit mark, or _OMIT when omitting is the only option."""
    return next((o for o in options if not (isinstance(o, str) and o == OPTIONAL)), _OMIT)


def reference_arguments(params: dict[str, list[Any]]) -> dict[str, Any]:
    """The canonical arguments of an expected call: the first accepted non-empty value per parameter."""
    picked = {p: _first(options) for p, options in params.items()}
    return {p: concrete(v) for p, v in picked.items() if v is not _OMIT}


def _signature(tool: str, params: dict[str, list[Any]]) -> str:
    """'calculate_triangle_area(base=10, height=5)': an expected call written out, for feedback."""
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in reference_arguments(params).items())
    return f"{tool}({args})"


def _shown(options: list[Any]) -> str:
    """'one of [10, 10.0]', 'one of [5] or omitted', 'nothing (omit it)'."""
    values = [o for o in options if not (isinstance(o, str) and o == OPTIONAL)]
    if not values:
        return "nothing (omit it)"
    return f"one of {json.dumps(values)}" + (" or omitted" if len(values) < len(options) else "")


Check = tuple[bool, str]


class FncallEpisode:
    """One question in progress: the calls made so far and the fixed scorer."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.names: dict[str, str] = task.goal["names"]
        self.tool_of = {original: safe for safe, original in self.names.items()}
        self.expected: list[Expected] = [next(iter(call.items())) for call in task.goal["ground_truth"]]
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @property
    def finished(self) -> bool:
        """True once as many calls were made as the ground truth expects: no model call is needed after that."""
        return len(self.calls) >= len(self.expected)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Record a call and acknowledge it; the scorer judges it later."""
        self.calls.append((name, dict(arguments)))
        return json.dumps({"status": "ok", "function": name})

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """Fraction of checks met (function name, then each parameter), and one sentence per unmet check."""
        if not self.calls:
            wanted = " and ".join(self._signature(e) for e in self.expected)
            return 0.0, f"No function was called; expected {wanted}."
        pool = self.calls[:MAX_MATCHED]
        table = [[self._checks(e, c) for c in pool] for e in self.expected]
        missing = [self._checks(e) for e in self.expected]
        chosen = _assign(table, missing)
        checks = [c for i, pick in enumerate(chosen) for c in (missing[i] if pick is None else table[i][pick])]
        for i, (name, args) in enumerate(self.calls):
            if i not in chosen:
                shown = _signature(name, {k: [v] for k, v in args.items()})
                checks.append((False, f"The call {shown} was not expected."))
        reward = sum(ok for ok, _ in checks) / len(checks)
        return reward, " ".join(sentence for ok, sentence in checks if not ok and sentence)

    def _signature(self, expected: Expected) -> str:
        """An expected call as the model should write it (safe tool name, canonical arguments)."""
        name, params = expected
        return _signature(self.tool_of.get(name, name), params)

    def _checks(self, expected: Expected, call: tuple[str, dict[str, Any]] | None = None) -> list[Check]:
        """The checks of one expected call against one recorded call (None: no call was left for it)."""
        name, params = expected
        blank = [(False, "")] * len(params)  # parameters cannot be right when the call is missing or wrong
        if call is None:
            return [(False, f"Expected a call to {self._signature(expected)}; none was made.")] + blank
        called, args = call
        if self.names.get(called, called) != name:
            return [(False, f"Called {called} instead of {self._signature(expected)}.")] + blank
        tool = self.tool_of.get(name, name)
        checks: list[Check] = [(True, "")]
        for param, options in params.items():
            ok = accepts(args, param, options)
            got = f"was {json.dumps(args[param])}" if param in args else "is missing"
            checks.append((ok, f"Argument '{param}' of {tool} {got}; expected {_shown(options)}."))
        for param in args:
            if param not in params:
                checks.append((False, f"Argument '{param}' of {tool} was not expected."))
        return checks


def _assign(table: list[list[list[Check]]], missing: list[list[Check]]) -> list[int | None]:
    """For each expected call, the recorded call to score it against (None: none), in the best-scoring assignment.

    BFCL accepts parallel calls in any order, so the matching maximises checks met minus checks failed.
    """

    def value(checks: list[Check]) -> int:
        """Checks met minus checks failed."""
        return sum(1 if ok else -1 for ok, _ in checks)

    # Matching a call also spares it the failed check of an unexpected call, hence the +1.
    gains = [[value(checks) + 1 for checks in row] for row in table]

    n_calls = len(table[0]) if table else 0

    @cache
    def best(i: int, used: int) -> tuple[int, tuple[int | None, ...]]:
        """Best value and picks for expected calls i.. when the calls in the bit mask `used` are taken."""
        if i == len(table):
            return 0, ()
        rest, picks = best(i + 1, used)
        top = (value(missing[i]) + rest, (None, *picks))
        for j in range(n_calls):
            if not used & (1 << j):
                rest, picks = best(i + 1, used | (1 << j))
                top = max(top, (gains[i][j] + rest, (j, *picks)), key=lambda t: t[0])
        return top

    return list(best(0, 0)[1])


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSON-lines file; a bad line raises ValueError."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc}); {FIX}") from None
            if not isinstance(obj, dict) or "id" not in obj:
                raise ValueError(f"{path}:{number}: expected a JSON object with an 'id'; {FIX}")
            yield number, obj


def _request(question: Any, where: str) -> str:
    """The request text: every message's content in order, so earlier turns travel with the last user message."""
    if isinstance(question, str):
        return question
    flat = [m for turn in question for m in (turn if isinstance(turn, list) else [turn])]
    if not flat or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in flat):
        raise ValueError(f"{where}: 'question' must hold {{role, content}} messages; {FIX}")
    return "\n".join(m["content"] for m in flat)


def _ground_truth(value: Any, where: str) -> list[dict[str, dict[str, list[Any]]]]:
    """The ground truth, checked for BFCL's shape: a list of {function_name: {param: [accepted values]}}."""
    ok = isinstance(value, list) and value and all(isinstance(c, dict) and len(c) == 1 for c in value)
    calls = [next(iter(c.items())) for c in value] if ok else []
    ok = ok and all(
        isinstance(params, dict) and all(isinstance(v, list) for v in params.values()) for _, params in calls
    )
    if not ok:
        raise ValueError(f"{where}: bad ground_truth {json.dumps(value)[:120]}; {FIX}")
    return value


def _functions(value: Any, where: str) -> list[dict[str, Any]]:
    """The function docs of a line: a list of {name, description, parameters}, or one such dict."""
    functions = [value] if isinstance(value, dict) else value
    if not isinstance(functions, list) or not functions:
        raise ValueError(f"{where}: missing or empty 'function'; {FIX}")
    for fn in functions:
        if not (
            isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), dict)
        ):
            raise ValueError(f"{where}: each function needs a string 'name' and a 'parameters' object; {FIX}")
    return functions


class FncallEnv:
    """BFCL-format function-calling questions: seeded splits, task-specific tools, episodes and references."""

    name = "fncall"

    def __init__(
        self,
        path: str | Path,
        answers: str | Path | None = None,
        seed: int = 0,
        tiers: Sequence[int] = (1, 2),
        n_train: int = 256,
        n_dev: int = 64,
        n_test: int = 96,
    ) -> None:
        self.path, self.seed = Path(path), seed
        if not self.path.is_file():
            raise ValueError(f"no data file at {self.path}; point the env's path at a BFCL-format .json(l) file")
        default = self.path.parent / "possible_answer" / self.path.name
        self.answers = Path(answers) if answers is not None else (default if default.is_file() else None)
        if self.answers is not None and not self.answers.is_file():
            raise ValueError(f"no answers file at {self.answers}")
        sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        if min(sizes.values()) < 0:
            raise ValueError(f"split sizes must be >= 0, got {sizes}")
        self.skipped = 0  # questions with no ground truth anywhere (e.g. BFCL's irrelevance categories)
        wanted = set(tiers)
        usable = [t for t in self._load() if t.tier in wanted]
        if not usable:
            raise ValueError(f"{self.path}: no question with a ground truth and a tier in {tuple(tiers)}")
        self._splits = self._split(usable, sizes)

    def tasks(self, split: Split) -> list[Task]:
        """All tasks of a split, in file order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}")
        return list(self._splits[split])

    def tools(self) -> list[dict[str, Any]]:
        """No shared tools: every question brings its own (Task.tools)."""
        return []

    def start(self, task: Task) -> FncallEpisode:
        """A fresh episode with no calls made."""
        if task.env != self.name:
            raise ValueError(f"task {task.id} belongs to env {task.env!r}, not {self.name!r}")
        return FncallEpisode(task)

    def reference(self, task: Task) -> list[Message] | None:
        """The canonical conversation of a train task (request, each expected call, its acknowledgement)."""
        if task.split != "train":
            return None
        episode = self.start(task)
        messages = [Message(role="user", content=task.request)]
        for number, (name, params) in enumerate(episode.expected, start=1):
            call_id, tool, args = f"call_{number}", episode.tool_of.get(name, name), reference_arguments(params)
            messages.append(Message(role="assistant", tool_calls=[ToolCall.make(call_id, tool, args)]))
            messages.append(Message(role="tool", tool_call_id=call_id, content=episode.call(tool, args)))
        return messages

    def _load(self) -> list[Task]:
        """One task per question with a ground truth, in file order (split is set later)."""
        answers = {str(obj["id"]): (n, obj) for n, obj in _lines(self.answers)} if self.answers else {}
        tasks, seen = [], set()
        for number, obj in _lines(self.path):
            where = f"{self.path}:{number}"
            source = str(obj["id"])
            if source in seen:
                raise ValueError(f"{where}: duplicate id {source!r}; ids must be unique within a file")
            seen.add(source)
            if "ground_truth" not in obj and source not in answers:
                self.skipped += 1
                continue
            if "ground_truth" in obj:
                truth = _ground_truth(obj["ground_truth"], where)
            else:
                line, answer = answers[source]
                truth = _ground_truth(answer.get("ground_truth"), f"{self.answers}:{line}")
            if "question" not in obj:
                raise ValueError(f"{where}: missing 'question'; {FIX}")
            tools, names = to_openai_tools(_functions(obj.get("function"), where))
            for called, _ in (next(iter(c.items())) for c in truth):
                if called not in names.values():  # an answer naming a function the question does not offer
                    names[_safe_name(called, names)] = called
            tasks.append(
                Task(
                    id=f"fncall-{source}",
                    env=self.name,
                    split="train",
                    tier=1 if len(truth) == 1 else 2,
                    request=_request(obj["question"], where),
                    metadata={"bfcl_id": source},
                    goal={"ground_truth": truth, "names": names},
                    tools=tools,
                )
            )
        return tasks

    def _split(self, usable: list[Task], sizes: dict[str, int]) -> dict[str, list[Task]]:
        """Seeded shuffle, then test, dev and train slices; each split keeps file order."""
        if sum(sizes.values()) > len(usable):
            n_test, n_dev = (round(len(usable) * FALLBACK_SHARES[s]) for s in ("test", "dev"))
            sizes = {"test": n_test, "dev": n_dev, "train": len(usable) - n_test - n_dev}
        order = list(range(len(usable)))
        random.Random(f"fncall:{self.seed}").shuffle(order)
        splits, start = {}, 0
        for split in SPLIT_ORDER:
            picked = sorted(order[start : start + sizes[split]])
            start += sizes[split]
            splits[split] = [usable[i].model_copy(update={"split": split}) for i in picked]
        return splits
