"""Stage 2, trajectory selection: keep evolved-config rollouts that beat the original config on the same task."""

from __future__ import annotations

import hashlib
import json

from autoevolve.hcp import HCPConfig
from autoevolve.records import SelectedTrajectory, Selection, Task, Trajectory
from autoevolve.workbench import Workbench


def select(
    bench: Workbench,
    original: HCPConfig,
    evolved: list[HCPConfig],
    tasks: list[Task],
    *,
    adapter: str = "",
    margin: float = 0.0,
    min_reward: float = 0.0,
) -> Selection:
    """Pair rollouts per task; keep per task the best evolved rollout beating the original's by > margin.

    A kept rollout must also reach ``min_reward``: partial successes would teach the adapter their mistakes.

    ``evolved`` lists the configs whose rollouts may be kept, best first: the best config is rolled out on
    every task; rollouts of the others already in the store (from the search) are used as they are.
    """
    baseline = _by_task(bench.rollouts(original, tasks, adapter=adapter, stage="select"))
    pools = [bench.rollouts(evolved[0], tasks, adapter=adapter, stage="select")]
    ids = [t.id for t in tasks]
    pools += [bench.store.trajectories(bench.run_id, hcp_id=h.id, adapter=adapter, task_ids=ids) for h in evolved[1:]]
    items = []
    for task_id, base in sorted(baseline.items()):
        wins = [
            t
            for pool in pools
            for t in pool
            if t.task_id == task_id and t.reward > base.reward + margin and t.reward >= min_reward
        ]
        if not wins:
            continue
        win = max(wins, key=lambda t: (t.reward, -len(t.messages)))  # first of equals: the best config's
        items.append(
            SelectedTrajectory(
                task_id=task_id,
                hcp_id=win.hcp_id,
                adapter=win.adapter,
                sample=win.sample,
                reward=win.reward,
                baseline_hcp_id=base.hcp_id,
                baseline_sample=base.sample,
                baseline_reward=base.reward,
            )
        )
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


def selected_trajectories(bench: Workbench, selection: Selection) -> list[Trajectory]:
    """The stored rollouts a selection kept, in its order."""
    out = []
    for item in selection.items:
        found = bench.store.trajectories(
            selection.run_id, hcp_id=item.hcp_id, adapter=item.adapter, task_ids=[item.task_id]
        )
        out += [t for t in found if t.sample == item.sample]
    return out


def _by_task(trajs: list[Trajectory]) -> dict[str, Trajectory]:
    """The first sample of each task."""
    out: dict[str, Trajectory] = {}
    for t in trajs:
        out.setdefault(t.task_id, t)
    return out


def _selection_id(run_id: str, round: int, items: list[SelectedTrajectory]) -> str:
    """A content id: the same run, round and kept rollouts give the same selection id."""
    body = json.dumps([run_id, round, [i.model_dump() for i in items]], sort_keys=True)
    return "sel-" + hashlib.sha256(body.encode()).hexdigest()[:12]
