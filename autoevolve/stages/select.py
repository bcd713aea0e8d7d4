"""Stage 2, trajectory selection: keep evolved-config rollouts that beat the original config on the same task.

Per task, each evolved config's mean reward over its samples is compared with the original config's mean; a
config that beats it by more than the margin contributes its best samples (distinct conversations, each reaching
``min_reward``), up to ``max_per_task``. With ``best_of`` > 1 a sampled copy of each tier's best config (its
temperature raised) adds that many samples on each task of that tier not won yet, each of which wins on its own
reward: rejection sampling against the environment's own scorer, so a round whose search moved little still finds
rollouts that beat the live adapter. With a rollout budget (``select.rollouts``), harvest passes follow: the tier's
sampled config on the tasks still not won, pass after pass, until the budget is spent; with ``own_demos`` each pass
shows, as nearest demos, the full-reward rollouts won so far, so the teacher grows with its own wins. A round's
samples are numbered from ``round * ROUND_SAMPLES``, so each round draws new ones. The original config is rolled
out only where something won (the rest has nothing to pair), and a task it is known to solve (its rollouts stored
before, by a curriculum's plan) is not sampled. With ``unpaired_after``, neither is a won task of a tier where the
original's stored train and dev rollouts (stage 1's dev scores) already cover that many tasks and solve none: its
wins beat the original's rate there, and the rollouts pairing would cost are saved. Then no tier may keep more than
``tier_ratio`` times the items of the harder tier with the fewest, so easy tasks do not dominate and a hard tier is
never cut to make room for an easy one. Each item names the baseline rollout it beat (the original's lowest-reward
sample; sample -1 and the tier's rate when unpaired), which also makes the (chosen, rejected) pairs for preference
training.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections import defaultdict
from typing import NamedTuple

from autoevolve.harness.hcp import Demo, HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Message, SelectedTrajectory, Selection, Split, Task, Trajectory
from autoevolve.stages.settings import SelectSettings
from autoevolve.stats import mean

ROUND_SAMPLES = 100_000  # a round's samples are numbered from round x this: best_of's first, then the passes'


def select(
    bench: Workbench,
    original: HCPConfig,
    evolved: list[HCPConfig],
    tasks: list[Task],
    settings: SelectSettings | None = None,
    *,
    adapter: str = "",
    sampled: dict[int, HCPConfig] | None = None,
    budget: int | None = None,
) -> Selection:
    """Pair rollouts per task and keep the evolved ones that beat the original's (see the module docstring).

    ``evolved`` lists the configs whose rollouts may be kept, best first: the best config is rolled out on
    every task ``settings.samples`` times; rollouts of the others already in the store (from the search) are used as
    they are; ``sampled`` (tier -> config, if given) is rolled out ``settings.best_of`` times on that tier's open
    tasks. With a ``budget``, harvest passes follow until it is spent (``harvest``). A kept rollout must reach
    ``settings.min_reward``: partial successes would teach the adapter their mistakes.
    """
    s = settings or SelectSettings()
    ids = [t.id for t in tasks]
    pools = [bench.rollouts(evolved[0], tasks, adapter=adapter, stage="select", samples=s.samples)]
    pools += [bench.store.trajectories(bench.run_id, hcp_id=h.id, adapter=adapter, task_ids=ids) for h in evolved[1:]]
    by_config = [_by_task(pool) for pool in pools]
    draws: dict[str, list[Trajectory]] = defaultdict(list)
    solved = _solved(bench, original, adapter, ids, s.samples)
    first = bench.round * ROUND_SAMPLES

    def won() -> list[Trajectory]:  # full-reward rollouts so far, the best config's first
        rolled = [t for pool in pools for t in pool] + [t for v in draws.values() for t in v]
        return [t for t in rolled if t.reward >= s.min_reward and not t.error]

    def open_tasks(tier: int | None = None) -> list[Task]:  # not won yet, and not known solved by the original
        done = solved | {t.task_id for t in won()}
        return [t for t in tasks if t.id not in done and tier in (None, t.tier)]

    for tier, config in sorted((sampled or {}).items()):
        for t in bench.rollouts(config, open_tasks(tier), adapter, "select", samples=s.best_of, first_sample=first):
            draws[t.task_id].append(t)
    if budget is not None:
        left = budget - len(tasks) * s.samples - sum(len(v) for v in draws.values())
        configs = {t.tier: (sampled or {}).get(t.tier) or evolved[0].sampled(s.temperature) for t in tasks}
        demos = won() if s.own_demos else None
        for t in harvest(bench, configs, open_tasks(), left, adapter, first + s.best_of, s.min_reward, demos):
            draws[t.task_id].append(t)
    candidates = {t.task_id for t in won()}
    unsolved = _unsolved_tiers(bench, original, adapter, s) if s.unpaired_after else {}
    in_play = [t for t in tasks if t.id in candidates]  # the original is rolled out where something may beat it
    paired = [t for t in in_play if t.tier not in unsolved]
    baseline = {
        task: [Beaten(t.hcp_id, t.sample, t.reward) for t in base]
        for task, base in _by_task(bench.rollouts(original, paired, adapter, "select", samples=s.samples)).items()
    }
    baseline |= {t.id: [Beaten(original.id, -1, unsolved[t.tier])] for t in in_play if t.tier in unsolved}
    tiers = {t.id: t.tier for t in tasks}
    kept: list[tuple[Trajectory, Beaten]] = []
    for task_id, base in sorted(baseline.items()):
        bar = mean([b.reward for b in base]) + s.margin
        winners = [trajs[task_id] for trajs in by_config if mean([t.reward for t in trajs.get(task_id, [])]) > bar]
        wins = [t for trajs in winners for t in trajs]  # a config wins by its mean: one lucky sample is not a win
        wins += [t for t in draws.get(task_id, []) if t.reward > bar]  # a sample wins on its own
        worst = min(base, key=lambda b: b.reward)  # first of equals
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


def harvest(
    bench: Workbench,
    configs: dict[int, HCPConfig],
    todo: list[Task],
    budget: int,
    adapter: str,
    first_sample: int,
    min_reward: float,
    demos: list[Trajectory] | None = None,
) -> list[Trajectory]:
    """Sampled passes over the tasks not yet won, each under its tier's config, until ``budget`` rollouts are made
    or every task is won (reaches ``min_reward``). Given ``demos`` (full-reward rollouts), a config that picks its
    demos by nearness picks among them and each pass's wins too: a request phrased unlike every labelled demo finds
    a win phrased like it."""
    made: list[Trajectory] = []
    shown = [Demo(task_id=t.task_id, messages=t.messages) for t in demos or []]
    for number in itertools.count():  # each pass makes at least one rollout: the budget ends them
        batch = todo[: budget - len(made)]
        if not batch:
            return made
        rolled = []
        for tier in sorted({t.tier for t in batch}):
            config = _with_demos(configs[tier], shown) if demos is not None else configs[tier]
            mine = [t for t in batch if t.tier == tier]
            rolled += bench.rollouts(config, mine, adapter, "select", first_sample=first_sample + number)
        wins = [t for t in rolled if t.reward >= min_reward and not t.error]
        shown += [Demo(task_id=t.task_id, messages=t.messages) for t in wins]
        todo = [t for t in todo if t.id not in {w.task_id for w in wins}]
        made += rolled
    raise AssertionError("unreachable")


def _with_demos(config: HCPConfig, wins: list[Demo]) -> HCPConfig:
    """The config with ``wins`` added to its demos, if it picks them by nearness (else as it is)."""
    if config.demos.select != "nearest" or not wins:
        return config
    return config.model_copy(update={"demos": config.demos.model_copy(update={"items": config.demos.items + wins})})


def _solved(bench: Workbench, original: HCPConfig, adapter: str, ids: list[str], samples: int) -> set[str]:
    """Tasks the original config is known to solve: all its first ``samples`` rollouts stored before (a curriculum
    plan's) reach reward 1, so no evolved rollout can beat it there."""
    stored = bench.store.trajectories(bench.run_id, hcp_id=original.id, adapter=adapter, task_ids=ids)
    rewards: dict[str, list[float]] = defaultdict(list)
    for t in stored:
        if t.sample < samples:
            rewards[t.task_id].append(t.reward)
    return {task for task, r in rewards.items() if len(r) == samples and min(r) >= 1.0}


class Beaten(NamedTuple):
    """The original's rollout a win beat (sample -1: none, the original's mean reward on the task's tier)."""

    hcp_id: str
    sample: int
    reward: float


def _unsolved_tiers(bench: Workbench, original: HCPConfig, adapter: str, s: SelectSettings) -> dict[int, float]:
    """Tiers where the original's stored train and dev rollouts under ``adapter`` (stage 1's dev scores, say) cover
    ``s.unpaired_after`` tasks or more and reach ``s.min_reward`` on none, each with the original's mean reward
    there. Test rollouts never decide."""
    splits: tuple[Split, ...] = ("train", "dev")
    tier_of = {t.id: t.tier for split in splits for t in bench.env.tasks(split)}
    by_tier: dict[int, list[Trajectory]] = defaultdict(list)
    for t in bench.store.trajectories(bench.run_id, hcp_id=original.id, adapter=adapter):
        if t.task_id in tier_of:
            by_tier[tier_of[t.task_id]].append(t)
    return {
        tier: mean([t.reward for t in rolled])
        for tier, rolled in by_tier.items()
        if len({t.task_id for t in rolled}) >= (s.unpaired_after or 0) and all(t.reward < s.min_reward for t in rolled)
    }


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
    kept: list[tuple[Trajectory, Beaten]], tiers: dict[str, int], ratio: float | None
) -> list[tuple[Trajectory, Beaten]]:
    """Cap each tier at ``ratio`` x the count of the harder tier (higher number) with the fewest items, keeping
    the largest gains over the baseline: easy wins never crowd out hard ones, and the hardest tier is never cut."""
    if ratio is None:
        return kept
    by_tier: dict[int, list[tuple[Trajectory, Beaten]]] = defaultdict(list)
    for pair in kept:
        by_tier[tiers[pair[0].task_id]].append(pair)
    out = []
    for tier, pairs in by_tier.items():
        harder = [len(v) for t, v in by_tier.items() if t > tier]
        cap = max(1, math.floor(ratio * min(harder))) if harder else len(pairs)
        out += sorted(pairs, key=lambda p: (p[1].reward - p[0].reward, p[0].task_id))[:cap]
    return sorted(out, key=lambda p: (p[0].task_id, -p[0].reward))


def _item(win: Trajectory, base: Beaten) -> SelectedTrajectory:
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
