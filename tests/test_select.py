"""Stage 2: per-task paired comparison against the original config."""

from __future__ import annotations

from autoevolve.envs.life import LifeEnv
from autoevolve.hcp import HCPConfig
from autoevolve.records import Message, Trajectory
from autoevolve.select import select, selected_trajectories
from autoevolve.store import Store
from autoevolve.workbench import Workbench


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
        selection = select(bench, original, [best, other], tasks, min_reward=1.0)
        kept = selected_trajectories(bench, selection)
        assert store.selection(selection.id) == selection
        loose = select(bench, original, [best, other], tasks, margin=0.0, min_reward=0.0)
    assert [(i.task_id, i.hcp_id, i.baseline_reward) for i in selection.items] == [
        (tasks[0].id, best.id, 0.0),
        (tasks[1].id, other.id, 0.5),
    ]
    assert [t.reward for t in kept] == [1.0, 1.0] and kept[0].hcp_id == best.id
    assert len(loose.items) == 3 and loose.id != selection.id
