"""Environments: tasks, tools and a fixed scorer. The scorer never evolves with the harness."""

from __future__ import annotations

from typing import Any, Protocol

from autoevolve.envs import loading
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


def make_env(name: str = "life", *, loader: str | None = None, **args: Any) -> Environment:
    """Build an environment by registered name (or ``loader``: 'module:factory', 'file.py:factory'), passing
    ``args`` to its factory (a name the factory does not take raises EnvLoadError)."""
    return build_env(name, loader, args)


def build_env(
    name: str,
    loader: str | None,
    args: dict[str, Any],
    common: dict[str, Any] | None = None,
    explicit: frozenset[str] | set[str] = frozenset(),
) -> Environment:
    """Build an environment: ``args`` all go to its factory, ``common`` settings only where its signature takes them
    (one of ``explicit`` it does not take is an error); task ids are namespaced by the environment's name."""
    factory = loading.factory_of(name, loader)
    env = loading.build(factory, loading.arguments(factory, args, common or {}, explicit))
    try:
        return namespaced(env)
    except loading.EnvLoadError:
        raise
    except ValueError as exc:  # its tasks could not be listed (bad data, a malformed Task)
        raise loading.EnvLoadError(f"env: {env.name}: listing its tasks failed: {' '.join(str(exc).split())}") from None
    except Exception as exc:  # noqa: BLE001 - the environment's own bug in tasks(), said in one line
        what = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise loading.EnvLoadError(f"env {env.name}: tasks: {what}") from None


def namespaced(env: Environment) -> Environment:
    """The environment itself when its task ids start with its name ('life-1-00001'), else it under ids that do
    ('shop/17'): the store keys rollouts by task id, so two environments' ids must never collide."""
    ids = [t.id for split in SPLITS for t in env.tasks(split)]
    if len(set(ids)) < len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise loading.EnvLoadError(f"env {env.name}: task id {twice!r} appears twice; ids must be unique across splits")
    if all(i.startswith((f"{env.name}-", f"{env.name}/")) for i in ids):
        return env
    return Namespaced(env)


class Namespaced:
    """An environment seen through task ids prefixed with its name; everything else is the environment's own."""

    def __init__(self, env: Environment) -> None:
        self.env, self.name = env, env.name

    def tasks(self, split: Split) -> list[Task]:
        """The environment's tasks under 'name/id' ids."""
        return [t.model_copy(update={"id": f"{self.name}/{t.id}", "env": self.name}) for t in self.env.tasks(split)]

    def tools(self) -> list[dict[str, Any]]:
        """The environment's tools."""
        return self.env.tools()

    def start(self, task: Task) -> Episode:
        """The environment's episode for the task under its own id."""
        return self.env.start(self._own(task))

    def reference(self, task: Task) -> list[Message] | None:
        """The environment's reference for the task under its own id."""
        return self.env.reference(self._own(task))

    def _own(self, task: Task) -> Task:
        """The task as the environment made it."""
        return task.model_copy(update={"id": task.id.removeprefix(f"{self.name}/")})

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.env, attr)  # optional extras (notes(), skipped, ...) stay reachable


SPLITS: tuple[Split, ...] = ("train", "dev", "test")
