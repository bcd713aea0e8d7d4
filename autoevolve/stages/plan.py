"""Which tasks a round works on: the tiers in play, and train tasks drawn from the live adapter's frontier.

Without a curriculum every round works on the same seeded draw of the environment's train tasks. With one, a
round first rolls out the live adapter A_r under the original config on dev tasks of the tiers in play; while the
last tier in play scores at least ``unlock_at``, the next tier enters play (tiers never leave). Then A_r runs on a
pool of train tasks balanced over the tiers in play: the tasks it fails or only partly solves are the frontier,
where the round's headroom is. Stage 1's minibatches and stage 2's pairs are drawn from it (``frontier_share`` of
them, the rest from what A_r solves), with a seed of the round's own, so a round after a rejection works on other
tasks. Those rollouts are the ones the gate and stage 2 would make anyway (A_r + original), so the store reuses
them. The plan is a record: what was drawn, and why, stays in the store and the report.
"""

from __future__ import annotations

import random
from collections import defaultdict

from autoevolve.envs import Environment
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Split, Task, TaskPlan
from autoevolve.stages.settings import CurriculumSettings
from autoevolve.stats import mean


def in_play(tasks: list[Task], tiers: list[int]) -> list[Task]:
    """The tasks of the tiers in play, in their order."""
    return [t for t in tasks if t.tier in tiers]


def split_tasks(bench: Workbench, split: Split, tiers: list[int], n: int) -> list[Task]:
    """The first n tasks of a split among the tiers in play (splits interleave tiers, so these stay balanced)."""
    return in_play(bench.env.tasks(split), tiers)[:n]


def seeded_train(
    env: Environment, n: int, seed: int, tiers: list[int] | None = None, exclude: frozenset[str] = frozenset()
) -> list[Task]:
    """The first n train tasks (of some tiers, none of ``exclude``) of a seeded shuffle: a smaller n gives a prefix
    of a larger one's."""
    pool = [t for t in env.tasks("train") if (tiers is None or t.tier in tiers) and t.id not in exclude]
    random.Random(seed).shuffle(pool)
    return pool[:n]


def train_tasks(env: Environment, n: int, seed: int) -> list[Task]:
    """The first n train tasks of a seeded shuffle, sorted by id: a smaller n gives a subset of a larger one's."""
    return sorted(seeded_train(env, n, seed), key=lambda t: t.id)


def fixed_plan(bench: Workbench, n: int, seed: int, exclude: frozenset[str] = frozenset()) -> TaskPlan:
    """No curriculum: every tier of the environment, the same seeded train tasks every round (none of ``exclude``,
    the labelled ones)."""
    tiers = sorted({t.tier for t in bench.env.tasks("train")})
    drawn = seeded_train(bench.env, n, seed, exclude=exclude)
    unlabelled = (
        f" of the {len(bench.env.tasks('train')) - len(exclude)} unlabelled ones ({len(exclude)} labelled)"
        if exclude
        else ""
    )
    return TaskPlan(
        run_id=bench.run_id,
        round=bench.round,
        tiers=tiers,
        train=[t.id for t in drawn],
        why=f"no curriculum: the environment's tiers and a fixed seeded draw of {len(drawn)} train tasks{unlabelled}",
    )


def plan(
    bench: Workbench,
    original: HCPConfig,
    adapter: str,
    settings: CurriculumSettings,
    n: int,
    seed: int,
    tiers_before: list[int] | None = None,
    exclude: frozenset[str] = frozenset(),
) -> TaskPlan:
    """The round's tiers and n train tasks from A_r's frontier (see the module docstring); the pool holds none of
    ``exclude`` (the labelled tasks)."""
    tiers = list(tiers_before or settings.tiers[:1])
    scores: dict[str, float] = {}
    while True:
        for tier in tiers:
            if str(tier) not in scores:
                dev = split_tasks(bench, "dev", [tier], settings.dev_tasks)
                trajs = bench.rollouts(original, dev, adapter=adapter, stage="plan")
                scores[str(tier)] = mean([t.reward for t in trajs])
        later = [t for t in settings.tiers if t not in tiers]
        if not later or scores[str(tiers[-1])] < settings.unlock_at:
            break
        tiers.append(later[0])
    pool = _balanced(bench, tiers, settings.pool, seed, exclude)
    rewards = {t.task_id: t.reward for t in bench.rollouts(original, pool, adapter=adapter, stage="plan")}
    frontier = [t for t in pool if rewards[t.id] < 1.0]
    solved = [t for t in pool if rewards[t.id] >= 1.0]
    rng = random.Random(f"{seed}:{bench.round}")  # a later round (after a rejection too) draws other tasks
    rng.shuffle(frontier)
    rng.shuffle(solved)
    take = min(len(frontier), round(settings.frontier_share * n))
    drawn = frontier[:take] + solved[: n - take]
    drawn += frontier[take : take + n - len(drawn)]  # too few solved: more of the frontier
    rng.shuffle(drawn)  # every prefix (stage 1's, stage 2's) holds about the same share
    shown = ", ".join(f"tier {k} {v:.2f}" for k, v in scores.items())
    hard = sum(rewards[t.id] < 1.0 for t in drawn)
    why = (
        f"tiers in play {tiers} (unlock at {settings.unlock_at:.2f}; {adapter or 'base'} + original on dev: {shown}); "
        f"frontier {len(frontier)} of {len(pool)} pool tasks; drew {hard} frontier and {len(drawn) - hard} solved"
    )
    return TaskPlan(
        run_id=bench.run_id,
        round=bench.round,
        adapter=adapter,
        tiers=tiers,
        dev_scores=scores,
        pool=rewards,
        frontier=sorted(t.id for t in frontier),
        train=[t.id for t in drawn],
        why=why,
    )


def _balanced(bench: Workbench, tiers: list[int], n: int, seed: int, exclude: frozenset[str]) -> list[Task]:
    """n train tasks taken in turn from each tier's seeded shuffle (the same pool in every round)."""
    by_tier: dict[int, list[Task]] = defaultdict(list)
    for task in seeded_train(bench.env, len(bench.env.tasks("train")), seed, tiers, exclude):
        by_tier[task.tier].append(task)
    out: list[Task] = []
    depth = 0
    while len(out) < n and any(depth < len(v) for v in by_tier.values()):
        out += [by_tier[tier][depth] for tier in tiers if depth < len(by_tier[tier])][: n - len(out)]
        depth += 1
    return out


def train_of(bench: Workbench, task_plan: TaskPlan, n: int) -> list[Task]:
    """The first n of a plan's train tasks, sorted by id (the order stages have always used)."""
    by_id = {t.id: t for t in bench.env.tasks("train")}
    return sorted((by_id[i] for i in task_plan.train[:n]), key=lambda t: t.id)
