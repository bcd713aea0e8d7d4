"""An environment's own faults, caught where they happen: the method, the task and the exception in one line.

A rollout treats the model's failures as data (reward 0 and the reason), but an exception from the environment's
code (its ``start``, a tool's ``call`` other than an unknown tool's KeyError, ``score``, a malformed score) is a bug
to fix, not a score: ``EnvironmentFault`` says which method raised on which task. ``probe`` runs an environment with
no model, as ``autoevolve check`` does: a few tasks of each split, each train task's reference through a real episode
(it must score the maximum, 1.0) and a reply that calls a tool the task does not have, then gives up (the call may
raise KeyError, as the protocol says of an unknown tool, or answer with text; the score must be in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from autoevolve.envs import SPLITS, Environment, Episode
from autoevolve.records import Message, Task, ToolCall

T = TypeVar("T")
UNKNOWN_TOOL = "no_such_tool"  # the probe's bad call


class EnvironmentFault(RuntimeError):
    """The environment's code raised (or returned what the protocol does not allow) in a method, on a task."""

    def __init__(self, env: str, method: str, task_id: str | None, what: str) -> None:
        where = f" on task {task_id}" if task_id else ""
        super().__init__(f"env {env}: {method}{where}: {' '.join(what.split())[:400]}")


def attempt(env: str, method: str, task_id: str | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; any exception becomes an EnvironmentFault naming the method and the task."""
    try:
        return fn(*args)
    except EnvironmentFault:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the environment's code raised, said in one line
        raise EnvironmentFault(env, method, task_id, f"{type(exc).__name__}: {exc}") from exc


class GuardedEpisode:
    """An episode whose faults are EnvironmentFaults; an unknown tool still raises KeyError (the protocol's)."""

    def __init__(self, episode: Episode, env: str, task: Task) -> None:
        self.episode, self.env, self.task = episode, env, task

    @property
    def finished(self) -> bool:
        """The episode's own ``finished``."""
        return bool(attempt(self.env, "finished", self.task.id, getattr, self.episode, "finished"))

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool; a KeyError (an unknown tool) passes through, any other exception is a fault."""
        try:
            return self.episode.call(name, arguments)
        except KeyError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise EnvironmentFault(self.env, f"call({name})", self.task.id, f"{type(exc).__name__}: {exc}") from exc

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """The episode's score, checked: a reward in [0, 1] and a feedback string."""
        got = attempt(self.env, "score", self.task.id, self.episode.score, messages)
        ok = isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], str)
        if not ok or not isinstance(got[0], int | float) or not 0.0 <= got[0] <= 1.0:
            raise EnvironmentFault(self.env, "score", self.task.id, f"returned {got!r}, not (reward in [0, 1], text)")
        return float(got[0]), got[1]


def start(env: Environment, task: Task) -> GuardedEpisode:
    """A fresh guarded episode of the task."""
    return GuardedEpisode(attempt(env.name, "start", task.id, env.start, task), env.name, task)


def probe(env: Environment, per_split: int = 3) -> str:
    """Run the environment without a model (see the module docstring); one line of what was checked, or an
    EnvironmentFault naming what failed."""
    references = replies = 0
    for split in SPLITS:
        tasks = attempt(env.name, "tasks", None, env.tasks, split)[:per_split]
        for task in tasks:
            reference = attempt(env.name, "reference", task.id, env.reference, task)
            if reference:
                episode = start(env, task)
                for call in (c for m in reference for c in m.tool_calls):
                    try:
                        episode.call(call.name, call.arguments)
                    except KeyError:
                        what = f"calls unknown tool {call.name!r}"
                        raise EnvironmentFault(env.name, "reference", task.id, what) from None
                reward, feedback = episode.score(reference)
                if reward < 1.0:
                    raise EnvironmentFault(env.name, "score", task.id, f"its reference scores {reward}: {feedback}")
                references += 1
            episode, bad = start(env, task), ToolCall.make("call_probe", UNKNOWN_TOOL, {})
            try:
                result = episode.call(bad.name, bad.arguments)
            except KeyError:
                result = f"unknown tool {UNKNOWN_TOOL!r}"
            if not isinstance(result, str):
                what = f"returned {result!r}, not text (an unknown tool raises KeyError)"
                raise EnvironmentFault(env.name, f"call({UNKNOWN_TOOL})", task.id, what)
            messages = [
                Message(role="user", content=task.request),
                Message(role="assistant", tool_calls=[bad]),
                Message(role="tool", content=result, tool_call_id=bad.id),
                Message(role="assistant", content="I can't."),
            ]
            episode.score(messages)
            replies += 1
    return f"{references} references scored 1.0 and {replies} replies with an unknown call scored in [0, 1]"
