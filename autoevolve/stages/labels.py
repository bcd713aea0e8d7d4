"""The labelled set: which train tasks' reference solutions a run may read, and the config that shows them.

With ``labels.budget: N`` in a run config, N train tasks carry labels and the rest are unlabelled: the loop may roll
those out and score them with the environment's scorer, never read their references. The N are the first N of one
seeded order that takes the strata (tier, task kind) in turn, each shuffled by the run's seed, so every prefix is
balanced over kinds and the set of a smaller budget lies inside a larger one's: label-efficiency curves compare
nested sets. The labelled references are the only demos stage 1 may show and enter stage 3 beside the kept wins,
re-rendered under the original config like every kept rollout.
"""

from __future__ import annotations

import random
from collections import defaultdict
from itertools import islice

from autoevolve.envs import Environment
from autoevolve.harness.hcp import Demo, Demos, HCPConfig
from autoevolve.records import Message, Task


def stratum(task: Task) -> tuple[int, str]:
    """What a labelled draw balances over: the tier and the task's kind (``kind`` in its goal or metadata, if any)."""
    return task.tier, str(task.goal.get("kind") or task.metadata.get("kind") or "")


def labelled_order(env: Environment, seed: int, tiers: list[int] | None = None) -> list[Task]:
    """Train tasks (of some tiers) in labelling order: one of each stratum in turn, each stratum seeded-shuffled."""
    strata: dict[tuple[int, str], list[Task]] = defaultdict(list)
    for task in env.tasks("train"):
        if tiers is None or task.tier in tiers:
            strata[stratum(task)].append(task)
    rng = random.Random(f"labels:{seed}")
    keys = sorted(strata)
    for key in keys:
        rng.shuffle(strata[key])
    rng.shuffle(keys)  # which stratum leads is part of the draw
    order: list[Task] = []
    for depth in range(max((len(v) for v in strata.values()), default=0)):
        order += [strata[key][depth] for key in keys if depth < len(strata[key])]
    return order


def labelled_tasks(env: Environment, budget: int, seed: int, tiers: list[int] | None = None) -> list[Task]:
    """The first ``budget`` tasks of the labelling order that have a reference, sorted by id."""
    chosen = islice((t for t in labelled_order(env, seed, tiers) if env.reference(t)), budget)
    return sorted(chosen, key=lambda t: t.id)


def references(env: Environment, tasks: list[Task]) -> dict[str, list[Message]]:
    """Each labelled task's reference conversation, by task id."""
    out = {}
    for task in tasks:
        messages = env.reference(task)
        if not messages:
            raise ValueError(f"task {task.id} has no reference solution, so it cannot be labelled")
        out[task.id] = messages
    return out


def demos_config(original: HCPConfig, refs: dict[str, list[Message]], k: int, style: str) -> HCPConfig:
    """The original config showing the labelled references as demos, the k nearest per task (never its own):
    in-context learning from the labels alone, the teacher a search starts from."""
    items = [Demo(task_id=task_id, messages=messages) for task_id, messages in sorted(refs.items())]
    demos = Demos(items=items, select="nearest", k=max(1, min(k, len(items))), style=style)  # type: ignore[arg-type]
    return original.model_copy(update={"demos": demos, "name": f"{original.name}+labels"})
