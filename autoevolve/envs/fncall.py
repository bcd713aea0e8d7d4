"""FncallEnv: function-calling questions in the BFCL format, scored against their accepted answers without an LLM.

Each line of a data file is one question with the functions it may call (BFCL function docs, converted to the
OpenAI tool schema and offered as the task's own tools). Its ground truth lists, per expected call, the accepted
values of each argument; BFCL keeps it inline or in ``possible_answer/<same file name>`` beside the data file.
An episode records calls and finishes once as many were made as the ground truth expects.

A question's BFCL category comes from its id (``Task.metadata["category"]``). In the parallel categories
(``parallel``, ``parallel_multiple`` and their live forms) the task allows several calls in one text reply
(``Task.metadata[PARALLEL_CALLS]``), the episode ends with that reply, and it is scored as BFCL does: a wrong count
of calls scores 0, and each expected call must be matched, in any order, by its own call. Questions this
environment cannot score (multi-turn, memory and web search, no ground truth) are skipped and counted per reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from autoevolve.envs.bfcl_scoring import (
    Check,
    accepts,
    assign,
    category_of,
    is_parallel,
    no_truth_reason,
    reference_arguments,
    shown,
    signature,
    skip_reason,
)
from autoevolve.envs.taskfile import data_file, seeded_split
from autoevolve.harness.toolcall import PARALLEL_CALLS
from autoevolve.records import Message, Split, Task, ToolCall

SAMPLE = Path(__file__).parent / "data" / "bfcl_sample.jsonl"  # a tiny hand-written set, shipped with the package
PARALLEL = Path(__file__).parent / "data" / "bfcl_parallel_sample.jsonl"  # parallel questions, hand-written
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
    "{function_name: {param: [accepted values]}} (multi-turn, memory and web-search questions are skipped)"
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


class FncallEpisode:
    """One question in progress: the calls made so far and the fixed scorer."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.names: dict[str, str] = task.goal["names"]
        self.tool_of = {original: safe for safe, original in self.names.items()}
        self.expected: list[Expected] = [next(iter(call.items())) for call in task.goal["ground_truth"]]
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.parallel = bool(task.metadata.get(PARALLEL_CALLS))  # BFCL's parallel rule: all calls in one reply

    @property
    def finished(self) -> bool:
        """True once no model call is needed: as many calls were made as the ground truth expects, or, for a
        parallel question, once a reply made calls (BFCL scores that one reply)."""
        return bool(self.calls) if self.parallel else len(self.calls) >= len(self.expected)

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
        chosen = assign(table, missing)
        picked = [missing[i] if pick is None else table[i][pick] for i, pick in enumerate(chosen)]
        checks = [c for row in picked for c in row]
        extra = [f"The call {_written(call)} was not expected." for i, call in enumerate(self.calls) if i not in chosen]
        checks += [(False, sentence) for sentence in extra]
        reward = sum(ok for ok, _ in checks) / len(checks)
        if not self.parallel:
            return reward, " ".join(sentence for ok, sentence in checks if not ok and sentence)
        unmatched = [self._unmatched(e, pick, row) for e, pick, row in zip(self.expected, chosen, picked, strict=True)]
        feedback = [sentence for sentence in unmatched if sentence] + extra
        made, needed = len(self.calls), len(self.expected)
        if made != needed:  # BFCL: "wrong count", whatever the calls are
            count = (
                f"The reply made {made} call{'s' if made != 1 else ''} but the question needs exactly {needed}, "
                "all in one reply; a wrong count of calls scores 0."
            )
            return 0.0, " ".join([count, *feedback])
        return reward, " ".join(feedback)

    def _unmatched(self, expected: Expected, pick: int | None, checks: list[Check]) -> str:
        """Why no call of a parallel reply matched an expected call, naming it and the closest call ('' if matched)."""
        wanted = self._signature(expected)
        if pick is None:
            return f"Expected {wanted}, but no call in the reply was left for it."
        if all(ok for ok, _ in checks):
            return ""
        closest = _written(self.calls[pick])
        if not checks[0][0]:
            return f"No call in the reply matched {wanted} (the closest, {closest}, calls another function)."
        why = " ".join(sentence for ok, sentence in checks if not ok and sentence)
        return f"No call in the reply matched {wanted}; in the closest, {closest}: {why}"

    def _signature(self, expected: Expected) -> str:
        """An expected call as the model should write it (safe tool name, canonical arguments)."""
        name, params = expected
        return signature(self.tool_of.get(name, name), params)

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
            checks.append((ok, f"Argument '{param}' of {tool} {got}; expected {shown(options)}."))
        for param in args:
            if param not in params:
                checks.append((False, f"Argument '{param}' of {tool} was not expected."))
        return checks


def _written(call: tuple[str, dict[str, Any]]) -> str:
    """A recorded call written out as the model made it: 'math_gcd(a=12, b=18)'."""
    name, args = call
    return f"{name}({', '.join(f'{k}={json.dumps(v)}' for k, v in args.items())})"


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


def _metadata(source: str, category: str) -> dict[str, Any]:
    """A question's metadata: its BFCL id and category, and whether one reply may hold several calls."""
    parallel = {PARALLEL_CALLS: True} if is_parallel(category) else {}
    return {"bfcl_id": source, "category": category, **parallel}


def _answers_of(path: Path, answers: str | Path | None) -> Path | None:
    """A data file's answers file: the one named, else ``possible_answer/<same name>`` beside it if present."""
    if answers is not None:
        if not Path(answers).is_file():
            raise ValueError(f"no answers file at {answers}")
        return Path(answers)
    default = path.parent / "possible_answer" / path.name
    return default if default.is_file() else None


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
        path: str | Path | list[str | Path],
        answers: str | Path | None = None,
        seed: int = 0,
        tiers: Sequence[int] = (1, 2),
        n_train: int = 256,
        n_dev: int = 64,
        n_test: int = 96,
    ) -> None:
        paths = [data_file(p) for p in (path if isinstance(path, list) else [path])]
        if not paths:
            raise ValueError("path is an empty list; name one BFCL-format data file or more")
        if answers is not None and len(paths) > 1:
            raise ValueError("answers names one file, for one data file: leave it out to read each data file's own")
        self.paths, self.seed = paths, seed
        sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        if min(sizes.values()) < 0:
            raise ValueError(f"split sizes must be >= 0, got {sizes}")
        self.skipped: dict[str, int] = {}  # questions left out, per reason (see notes())
        by_file: dict[Split, list[list[Task]]] = {"train": [], "dev": [], "test": []}
        seen: set[str] = set()
        for file in paths:
            usable = [t for t in self._load(file, _answers_of(file, answers), seen) if t.tier in set(tiers)]
            if not usable:
                skips = f" ({'; '.join(self.notes())})" if self.skipped else ""
                raise ValueError(f"{file}: no question with a ground truth and a tier in {tuple(tiers)}{skips}")
            # Each file is split on its own (the split of one file never depends on the others).
            salt = f"fncall:{seed}" if len(paths) == 1 else f"fncall:{seed}:{file.name}"
            for split, picked in seeded_split(len(usable), sizes, salt).items():
                by_file[split].append([usable[i].model_copy(update={"split": split}) for i in picked])
        self._splits: dict[Split, list[Task]] = {split: _spread(lists) for split, lists in by_file.items()}

    def notes(self) -> list[str]:
        """One line per reason questions were skipped: 'skipped 4 questions: no ground truth (...)'."""
        return [f"skipped {n} question{'s' if n != 1 else ''}: {reason}" for reason, n in self.skipped.items()]

    def tasks(self, split: Split) -> list[Task]:
        """All tasks of a split, the files' tasks spread evenly (see ``_spread``)."""
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
        """The canonical conversation of a train task: the request, then each expected call and its acknowledgement
        (a parallel question's calls all in one assistant message, then their acknowledgements)."""
        if task.split != "train":
            return None
        episode = self.start(task)
        calls = [
            ToolCall.make(f"call_{number}", episode.tool_of.get(name, name), reference_arguments(params))
            for number, (name, params) in enumerate(episode.expected, start=1)
        ]
        messages = [Message(role="user", content=task.request)]
        for group in [calls] if episode.parallel else [[call] for call in calls]:
            messages.append(Message(role="assistant", tool_calls=group))
            for call in group:
                ack = episode.call(call.name, call.arguments)
                messages.append(Message(role="tool", tool_call_id=call.id, content=ack))
        return messages

    def _load(self, path: Path, answers_file: Path | None, seen: set[str]) -> list[Task]:
        """One task per question of a file it can score, in file order (split is set later); the others counted in
        skipped. ``seen`` holds the ids read so far, from every file."""
        answers = {str(obj["id"]): (n, obj) for n, obj in _lines(answers_file)} if answers_file else {}
        tasks = []
        for number, obj in _lines(path):
            where = f"{path}:{number}"
            source = str(obj["id"])
            if source in seen:
                raise ValueError(f"{where}: duplicate id {source!r}; ids must be unique across the data files")
            seen.add(source)
            category = category_of(source)
            reason = skip_reason(category, obj)
            if reason is None and "ground_truth" not in obj and source not in answers:
                reason = no_truth_reason(category)
            if reason is not None:
                self.skipped[reason] = self.skipped.get(reason, 0) + 1
                continue
            if "ground_truth" in obj:
                truth = _ground_truth(obj["ground_truth"], where)
            else:
                line, answer = answers[source]
                truth = _ground_truth(answer.get("ground_truth"), f"{answers_file}:{line}")
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
                    metadata=_metadata(source, category),
                    goal={"ground_truth": truth, "names": names},
                    tools=tools,
                )
            )
        return tasks


def _spread(lists: list[list[Task]]) -> list[Task]:
    """Several files' tasks in one order where each file's are spread evenly (each file's own order kept), so the
    first N tasks of a split, which a stage or the gate may read, hold every file's share of them."""
    placed = [((i + 0.5) / len(tasks), f, task) for f, tasks in enumerate(lists) for i, task in enumerate(tasks)]
    return [task for *_, task in sorted(placed, key=lambda p: p[:2])]
