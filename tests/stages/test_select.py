"""Stage 2: per-task paired comparison against the original config."""

from __future__ import annotations

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Message, Trajectory
from autoevolve.stages.pipeline import SUMMARY
from autoevolve.stages.select import ROUND_SAMPLES, select
from autoevolve.stages.settings import SelectSettings
from autoevolve.store import Store


class NoCalls:
    """A policy that must not be asked: every rollout is already stored."""

    def generate(self, requests, adapter=None):
        raise AssertionError("selection regenerated a stored rollout")

    def add_adapter(self, name, path):
        pass


def _traj(hcp: HCPConfig, task_id: str, reward: float) -> Trajectory:
    return Trajectory(
        run_id="r",
        task_id=task_id,
        split="train",
        hcp_id=hcp.id,
        reward=reward,
        messages=[Message(role="user", content="x"), Message(role="assistant", content=f"{reward}")],
    )


def test_keeps_wins_over_the_original_on_the_same_task(tmp_path) -> None:
    env = LifeEnv(tiers=(1,))
    tasks = env.tasks("train")[:4]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    other = original.model_copy(update={"tool_format": "json"})
    rewards = {  # task: (original, best, other)
        tasks[0].id: (0.0, 1.0, 0.0),  # best wins
        tasks[1].id: (0.5, 0.5, 1.0),  # only the other evolved config wins
        tasks[2].id: (1.0, 1.0, 1.0),  # a tie is not a win
        tasks[3].id: (0.0, 0.8, 0.0),  # a partial win below min_reward is not kept
    }
    with Store(tmp_path / "s.duckdb") as store:
        for config, column in ((original, 0), (best, 1), (other, 2)):
            store.put_trajectories([_traj(config, t, r[column]) for t, r in rewards.items()])
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        selection = select(bench, original, [best, other], tasks, SelectSettings(min_reward=1.0))
        kept = store.kept_rollouts(selection)
        assert store.selection(selection.id) == selection
        loose = select(bench, original, [best, other], tasks, SelectSettings(margin=0.0, min_reward=0.0))
    assert [(i.task_id, i.hcp_id, i.baseline_reward) for i in selection.items] == [
        (tasks[0].id, best.id, 0.0),
        (tasks[1].id, other.id, 0.5),
    ]
    assert [t.reward for t in kept] == [1.0, 1.0] and kept[0].hcp_id == best.id
    assert len(loose.items) == 3 and loose.id != selection.id


def _put(
    store: Store, hcp: HCPConfig, task_id: str, rewards: list[float], texts: list[str] | None = None, first: int = 0
) -> None:
    """Store one rollout per sample of a task under a config, numbered from ``first``."""
    texts = texts or [f"{hcp.id}-{i}" for i in range(len(rewards))]
    store.put_trajectories(
        [
            _traj(hcp, task_id, r).model_copy(
                update={
                    "sample": first + i,
                    "messages": [Message(role="user", content="x"), Message(role="assistant", content=t)],
                }
            )
            for i, (r, t) in enumerate(zip(rewards, texts, strict=True))
        ]
    )


def test_means_over_samples_decide_and_duplicates_are_dropped(tmp_path) -> None:
    env = LifeEnv(tiers=(1,))
    t0, t1 = env.tasks("train")[:2]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    other = original.model_copy(update={"tool_format": "json"})
    with Store(tmp_path / "s.duckdb") as store:
        _put(store, original, t0.id, [1.0, 0.0])  # mean 0.5
        _put(store, best, t0.id, [1.0, 0.0])  # mean 0.5: one lucky sample is not a win
        _put(store, other, t0.id, [1.0, 1.0], ["same", "same"])  # mean 1.0: a win, but one conversation
        _put(store, original, t1.id, [0.0, 0.0])
        _put(store, best, t1.id, [1.0, 1.0])  # two distinct wins
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        one = select(bench, original, [best, other], [t0, t1], SelectSettings(samples=2, min_reward=1.0))
        two = select(
            bench, original, [best, other], [t0, t1], SelectSettings(samples=2, min_reward=1.0, max_per_task=2)
        )
        pairs = [
            (k, b)
            for i, k, b in zip(two.items, store.kept_rollouts(two), store.beaten_rollouts(two), strict=True)
            if i.pairs_with_baseline
        ]
    assert [(i.task_id, i.hcp_id, i.sample) for i in one.items] == [(t0.id, other.id, 0), (t1.id, best.id, 0)]
    assert [(i.task_id, i.hcp_id, i.sample) for i in two.items] == [
        (t0.id, other.id, 0),
        (t1.id, best.id, 0),
        (t1.id, best.id, 1),
    ]
    assert [(i.baseline_sample, i.baseline_reward) for i in two.items] == [(1, 0.0), (0, 0.0), (0, 0.0)]
    assert [(c.hcp_id, c.reward, r.hcp_id, r.reward) for c, r in pairs] == [
        (other.id, 1.0, original.id, 0.0),
        (best.id, 1.0, original.id, 0.0),
        (best.id, 1.0, original.id, 0.0),
    ]


def test_no_tier_dominates_the_selection(tmp_path) -> None:
    env = LifeEnv(tiers=(1, 2))
    ones = [t for t in env.tasks("train") if t.tier == 1][:4]
    two = next(t for t in env.tasks("train") if t.tier == 2)
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    with Store(tmp_path / "s.duckdb") as store:
        for task, base in zip([*ones, two], [0.5, 0.0, 0.5, 0.0, 0.0], strict=True):
            _put(store, original, task.id, [base])
            _put(store, best, task.id, [1.0])
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        capped = select(bench, original, [best], [*ones, two], SelectSettings(min_reward=1.0, tier_ratio=2.0))
        free = select(bench, original, [best], [*ones, two], SelectSettings(min_reward=1.0, tier_ratio=None))
    assert len(free.items) == 5
    # Tier 2 kept one item, so tier 1 keeps 2: the two largest gains (baseline 0.0, not 0.5).
    assert sorted(i.task_id for i in capped.items) == sorted([ones[1].id, ones[3].id, two.id])


def test_a_hard_tier_is_never_cut_for_an_easy_one(tmp_path) -> None:
    env = LifeEnv(tiers=(1, 2))
    one = next(t for t in env.tasks("train") if t.tier == 1)
    twos = [t for t in env.tasks("train") if t.tier == 2][:4]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    with Store(tmp_path / "s.duckdb") as store:
        for task in [one, *twos]:
            _put(store, original, task.id, [0.0])
            _put(store, best, task.id, [1.0])
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        capped = select(bench, original, [best], [one, *twos], SelectSettings(min_reward=1.0, tier_ratio=2.0))
    # Tier 1 won once; tier 2's four wins are all kept (tier 1 would be capped at 2 x 4).
    assert sorted(i.task_id for i in capped.items) == sorted(t.id for t in [one, *twos])


def test_best_of_samples_win_one_by_one_on_unsolved_tasks_with_new_numbers_each_round(tmp_path) -> None:
    env = LifeEnv(tiers=(1,))
    t0, t1 = env.tasks("train")[:2]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    sampled = best.model_copy(update={"sampling": best.sampling.model_copy(update={"temperature": 0.7})})
    with Store(tmp_path / "s.duckdb") as store:
        _put(store, original, t0.id, [0.0])
        _put(store, original, t1.id, [1.0])  # solved: no sample can beat it, none is asked for
        _put(store, best, t0.id, [0.0])
        _put(store, best, t1.id, [1.0])
        # Round 1 of best-of-2 asks for its own samples (round 0 had 0 and 1); only the second solves the task.
        _put(store, sampled, t0.id, [1.0, 1.0], texts=["r0-a", "r0-b"])
        _put(store, sampled, t0.id, [0.0, 1.0], texts=["r1-a", "r1-b"], first=ROUND_SAMPLES)
        bench = Workbench(NoCalls(), env, store, run_id="r", round=1, progress=None)
        selection = select(
            bench, original, [best], [t0, t1], SelectSettings(best_of=2, min_reward=1.0), sampled={1: sampled}
        )
    assert [(i.task_id, i.hcp_id, i.sample, i.baseline_reward) for i in selection.items] == [
        (t0.id, sampled.id, ROUND_SAMPLES + 1, 0.0)
    ]


def test_each_tier_is_sampled_under_its_own_config(tmp_path) -> None:
    env = LifeEnv(tiers=(1, 2))
    t1, t2 = env.tasks("train")[:2]
    assert (t1.tier, t2.tier) == (1, 2)
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    opener = original.model_copy(update={"tool_format": "compact"}).sampled(0.7)  # best on tier 2 alone
    with Store(tmp_path / "s.duckdb") as store:
        for task in (t1, t2):
            _put(store, original, task.id, [0.0])
            _put(store, best, task.id, [0.0])
        _put(store, best.sampled(0.7), t1.id, [1.0])
        _put(store, opener, t2.id, [1.0])  # no sample of best exists on t2: asking for one would fail
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        sampled = {1: best.sampled(0.7), 2: opener}
        selection = select(
            bench, original, [best], [t1, t2], SelectSettings(best_of=1, min_reward=1.0), sampled=sampled
        )
    assert [(i.task_id, i.hcp_id) for i in selection.items] == [(t1.id, best.sampled(0.7).id), (t2.id, opener.id)]


def test_a_tier_the_original_never_solves_keeps_its_wins_unpaired(tmp_path) -> None:
    env = LifeEnv(tiers=(1, 2))
    ones = [t for t in env.tasks("train") if t.tier == 1][:6]
    two = next(t for t in env.tasks("train") if t.tier == 2)
    original = HCPConfig.from_yaml("prompts/life.yaml")
    best = original.model_copy(update={"tool_format": "python"})
    with Store(tmp_path / "s.duckdb") as store:
        for task, reward in zip(ones[:4], [0.0, 0.5, 0.0, 0.5], strict=True):  # stage 1's: 4 tasks, none solved
            _put(store, original, task.id, [reward])
        _put(store, original, two.id, [1.0])  # tier 2: the original solves its one task
        for task in [*ones, two]:
            _put(store, best, task.id, [1.0])
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)  # asking for a rollout fails
        settings = SelectSettings(min_reward=1.0, tier_ratio=None, unpaired_after=4)
        selection = select(bench, original, [best], [*ones, two], settings)
        with pytest.raises(AssertionError, match="regenerated"):  # 5 tasks needed: tasks 4 and 5 must be paired
            select(bench, original, [best], [*ones, two], settings.model_copy(update={"unpaired_after": 5}))
    assert [(i.task_id, i.baseline_sample, i.baseline_reward) for i in selection.items] == [
        (t.id, -1, 0.25) for t in sorted(ones, key=lambda t: t.id)
    ]
    assert not any(i.pairs_with_baseline for i in selection.items)
    assert SUMMARY["select"](selection) == (
        "kept 6 wins on 6 tasks (6 unpaired: the original solves none of their tier's stored tasks)"
    )
