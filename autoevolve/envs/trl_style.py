"""TRLEnvironment: an environment written for TRL's ``GRPOTrainer(environment_factory=...)``, run by autoevolve.

TRL's protocol: the factory returns an instance with ``reset(**row) -> str | None`` (called with every column of
the dataset row; a returned string is appended to the last user message), public methods as tools (schemas from
their signatures and Google-style docstrings) and ``get_reward() -> float`` for the finished rollout. A tool that
raises answers ``str({'error': ...})``; a result reaches the model as ``str(result)``, exactly as under TRL. An
optional ``feedback() -> str`` method is not a tool: its sentences feed the reflective mutator.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

from autoevolve.envs.loading import load_object
from autoevolve.envs.taskfile import Columns, Row, parse_rows, read_rows, split_rows
from autoevolve.records import Message, Split, Task

NOT_TOOLS = ("reset", "get_reward", "feedback")  # public methods that are the protocol, not tools


def _settled(value: Any) -> Any:
    """A value, awaited when a method was async (TRL allows async tools and rewards)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def tool_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """The bound tool methods of an environment instance, found on its class as TRL finds them."""
    # Listed on the class: getmembers on the instance would evaluate properties.
    members = inspect.getmembers(type(instance), predicate=inspect.isfunction)
    return {n: getattr(instance, n) for n, _ in members if not n.startswith("_") and n not in NOT_TOOLS}


class TRLEpisode:
    """One rollout on its own environment instance; it ends when the model replies without a call."""

    finished = False

    def __init__(self, instance: Any, reward_range: tuple[float, float]) -> None:
        self.instance, self.reward_range = instance, reward_range
        self.methods = tool_methods(instance)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool method; its result, or the error it raised, as TRL gives it to the model."""
        if name not in self.methods:
            raise KeyError(name)
        try:
            result = _settled(self.methods[name](**arguments))
        except Exception as exc:  # TRL answers any failure of a tool with its message
            result = {"error": str(exc)}
        return str(result)

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """``get_reward()`` mapped from the reward range onto [0, 1], and the environment's feedback."""
        raw = _settled(self.instance.get_reward())
        if not isinstance(raw, Real) or math.isnan(float(raw)):
            name = type(self.instance).__name__
            raise ValueError(f"{name}.get_reward() returned {raw!r}; it must return a number (float), not NaN")
        low, high = self.reward_range
        reward = min(1.0, max(0.0, (float(raw) - low) / (high - low)))
        if callable(getattr(type(self.instance), "feedback", None)):
            return reward, str(_settled(self.instance.feedback()))
        if low == 0:
            return reward, f"The environment's reward was {float(raw):g} of {high:g}."
        return reward, f"The environment's reward was {float(raw):g} on a scale from {low:g} to {high:g}."


class TRLEnvironment:
    """Tasks from a task file, tools and rewards from a TRL environment class; seeded, deterministic splits."""

    def __init__(
        self,
        environment: str | Callable[[], Any],
        data: Path,
        name: str = "trl",
        columns: dict[str, str] | None = None,
        seed: int = 0,
        tiers: Sequence[int] = (1,),
        n_train: int = 256,
        n_dev: int = 64,
        n_test: int = 96,
        reward_range: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        self.name = name
        self.factory = load_object(environment) if isinstance(environment, str) else environment
        low, high = (float(v) for v in reward_range)
        if not high > low:
            raise ValueError(f"reward_range {tuple(reward_range)}: the first value must be below the second")
        self.reward_range = (low, high)
        self._probe = self.factory()  # as TRL does: one instance checked for the protocol, then used for requests
        label = type(self._probe).__name__
        for method, why in (
            ("reset", "TRL's protocol needs it"),
            ("get_reward", "autoevolve scores with the environment's own reward"),
        ):
            if not callable(getattr(type(self._probe), method, None)):
                raise ValueError(f"environment {label} has no {method}() method; {why}: add one")
        self._tools = [self._schema(label, n, m) for n, m in tool_methods(self._probe).items()]
        unknown = sorted(set(columns or {}) - set(Columns.model_fields))
        if unknown:
            raise ValueError(f"columns: unknown key {unknown[0]!r}; map any of {', '.join(Columns.model_fields)}")
        self.columns = Columns.model_validate(columns or {})
        where = str(data)
        wanted = set(tiers)  # filtered before the split, so the split sizes count usable tasks (as FncallEnv does)
        rows = [r for r in parse_rows(read_rows(data), self.columns, where=where) if r.tier in wanted]
        if not rows:
            raise ValueError(f"{where}: no row with a tier in {tuple(tiers)}")
        chosen = split_rows(rows, seed=seed, n_train=n_train, n_dev=n_dev, n_test=n_test)
        self._observations: dict[str, str] = {}
        self._references: dict[str, list[Message]] = {}
        self._splits = {s: [self._task(r, s, where) for r in picked] for s, picked in chosen.items()}

    def tasks(self, split: Split) -> list[Task]:
        """All tasks of a split, in file order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}")
        return list(self._splits[split])

    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas TRL would show the model, a fresh copy each call."""
        return copy.deepcopy(self._tools)

    def start(self, task: Task) -> TRLEpisode:
        """A fresh environment instance, reset with the task's row."""
        if task.env != self.name:
            raise ValueError(f"task {task.id} belongs to env {task.env!r}, not {self.name!r}")
        instance = self.factory()
        observation = self._observation(instance, task.goal["row"], task.id)
        expected = self._observations.get(task.id)
        if expected is not None and observation != expected:
            raise ValueError(
                f"task {task.id}: reset() returned another observation than when the task was made; the request "
                "shows it, so reset must give the same text for the same row (seed any randomness from the row)"
            )
        return TRLEpisode(instance, self.reward_range)

    def reference(self, task: Task) -> list[Message] | None:
        """For a train task with a reference in its row: the request followed by the reference messages."""
        messages = self._references.get(task.id) if task.split == "train" else None
        return None if messages is None else [Message(role="user", content=task.request), *messages]

    def _schema(self, label: str, name: str, method: Callable[..., Any]) -> dict[str, Any]:
        """A tool's schema, built by transformers from the method as TRL's chat template does."""
        from transformers.utils import get_json_schema

        try:
            return get_json_schema(method)
        except Exception as exc:  # TypeError or DocstringParsingException, depending on what is missing
            raise ValueError(
                f"tool {label}.{name}: {exc}; give every argument a type hint and the method a Google-style "
                "docstring with an Args: section (or name it with a leading '_' to keep it from the model)"
            ) from None

    def _observation(self, instance: Any, row: dict[str, Any], task_id: str) -> str:
        """What reset(**row) returns, as text ('' for None)."""
        observation = _settled(instance.reset(**row))
        if observation is not None and not isinstance(observation, str):
            raise ValueError(f"task {task_id}: reset() returned {type(observation).__name__}; return a string or None")
        return observation or ""

    def _task(self, row: Row, split: Split, where: str) -> Task:
        """The task of a row: its user message plus the reset observation, the system message as metadata."""
        system = [m["content"] for m in row.prompt if m["role"] == "system"]
        turns = [m for m in row.prompt if m["role"] != "system"]
        if len(turns) != 1 or len(system) > 1 or (system and row.prompt[0]["role"] != "system"):
            raise ValueError(
                f"{where}:{row.number}: column '{self.columns.prompt}' holds a multi-turn prompt; give at most one "
                "system message and one user message (fold earlier turns into the user message)"
            )
        task_id = f"{self.name}-{row.id}"
        observation = self._observation(self._probe, row.data, task_id)
        self._observations[task_id] = observation
        if row.reference is not None:
            self._references[task_id] = row.reference
        return Task(
            id=task_id,
            env=self.name,
            split=split,
            tier=row.tier,
            request=turns[0]["content"] + observation,  # appended as TRL appends it to the last user message
            metadata={"system": system[0]} if system else {},
            goal={"row": row.data},
        )
