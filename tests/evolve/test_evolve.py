"""Stage 1: mutators and the search ledger."""

from __future__ import annotations

import random

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.evolve import evolve, train_tasks
from autoevolve.evolve.mutators import DemoBootstrap, Evidence, ToolPresentation, keep_frozen
from autoevolve.hcp import HCPConfig
from autoevolve.records import Trajectory
from autoevolve.store import Store
from autoevolve.workbench import Workbench
from tests.test_rollout import Scripted


def _evidence(env: LifeEnv, successes: int = 0) -> Evidence:
    tasks = env.tasks("train")[:20]
    trajs = [
        Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="h", messages=env.reference(t), reward=1.0)
        for t in tasks[:successes]
    ]
    return Evidence(trajectories=trajs, tasks={t.id: t for t in tasks}, reference=env.reference)


def test_demo_bootstrap_is_seeded_and_prefers_own_successes(env: LifeEnv, original: HCPConfig) -> None:
    op = DemoBootstrap(pool=6)
    a = op.propose(original, _evidence(env, successes=4), random.Random(1))
    b = op.propose(original, _evidence(env, successes=4), random.Random(1))
    assert a == b and a.id != original.id
    assert len(a.demos.items) == 6 and a.demos.select == "nearest"
    own = {t.id for t in env.tasks("train")[:4]}
    assert own <= {d.task_id for d in a.demos.items}  # all four successes are used before any labelled one
    assert a.tools == original.tools and a.system_prompt == original.system_prompt


def test_demo_bootstrap_without_any_source_raises(env: LifeEnv, original: HCPConfig) -> None:
    empty = Evidence(trajectories=[], tasks={}, reference=env.reference)
    with pytest.raises(ValueError, match="no successful train rollouts"):
        DemoBootstrap().propose(original, empty, random.Random(0))


def test_tool_presentation_changes_format_only(original: HCPConfig) -> None:
    child = ToolPresentation().propose(original, Evidence([], {}), random.Random(3))
    assert (child.tool_format, child.call_syntax) != (original.tool_format, original.call_syntax)
    assert child.system_prompt == original.system_prompt and child.demos == original.demos


def test_frozen_components_never_change(env: LifeEnv, original: HCPConfig) -> None:
    child = DemoBootstrap(pool=4).propose(original, _evidence(env), random.Random(0))
    kept = keep_frozen(original, child, ["demos"])
    assert kept.demos == original.demos and kept.id == original.id


def test_train_tasks_nest_for_the_same_seed(env: LifeEnv) -> None:
    small, large = train_tasks(env, 8, seed=3), train_tasks(env, 24, seed=3)
    assert {t.id for t in small} <= {t.id for t in large} and len(large) == 24
    assert train_tasks(env, 8, seed=4) != small


def test_search_records_every_candidate(env: LifeEnv, original: HCPConfig, tmp_path) -> None:
    tasks = env.tasks("train")[:4]
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(Scripted(["I cannot help."]), env, store, run_id="r", progress=None)
        result = evolve(
            bench,
            original,
            tasks=tasks,
            candidates=3,
            mutators=["demos", "tool_format"],
            demo_pool=4,
            demo_k=(2,),
            demo_styles=("full",),
        )
        ledger = store.candidates("r")
    assert [c.mutator for c in ledger] == ["seed", "demos", "tool_format", "demos"]
    assert ledger[0].status == "keep" and ledger[0].mean_reward == 0.0
    # A constant policy never improves; with 4 tasks and a pool of 4 the second demo set repeats the first.
    assert [c.status for c in ledger[1:]] == ["discard", "discard", "crash"]
    assert ledger[3].note == f"proposed an already tried config {ledger[1].hcp_id}"
    assert result.best.id == original.id and len(ledger[1].scores) == 4
