"""The trainer protocol: every trainer named in config turns the same selection into an adapter, from A_r."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
import torch

from autoevolve.config import DistillSettings
from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Message, SelectedTrajectory, Selection, Trajectory
from autoevolve.stages.distill.trainers import TRAINERS, DistillJob
from autoevolve.stages.distill.training import GRPOSettings
from autoevolve.stages.select import select
from autoevolve.store import Store
from tests.stages.distill.test_distill import _adapter, one_thread, tiny  # noqa: F401 - fixtures
from tests.stages.test_select import NoCalls

SHARED = {"epochs": 1, "batch_size": 2, "learning_rate": 1e-2, "lora_r": 4, "lora_alpha": 8, "max_length": 384}
SETTINGS = {
    "sft": DistillSettings(trainer="sft", **SHARED),
    "dpo": DistillSettings(trainer="dpo", **SHARED),
    "grpo": DistillSettings(trainer="grpo", grpo=GRPOSettings(generations=2), **SHARED),  # a whole group a step
}


def test_every_configurable_trainer_is_registered() -> None:
    assert set(TRAINERS) == set(get_args(DistillSettings.model_fields["trainer"].annotation)) == {"sft", "dpo", "grpo"}


@pytest.mark.parametrize("name", ["sft", pytest.param("dpo", marks=pytest.mark.slow), "grpo"])
def test_each_trainer_trains_on_the_selection_and_continues_from_the_live_adapter(
    name: str,
    tiny: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    env = LifeEnv(tiers=(1,))
    tasks = env.tasks("train")[:4]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    evolved = original.model_copy(update={"tool_format": "python"})
    refusal = {t.id: [Message(role="user", content=t.request), Message(role="assistant", content="No.")] for t in tasks}
    rows = [(evolved, env.reference(t), 1.0) for t in tasks[:3]] + [(original, refusal[t.id], 0.0) for t in tasks[:3]]
    rows += [(evolved, refusal[tasks[3].id], 0.0), (original, refusal[tasks[3].id], 0.0)]  # no win: not selected
    order = tasks[:3] + tasks[:3] + [tasks[3]] * 2
    with Store(tmp_path / "s.duckdb") as store:
        store.put_trajectories(
            [
                Trajectory(run_id="r", task_id=t.id, split="train", hcp_id=h.id, messages=m, reward=reward)
                for t, (h, m, reward) in zip(order, rows, strict=True)
            ]
        )
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        selection = select(bench, original, [evolved], tasks)
        assert len(selection.items) == 3
        first = TRAINERS[name](DistillJob(store, env, selection, original, tiny, tmp_path / "v1"), SETTINGS[name])
        again = DistillJob(store, env, selection, original, tiny, tmp_path / "v2", init_adapter=first.path)
        second = TRAINERS[name](again, SETTINGS[name].model_copy(update={"learning_rate": 1e-9, "lora_r": 8}))
    assert first.examples == second.examples == 3  # 3 rollouts, 3 pairs, or 3 tasks' prompts
    assert json.loads((Path(second.path) / "adapter_config.json").read_text())["r"] == 4  # the init adapter's rank
    v1, v2 = _adapter(first.path), _adapter(second.path)
    assert v1.keys() == v2.keys() and all((v1[k] - v2[k]).abs().max() < 1e-4 for k in v1)  # started from v1


def test_replayed_selections_train_too_and_a_task_keeps_only_its_newest_win(tmp_path: Path) -> None:
    env = LifeEnv(tiers=(1,))
    t0, t1, t2 = env.tasks("train")[:3]
    original = HCPConfig.from_yaml("prompts/life.yaml")

    def selection(round: int, tasks) -> Selection:  # noqa: ANN001
        won = {"hcp_id": f"h{round}", "adapter": "", "sample": 0, "reward": 1.0}
        lost = {"baseline_hcp_id": "o", "baseline_sample": 0, "baseline_reward": 0.0}
        items = [SelectedTrajectory(task_id=t.id, **won, **lost) for t in tasks]
        return Selection(
            id=f"s{round}", run_id="r", round=round, baseline_hcp_id="o", evolved_hcp_id="e", adapter="", items=items
        )

    now, before, first = selection(2, [t1]), selection(1, [t0, t1]), selection(0, [t1, t2])
    with Store(tmp_path / "s.duckdb") as store:
        job = DistillJob(store, env, now, original, "m", tmp_path / "v3", replay=[before, first])
        kept = job.selections()
    assert [(s.id, [(i.task_id, i.hcp_id) for i in s.items]) for s in kept] == [
        ("s2", [(t1.id, "h2")]),
        ("s1", [(t0.id, "h1")]),  # t1's older win is dropped: the newest one trains
        ("s0", [(t2.id, "h0")]),
    ]


def test_the_live_adapters_lineage_gives_its_selections_newest_first(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from autoevolve.records import AdapterRecord
    from autoevolve.stages.pipeline import lineage_selections

    with Store(tmp_path / "s.duckdb") as store:
        for round in (0, 1):
            store.put_selection(
                Selection(
                    id=f"s{round}",
                    run_id="r",
                    round=round,
                    baseline_hcp_id="o",
                    evolved_hcp_id="e",
                    adapter="",
                    items=[],
                )
            )
        made = [
            AdapterRecord(
                name="L1",
                version=v,
                base_model="m",
                path=f"/a/{v}",
                hcp_id="o",
                parent_version=v - 1 or None,
                selection_id=sel,
            )
            for v, sel in ((1, "s0"), (2, "s1"), (3, ""))  # v3: trained from a selection-less import
        ]
        for record in made:
            store.put_adapter(record)
        r = SimpleNamespace(base_adapter=made[2], bench=SimpleNamespace(store=store))
        assert [s.id for s in lineage_selections(r)] == ["s1", "s0"]
        assert lineage_selections(SimpleNamespace(base_adapter=None, bench=r.bench)) == []


def test_rehearsal_adds_the_live_adapters_own_wins_on_tasks_it_already_solves(
    tiny: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    from autoevolve.records import TaskPlan
    from autoevolve.stages.pipeline import rehearsed

    env = LifeEnv(tiers=(1,))
    t0, t1, t2, t3 = env.tasks("train")[:4]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    live = "L1@v1"

    def rollout(task, reward: float, adapter: str = live, sample: int = 0) -> Trajectory:  # noqa: ANN001
        messages = env.reference(task) if reward else [Message(role="user", content=task.request)]
        return Trajectory(
            run_id="r", task_id=task.id, split="train", hcp_id=original.id, adapter=adapter, sample=sample,
            messages=messages, reward=reward, stage="plan",
        )  # fmt: skip

    # The plan's pool: A_r solves t0, t1 and t2 under the original config and fails t3. Other rows are not A_r's.
    rows = [rollout(t0, 1.0), rollout(t1, 1.0), rollout(t2, 1.0), rollout(t3, 0.0), rollout(t0, 1.0, sample=1)]
    rows += [rollout(t3, 1.0, adapter="L1@v0")]
    plan = TaskPlan(
        run_id="r", round=1, adapter=live, tiers=[1], pool={t0.id: 1.0, t1.id: 1.0, t3.id: 0.0}, train=[t3.id]
    )
    with Store(tmp_path / "s.duckdb") as store:
        store.put_trajectories(rows)
        bench = Workbench(NoCalls(), env, store, run_id="r", round=1, progress=None)
        config = SimpleNamespace(distill=DistillSettings(rehearse=True))
        r = SimpleNamespace(results={"plan": plan}, bench=bench, original=original, base_ref=live, config=config)
        rehearsal = rehearsed(r)
        config.distill = DistillSettings(rehearse=True, rehearse_from_round=2)
        assert rehearsed(r) == []  # round 1 is before the first rehearsing round
        config.distill = DistillSettings(rehearse=False)
        assert rehearsed(r) == []
        assert [(t.task_id, t.sample) for t in rehearsal] == [(t0.id, 0), (t1.id, 0)]  # t2 was not in the pool
        store.put_trajectories([rollout(t1, 1.0, sample=7)])  # the round's own win on t1
        won = {"hcp_id": original.id, "adapter": live, "sample": 7, "reward": 1.0}
        lost = {"baseline_hcp_id": original.id, "baseline_sample": 0, "baseline_reward": 0.0}
        selection = Selection(
            id="s1", run_id="r", round=1, baseline_hcp_id=original.id, evolved_hcp_id=original.id, adapter=live,
            items=[SelectedTrajectory(task_id=t1.id, **won, **lost)],
        )  # fmt: skip
        alone = TRAINERS["sft"](DistillJob(store, env, selection, original, tiny, tmp_path / "a"), SETTINGS["sft"])
        job = DistillJob(store, env, selection, original, tiny, tmp_path / "b", rehearsal=rehearsal)
        both = TRAINERS["sft"](job, SETTINGS["sft"])
    assert (alone.examples, both.examples) == (1, 2)  # t0 rehearsed; t1 trains once, from its selected win


def test_sft_trains_on_the_labelled_references_beside_the_wins_and_a_labelled_task_on_its_reference_alone(
    tiny: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    env = LifeEnv(tiers=(1,))
    t0, t1, t2 = env.tasks("train")[:3]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    wins = [
        Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="e", messages=env.reference(t), reward=1.0)
        for t in (t0, t1)
    ]
    won = {"hcp_id": "e", "adapter": "", "sample": 0, "reward": 1.0}
    lost = {"baseline_hcp_id": original.id, "baseline_sample": 0, "baseline_reward": 0.0}
    items = [SelectedTrajectory(task_id=t.id, **won, **lost) for t in (t0, t1)]
    selection = Selection(
        id="s", run_id="r", round=0, baseline_hcp_id=original.id, evolved_hcp_id="e", adapter="", items=items
    )
    refs = {t.id: env.reference(t) for t in (t1, t2)}  # t1 is labelled and won: its reference trains, once
    with Store(tmp_path / "s.duckdb") as store:
        store.put_trajectories(wins)
        result = TRAINERS["sft"](
            DistillJob(store, env, selection, original, tiny, tmp_path / "v1", references=refs), SETTINGS["sft"]
        )
    assert result.examples == 3  # t0's win, t1's and t2's references


def test_the_training_length_is_chosen_on_dev_and_the_best_epochs_adapter_is_kept(
    tiny: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    from autoevolve.stages.distill import train_sft
    from tests.stages.distill.test_distill import FAST, _examples

    seen: dict[int, dict] = {}
    scores = {1: 0.25, 2: 0.5, 4: 0.5, 8: 0.75}

    def judge(path: str, epoch: int) -> float:
        seen[epoch] = _adapter(path)
        return scores[epoch]

    grid = FAST.model_copy(update={"epoch_grid": [1, 2, 4, 8], "batch_size": 2})
    result = train_sft(_examples(4), tiny, tmp_path / "a", grid, judge=judge)
    assert sorted(seen) == [1, 2, 4] and result.dev_by_epoch == {"1": 0.25, "2": 0.5, "4": 0.5}  # 4 ties 2: stop
    assert result.epochs == 2.0 and result.steps == 8  # 4 epochs of 2 steps trained, epoch 2's adapter kept
    kept = _adapter(result.path)
    assert all(torch.equal(kept[k], seen[2][k]) for k in kept) and not (tmp_path / "a" / "epochs").exists()
    assert any(not torch.equal(seen[2][k], seen[4][k]) for k in kept)
    silent = train_sft(_examples(4), tiny, tmp_path / "z", grid, judge=lambda path, epoch: 0.0)
    assert (silent.epochs, silent.steps) == (1.0, 16) and list(silent.dev_by_epoch) == ["1", "2", "4", "8"]  # no signal
    full = train_sft(_examples(4), tiny, tmp_path / "b", grid, judge=lambda path, epoch: 1.0)
    assert (full.epochs, full.steps, full.dev_by_epoch) == (1.0, 2, {"1": 1.0})  # nothing beats a full score
    with pytest.raises(ValueError, match="epoch_grid chooses the training length on dev: it needs a judge"):
        train_sft(_examples(4), tiny, tmp_path / "c", grid)
