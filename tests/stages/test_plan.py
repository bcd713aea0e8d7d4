"""The curriculum: tiers enter play as the live adapter passes them; train tasks come from its frontier."""

from __future__ import annotations

import json
from collections.abc import Callable

from autoevolve.config import CurriculumSettings
from autoevolve.envs.life import BOOK_TOOL, SEARCH_TOOL, LifeEnv, _book_args
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import Task
from autoevolve.stages import plan as curriculum
from autoevolve.store import Store


class Solver:
    """Plays the gold calls of the tasks ``solves(task, adapter)`` allows, and answers the others with words."""

    def __init__(self, env: LifeEnv, solves: Callable[[Task, str | None], bool]) -> None:
        self.tasks = {t.request: t for s in ("train", "dev", "test") for t in env.tasks(s)}
        self.solves, self.calls = solves, 0

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        self.calls += len(requests)
        return [self._one(r.messages, adapter) for r in requests]

    def _one(self, messages: list[dict], adapter: str | None) -> Completion:
        at = max(i for i, m in enumerate(messages) if m["role"] == "user" and m["content"] in self.tasks)
        task, step = self.tasks[messages[at]["content"]], sum(m["role"] == "assistant" for m in messages[at:])
        goal = task.goal
        calls = [(SEARCH_TOOL[goal["kind"]], goal["search"])] if "search" in goal else []
        calls.append((BOOK_TOOL[goal["kind"]], _book_args(goal)))
        if not self.solves(task, adapter):
            return Completion(text="I am not sure.", completion_tokens=4)
        if step < len(calls):
            name, args = calls[step]
            return Completion(text=json.dumps({"name": name, "arguments": args}), completion_tokens=20)
        return Completion(text=f"Done: {goal.get('mention', 'booked')}.", completion_tokens=4)

    def add_adapter(self, name: str, path: str) -> None:
        pass


def _plan(tmp_path, solves, adapter="", round=0, **settings):  # noqa: ANN001
    env = LifeEnv(tiers=(1, 2, 3), n_train=48, n_dev=36, n_test=12)
    c = CurriculumSettings(**({"dev_tasks": 4, "pool": 12} | settings))
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(Solver(env, solves), env, store, run_id="r", round=round, progress=None)
        plan = curriculum.plan(bench, HCPConfig.from_yaml("prompts/life.yaml"), adapter, c, n=8, seed=0)
        stored = store.count_trajectories("r")
    return env, plan, stored


def test_the_next_tier_enters_play_once_the_last_passes_on_dev(tmp_path) -> None:
    env, plan, stored = _plan(tmp_path, lambda task, adapter: task.tier == 1 and adapter == "A", adapter="A")
    assert plan.tiers == [1, 2] and plan.dev_scores == {"1": 1.0, "2": 0.0}
    by_id = {t.id: t for t in env.tasks("train")}
    assert sorted(by_id[i].tier for i in plan.pool) == [1] * 6 + [2] * 6  # balanced over the tiers in play
    assert {by_id[i].tier for i in plan.frontier} == {2} and len(plan.frontier) == 6
    drawn = [by_id[i].tier for i in plan.train]
    assert len(drawn) == 8 and drawn.count(2) == 6  # 0.75 of 8 from the frontier, the rest from what it solves
    assert "tiers in play [1, 2]" in plan.why and "frontier 6 of 12" in plan.why
    assert stored == 4 + 4 + 12  # dev of tiers 1 and 2, then the pool


def test_a_tier_below_the_bar_keeps_the_next_out(tmp_path) -> None:
    _, plan, _ = _plan(tmp_path, lambda task, adapter: adapter == "A")  # the base model solves nothing
    assert plan.tiers == [1] and plan.dev_scores == {"1": 0.0}
    assert len(plan.frontier) == 12 and len(plan.train) == 8


def test_every_tier_passing_brings_all_into_play(tmp_path) -> None:
    _, plan, _ = _plan(tmp_path, lambda task, adapter: True)
    assert plan.tiers == [1, 2, 3] and plan.frontier == []
    assert len(plan.train) == 8  # no frontier: the solved tasks fill the draw


def test_another_round_draws_other_frontier_tasks(tmp_path) -> None:
    solves = lambda task, adapter: False  # noqa: E731
    _, first, _ = _plan(tmp_path / "0", solves, round=0, pool=24)
    _, again, _ = _plan(tmp_path / "0b", solves, round=0, pool=24)
    _, later, _ = _plan(tmp_path / "1", solves, round=1, pool=24)
    assert first.train == again.train  # the same seed and round: the same draw
    assert first.pool == later.pool and set(first.train) != set(later.train)


def test_without_a_curriculum_every_round_takes_the_same_seeded_train_tasks(tmp_path) -> None:
    from autoevolve.stages.plan import train_tasks

    env = LifeEnv(tiers=(1, 2), n_train=48, n_dev=8, n_test=8)
    with Store(tmp_path / "s.duckdb") as store:
        plans = [
            curriculum.fixed_plan(Workbench(Solver(env, lambda t, a: False), env, store, "r", r), n=12, seed=3)
            for r in (0, 1)
        ]
        bench = Workbench(Solver(env, lambda t, a: False), env, store, "r", 0)
        assert curriculum.train_of(bench, plans[0], 8) == train_tasks(env, 8, 3)  # stage 1's tasks, as before
        assert store.count_trajectories("r") == 0  # a fixed plan runs nothing
    assert plans[0].train == plans[1].train and plans[0].tiers == [1, 2] and len(plans[0].train) == 12
