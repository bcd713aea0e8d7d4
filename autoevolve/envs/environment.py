"""The environment protocol: tasks per split, the tools they may use, episodes to run them in, and a fixed scorer
that never evolves with the harness (the contract, with a walk-through: docs/environments.md)."""

from __future__ import annotations

from typing import Any, Protocol

from autoevolve.records import Message, Split, Task


class Episode(Protocol):
    """One task in progress: a private copy of the world that tool calls act on. While ``finished`` is False, the
    episode ends when the model answers without a call, or at the config's step limit."""

    finished: bool  # True once the episode needs no further model call (read after each tool call)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool and return its result as text (JSON is easiest for a model to read). A domain error is a result
        ({"error": "no such unit"}), not an exception: the model may recover. A tool the environment does not have
        raises KeyError: the rollout then ends with reward 0 and says so. Arguments arrive checked against the tool's
        schema. Any other exception is a bug in the environment: the run stops with one line naming it."""
        ...

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """The reward in [0, 1] from the episode's state and the conversation, and one sentence per unmet condition.
        Partial credit gives the search a gradient; the sentences tell the reflective mutator what was expected and
        what happened."""
        ...


class Environment(Protocol):
    """Tasks per split, the tools they may use, and episodes to run them in (the contract: docs/environments.md)."""

    name: str  # A short name ("units"). Task ids that start with neither name- nor name/ are stored as name/ID.

    def tasks(self, split: Split) -> list[Task]:
        """Every task of "train", "dev" or "test", in a fixed order: the same arguments give the same tasks. Splits
        are disjoint and ids are unique across them."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """The tools every task may use, in the OpenAI function schema ({"type": "function", "function": {name,
        description, parameters}}); a task may bring more of its own in Task.tools."""
        ...

    def start(self, task: Task) -> Episode:
        """A fresh episode: its own copy of whatever the tools change."""
        ...

    def reference(self, task: Task) -> list[Message] | None:
        """A labelled solution of a train task (the request, the calls and their results, the final reply), or None;
        dev and test tasks return None. A run's labelled budget reads these; it must score 1.0 (autoevolve check
        runs it)."""
        ...
