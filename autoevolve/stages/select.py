"""Stage 2, trajectory selection: keep evolved-config rollouts that beat the original config on the same task.

Per task, each evolved config's mean reward over its samples is compared with the original config's mean; a
config that beats it by more than the margin contributes its best samples (distinct conversations, each reaching
``min_reward``), up to ``max_per_task``. With ``best_of`` > 1 a sampled copy of each tier's best config (its
temperature raised) adds that many samples on each task of that tier the original has not solved, each of which
wins on its own reward: rejection sampling against the environment's own scorer, so a round whose search moved
little still finds rollouts that beat the live adapter. Their sample numbers start at ``round * best_of``, so
each round draws new ones. Then no tier may keep more than ``tier_ratio`` times the items of the harder tier
with the fewest, so easy tasks do not dominate and a hard tier is never cut to make room for an easy one. Each
item names the baseline rollout it beat (the original's lowest-reward sample), which also makes the (chosen,
rejected) pairs for preference training.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict

from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Message, SelectedTrajectory, Selection, Task, Trajectory
from autoevolve.stages.settings import SelectSettings
from autoevolve.stats import mean


def select(
    bench: Workbench,
    original: HCPConfig,
    evolved: list[HCPConfig],
    tasks: list[Task],
    settings: SelectSettings | None = None,
    *,
    adapter: str = "",
    sampled: dict[int, HCPConfig] | None = None,
) -> Selection:
    """Pair rollouts per task and keep the evolved ones that beat the original's (see the module docstring).

    ``evolved`` lists the configs whose rollouts may be kept, best first: the best config is rolled out on
    every task ``settings.samples`` times; rollouts of the others already in the store (from the search) are used as
    they are; ``sampled`` (tier -> config, if given) is rolled out ``settings.best_of`` times on that tier's unsolved
    tasks. A kept rollout must reach ``settings.min_reward``: partial successes would teach the adapter their mistakes.
    """
    s = settings or SelectSettings()
    samples, best_of = s.samples, s.best_of
    baseline = _by_task(bench.rollouts(original, tasks, adapter=adapter, stage="select", samples=samples))
    pools = [bench.rollouts(evolved[0], tasks, adapter=adapter, stage="select", samples=samples)]
    ids = [t.id for t in tasks]
    pools += [bench.store.trajectories(bench.run_id, hcp_id=h.id, adapter=adapter, task_ids=ids) for h in evolved[1:]]
    by_config = [_by_task(pool) for pool in pools]
    draws: dict[str, list[Trajectory]] = {}
    unsolved = [t for t in tasks if mean([b.reward for b in baseline[t.id]]) < 1.0]  # nothing beats a full score
    first = bench.round * best_of
    for tier, config in sorted((sampled or {}).items()):
        todo = [t for t in unsolved if t.tier == tier]
        if todo:
            draws |= _by_task(bench.rollouts(config, todo, adapter, "select", samples=best_of, first_sample=first))
    tiers = {t.id: t.tier for t in tasks}
    kept: list[tuple[Trajectory, Trajectory]] = []
    for task_id, base in sorted(baseline.items()):
        bar = mean([t.reward for t in base]) + s.margin
        winners = [trajs[task_id] for trajs in by_config if mean([t.reward for t in trajs.get(task_id, [])]) > bar]
        wins = [t for trajs in winners for t in trajs]  # a config wins by its mean: one lucky sample is not a win
        wins += [t for t in draws.get(task_id, []) if t.reward > bar]  # a rejection sample wins on its own
        worst = min(base, key=lambda t: t.reward)  # first of equals
        kept += [(t, worst) for t in _best_distinct(wins, s.min_reward, s.max_per_task)]
    kept = _balance(kept, tiers, s.tier_ratio)
    items = [_item(win, base) for win, base in kept]
    selection = Selection(
        id=_selection_id(bench.run_id, bench.round, items),
        run_id=bench.run_id,
        round=bench.round,
        baseline_hcp_id=original.id,
        evolved_hcp_id=evolved[0].id,
        adapter=adapter,
        items=items,
    )
    bench.store.put_selection(selection)
    return selection


def _best_distinct(wins: list[Trajectory], min_reward: float, limit: int) -> list[Trajectory]:
    """Up to ``limit`` highest-reward rollouts (shorter first among equals), no two with the same conversation."""
    out, seen = [], set()
    for t in sorted(wins, key=lambda t: (-t.reward, len(t.messages))):  # stable: the best config's come first
        text = json.dumps([m.model_dump(exclude={"tool_calls"}) | {"calls": _calls(m)} for m in t.messages])
        if t.reward < min_reward or text in seen:
            continue
        seen.add(text)
        out.append(t)
        if len(out) == limit:
            break
    return out


def _calls(message: Message) -> list[tuple[str, str]]:
    """A message's calls without their ids (ids differ between otherwise identical conversations)."""
    return [(c.name, json.dumps(c.arguments, sort_keys=True)) for c in message.tool_calls]


def _balance(
    kept: list[tuple[Trajectory, Trajectory]], tiers: dict[str, int], ratio: float | None
) -> list[tuple[Trajectory, Trajectory]]:
    """Cap each tier at ``ratio`` x the count of the harder tier (higher number) with the fewest items, keeping
    the largest gains over the baseline: easy wins never crowd out hard ones, and the hardest tier is never cut."""
    if ratio is None:
        return kept
    by_tier: dict[int, list[tuple[Trajectory, Trajectory]]] = defaultdict(list)
    for pair in kept:
        by_tier[tiers[pair[0].task_id]].append(pair)
    out = []
    for tier, pairs in by_tier.items():
        harder = [len(v) for t, v in by_tier.items() if t > tier]
        cap = max(1, math.floor(ratio * min(harder))) if harder else len(pairs)
        out += sorted(pairs, key=lambda p: (p[1].reward - p[0].reward, p[0].task_id))[:cap]
    return sorted(out, key=lambda p: (p[0].task_id, -p[0].reward))


def _item(win: Trajectory, base: Trajectory) -> SelectedTrajectory:
    """The record of one kept rollout and the baseline rollout it beat."""
    return SelectedTrajectory(
        task_id=win.task_id,
        hcp_id=win.hcp_id,
        adapter=win.adapter,
        sample=win.sample,
        reward=win.reward,
        baseline_hcp_id=base.hcp_id,
        baseline_sample=base.sample,
        baseline_reward=base.reward,
    )


def _by_task(trajs: list[Trajectory]) -> dict[str, list[Trajectory]]:
    """Rollouts grouped by task, in their order."""
    out: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        out[t.task_id].append(t)
    return out


def _selection_id(run_id: str, round: int, items: list[SelectedTrajectory]) -> str:
    """A content id: the same run, round and kept rollouts give the same selection id."""
    body = json.dumps([run_id, round, [i.model_dump() for i in items]], sort_keys=True)
    return "sel-" + hashlib.sha256(body.encode()).hexdigest()[:12]
