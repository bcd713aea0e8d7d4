"""Mutators: each proposes a child HCP config from a parent and the evidence gathered so far.

A mutator changes components of the config and nothing else; the environment's scorer is out of its reach.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from autoevolve.hcp import CallSyntax, Demo, Demos, HCPConfig, ToolFormat
from autoevolve.records import Message, Task, Trajectory


@dataclass
class Evidence:
    """What a mutator may read: this round's train rollouts, the train tasks, labelled train solutions."""

    trajectories: list[Trajectory]
    tasks: dict[str, Task]
    reference: Callable[[Task], list[Message] | None] = field(default=lambda task: None)


class Mutator(Protocol):
    """Proposes a child config. Raises ValueError when it has nothing new to propose."""

    name: str
    component: str

    def propose(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """A child of ``parent`` differing in this mutator's component."""
        ...


class DemoBootstrap:
    """Few-shot demos from successful train rollouts (the model's own), topped up with labelled solutions.

    As in DSPy's bootstrapping, labelled train examples seed the first demo set when the model has no
    successes yet; later proposals prefer trajectories the model itself completed with full reward.
    """

    name = "demos"
    component = "demos"

    def __init__(
        self, pool: int = 12, ks: tuple[int, ...] = (2, 3), styles: tuple[str, ...] = ("full", "first_call")
    ) -> None:
        self.pool, self.ks, self.styles = pool, ks, styles

    def propose(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Parent with a fresh demo set retrieved per task by similarity."""
        own = _successes(evidence.trajectories)
        chosen = rng.sample(own, min(self.pool, len(own)))
        taken = {d.task_id for d in chosen}
        spare = [t for t in evidence.tasks.values() if t.id not in taken]
        rng.shuffle(spare)
        for task in spare:
            if len(chosen) >= self.pool:
                break
            messages = evidence.reference(task)
            if messages:
                chosen.append(Demo(task_id=task.id, messages=messages))
        if not chosen:
            raise ValueError("no successful train rollouts and no labelled solutions to take demos from")
        chosen.sort(key=lambda d: d.task_id)  # the order is fixed by content, not by draw order
        demos = Demos(items=chosen, select="nearest", k=rng.choice(self.ks), style=rng.choice(self.styles))
        return parent.model_copy(update={"demos": demos})


def _successes(trajs: list[Trajectory]) -> list[Demo]:
    """One demo per task from full-reward, error-free rollouts (the shortest conversation wins)."""
    best: dict[str, Trajectory] = {}
    for t in trajs:
        if t.reward < 1.0 or t.error:
            continue
        if t.task_id not in best or len(t.messages) < len(best[t.task_id].messages):
            best[t.task_id] = t
    return [Demo(task_id=t.task_id, messages=t.messages) for t in sorted(best.values(), key=lambda t: t.task_id)]


PRESENTATIONS: list[tuple[ToolFormat, CallSyntax]] = [
    ("json", "json"),
    ("compact", "json"),
    ("python", "python"),
    ("python", "json"),
    ("compact", "python"),
]


class ToolPresentation:
    """Another way of showing the tools (JSON schema, Python signatures, compact list) with a call syntax."""

    name = "tool_format"
    component = "tool_format"

    def propose(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Parent with a different (tool format, call syntax) pair, and demo style toggled half the time."""
        options = [p for p in PRESENTATIONS if p != (parent.tool_format, parent.call_syntax)]
        tool_format, call_syntax = rng.choice(options)
        update: dict = {"tool_format": tool_format, "call_syntax": call_syntax}
        if parent.demos.items and rng.random() < 0.5:
            style = "first_call" if parent.demos.style == "full" else "full"
            update["demos"] = parent.demos.model_copy(update={"style": style})
        return parent.model_copy(update=update)


MUTATORS: dict[str, Callable[..., Mutator]] = {"demos": DemoBootstrap, "tool_format": ToolPresentation}


def make_mutators(
    names: list[str],
    demo_pool: int,
    demo_k: tuple[int, ...] = (2, 3),
    demo_styles: tuple[str, ...] = ("full", "first_call"),
) -> list[Mutator]:
    """Mutators by name, in the order given."""
    demos = DemoBootstrap(pool=demo_pool, ks=demo_k, styles=demo_styles)
    return [demos if n == "demos" else MUTATORS[n]() for n in names]


def keep_frozen(parent: HCPConfig, child: HCPConfig, frozen: list[str]) -> HCPConfig:
    """The child with every frozen component copied back from the parent."""
    if not frozen:
        return child
    return child.model_copy(update={name: getattr(parent, name) for name in frozen})
