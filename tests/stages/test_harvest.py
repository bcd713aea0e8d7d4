"""Stage 2's harvest passes: the best config sampled on the tasks not yet won until the budget is spent, the
original rolled out only where something won, and (``own_demos``) the wins shown as demos to the next pass."""

from __future__ import annotations

import zlib

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.policy import ChatRequest, Completion
from autoevolve.stages import labels
from autoevolve.stages.select import ROUND_SAMPLES, select
from autoevolve.stages.settings import SelectSettings
from autoevolve.store import Store
from tests.stages.test_plan import Solver


class Learner(Solver):
    """Solves a task when a demo of its kind is shown before it; when sampled, also when its sample is lucky
    (one in four, by a hash of the task and sample number)."""

    def __init__(self, env: LifeEnv) -> None:
        super().__init__(env, lambda task, adapter: False)

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        out = []
        for r in requests:
            shown = [self.tasks[m["content"]] for m in r.messages if m["role"] == "user" and m["content"] in self.tasks]
            task, demos, sample = shown[-1], shown[:-1], r.seed % 1000
            lucky = r.temperature > 0 and zlib.crc32(f"{task.id}/{sample}".encode()) % 4 == 0
            kinds = {d.goal["kind"] for d in demos}
            self.solves = lambda t, a, lucky=lucky, kinds=kinds: lucky or t.goal["kind"] in kinds
            out += super().generate([r], adapter)
        return out


def _harvest(tmp_path, own_demos: bool, budget: int | None):  # noqa: ANN202
    env = LifeEnv(tiers=(1,), n_train=48)
    table = next(t for t in env.tasks("train") if t.goal["kind"] == "table")
    original = HCPConfig.from_yaml("prompts/life.yaml").with_env_tools(env.tools())
    best = labels.demos_config(original, labels.references(env, [table]), 2, "full")
    tasks = [t for t in env.tasks("train") if t.id != table.id][:32]
    settings = SelectSettings(min_reward=1.0, own_demos=own_demos, temperature=0.7)
    with Store(tmp_path / f"s{own_demos}{budget}.duckdb") as store:
        bench = Workbench(Learner(env), env, store, run_id="r", progress=None)
        selection = select(bench, original, [best], tasks, settings, budget=budget)
        rolled = store.trajectories("r", stage="select")
    kinds = {t.id: t.goal["kind"] for t in tasks}
    return selection, rolled, original, kinds


def test_harvest_passes_spend_the_budget_on_tasks_not_won_and_pair_only_the_wins(tmp_path) -> None:
    once, rolled_once, original, kinds = _harvest(tmp_path, own_demos=False, budget=None)
    assert {kinds[i.task_id] for i in once.items} == {"table"}  # greedy: only the kind its demo shows
    assert len(rolled_once) == 32 + len(once.items)  # one pass, and the original only where it won

    harvested, rolled, _, _ = _harvest(tmp_path, own_demos=False, budget=80)
    evolved = [t for t in rolled if t.hcp_id != original.id]
    assert len(evolved) == 80  # pass 0 over all 32, then samples until the budget is spent
    passes = sorted({t.sample for t in evolved})
    assert passes == list(range(len(passes))) and len(passes) > 2  # sample 0 greedy, then one number per pass
    won = {i.task_id for i in harvested.items}
    assert won > {i.task_id for i in once.items} and {t.task_id for t in rolled if t.hcp_id == original.id} == won
    for task in kinds:  # a task is sampled until it is won, never after
        rewards = [t.reward for t in sorted(evolved, key=lambda t: t.sample) if t.task_id == task]
        assert 1.0 not in rewards[:-1]
    assert all(i.sample < ROUND_SAMPLES for i in harvested.items)


def test_own_demos_let_a_lucky_win_teach_its_kind_to_the_next_pass(tmp_path) -> None:
    plain, _, _, kinds = _harvest(tmp_path, own_demos=False, budget=80)
    grown, rolled, original, _ = _harvest(tmp_path, own_demos=True, budget=80)
    lucky = {kinds[i.task_id] for i in plain.items}
    assert lucky == {"table", "ride", "hotel", "event"}  # every kind had a lucky sample
    assert len(grown.items) == len(kinds) > len(plain.items)  # ... which its own demos spread to every task of it
    configs = {t.hcp_id for t in rolled if t.hcp_id != original.id}
    assert len(configs) >= 3  # the greedy pass, then one config per pass (its demos grew)
