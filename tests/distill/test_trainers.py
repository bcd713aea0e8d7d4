"""The trainer protocol: every trainer named in config turns the same selection into an adapter, from A_r."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from autoevolve.config import DistillSettings
from autoevolve.distill.trainers import TRAINERS, DistillJob
from autoevolve.envs.life import LifeEnv
from autoevolve.hcp import HCPConfig
from autoevolve.records import Message, Trajectory
from autoevolve.select import select
from autoevolve.store import Store
from autoevolve.workbench import Workbench
from tests.distill.test_distill import _adapter, one_thread, tiny  # noqa: F401 - fixtures
from tests.test_select import NoCalls

SETTINGS = DistillSettings(
    epochs=1, batch_size=2, learning_rate=1e-2, lora_r=4, lora_alpha=8, max_length=384, generations=2
)


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
        first = TRAINERS[name](DistillJob(bench, selection, original, tiny, tmp_path / "v1"), SETTINGS)
        again = DistillJob(bench, selection, original, tiny, tmp_path / "v2", init_adapter=first.path)
        second = TRAINERS[name](again, SETTINGS.model_copy(update={"learning_rate": 1e-9, "lora_r": 8}))
    assert first.examples == second.examples == 3  # 3 rollouts, 3 pairs, or 3 tasks' prompts
    assert json.loads((Path(second.path) / "adapter_config.json").read_text())["r"] == 4  # the init adapter's rank
    v1, v2 = _adapter(first.path), _adapter(second.path)
    assert v1.keys() == v2.keys() and all((v1[k] - v2[k]).abs().max() < 1e-4 for k in v1)  # started from v1
