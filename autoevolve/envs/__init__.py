"""Environments: tasks, tools and a fixed scorer. The scorer never evolves with the harness."""

from __future__ import annotations

from typing import Any, Protocol

from autoevolve.records import Message, Split, Task


class Episode(Protocol):
    """One task in progress: a private copy of the world that tool calls act on."""

    finished: bool  # True once the episode needs no further model call (checked after each tool call)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool and return its result as text (JSON). Domain errors are results, not exceptions."""
        ...

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """Reward in [0, 1] from the world's final state and the reply, and one sentence per unmet condition."""
        ...


class Environment(Protocol):
    """Tasks per split, the tools they may use, and episodes to run them in."""

    name: str

    def tasks(self, split: Split) -> list[Task]:
        """All tasks of a split, in a fixed order. Splits are disjoint."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """Tool specs in the OpenAI function schema ({'type': 'function', 'function': {...}})."""
        ...

    def start(self, task: Task) -> Episode:
        """A fresh episode for a task."""
        ...

    def reference(self, task: Task) -> list[Message] | None:
        """A labelled solution for a train task (few-shot bootstrapping); None for dev and test tasks."""
        ...


def make_env(name: str, **options: Any) -> Environment:
    """Build an environment by name."""
    if name == "life":
        from autoevolve.envs.life import LifeEnv

        return LifeEnv(**options)
    if name == "fncall":
        from autoevolve.envs.fncall import FncallEnv

        return FncallEnv(**options)
    if name == "router":
        from autoevolve.envs.routing import RouterEnv

        return RouterEnv(**options)
    raise ValueError(f"unknown environment {name!r} (known: life, fncall, router)")
