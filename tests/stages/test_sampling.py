"""Stage 2's best-of-k configs per tier: the config that scores best on a tier's dev tasks, or that tier's own
references as demos when no kept config beats the original there."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoevolve import loop
from autoevolve.config import load_config
from autoevolve.records import Candidate, TaskPlan
from autoevolve.round import Round
from autoevolve.stages import pipeline
from autoevolve.stages import plan as curriculum
from autoevolve.stages.evolve import EvolveResult
from tests.stages.test_select import NoCalls

ROOT = Path(__file__).resolve().parents[2]


def _round(tmp_path: Path, model_dir: Path, new_tier_demos: int) -> Round:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_id: t\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: {model_dir}}}\nenv: {{tiers: [1, 2], n_train: 24, n_dev: 8, n_test: 4}}\n"
        f"evolve: {{dev_tasks: 8}}\nselect: {{train_tasks: 12, best_of: 4, temperature: 0.9, "
        f"new_tier_demos: {new_tier_demos}}}\n"
    )
    r = loop.open_round(load_config(path), policy=NoCalls(), round=0)
    train = [t.id for t in r.bench.env.tasks("train")[:12]]
    plan = TaskPlan(run_id="t", round=0, tiers=[1, 2], train=train, why="test")
    r.bench.store.put_stage("t", 0, "plan", plan.model_dump(mode="json"), 0.0)
    return r


def _evolved(r: Round, tier2_of_tool_child: float, tier1_of_demos_child: float = 1.0) -> EvolveResult:
    """The original (tier 1: 0.5), a demos child best on tier 1 (1.0) and a tool child that scores only on tier 2."""
    dev = curriculum.split_tasks(r.bench, "dev", [1, 2], 8)
    demos = r.original.model_copy(update={"name": "demos", "system_prompt": r.original.system_prompt + " Be brief."})
    tool = r.original.model_copy(update={"name": "tool", "tool_format": "python"})

    def scores(tier1: float, tier2: float) -> dict[str, float]:
        return {t.id: tier1 if t.tier == 1 else tier2 for t in dev}

    rows = [
        (r.original, scores(0.5, 0.0)),
        (demos, scores(tier1_of_demos_child, 0.0)),
        (tool, scores(0.0, tier2_of_tool_child)),
    ]
    candidates = [
        Candidate(run_id="t", hcp_id=h.id, status="keep", scores=s, mean_reward=sum(s.values()) / len(s))
        for h, s in rows
    ]
    return EvolveResult(demos, r.original, candidates, {h.id: h for h, _ in rows})


@pytest.mark.parametrize("new_tier_demos", [0, 3])
def test_each_tier_samples_under_the_config_best_on_its_own_dev_tasks(tmp_path, tiny_model_dir, new_tier_demos):
    r = _round(tmp_path, tiny_model_dir, new_tier_demos)
    try:
        chosen = pipeline.best_per_tier(r, _evolved(r, tier2_of_tool_child=0.5))
    finally:
        r.bench.store.close()
    assert chosen[1].name == "demos-sampled" and chosen[2].name == "tool-sampled"  # a tier-2 score wins over demos
    assert chosen[1].sampling.temperature == chosen[2].sampling.temperature == 0.9


def test_a_tier_no_config_scores_on_is_sampled_with_its_own_references_as_demos(tmp_path, tiny_model_dir):
    r = _round(tmp_path, tiny_model_dir, new_tier_demos=3)
    try:
        chosen = pipeline.best_per_tier(r, _evolved(r, tier2_of_tool_child=0.0))
        tier2 = [t for t in curriculum.train_of(r.bench, pipeline.task_plan(r), 12) if t.tier == 2]
        references = [r.bench.env.reference(t) for t in tier2]
    finally:
        r.bench.store.close()
    assert chosen[1].name == "demos-sampled"
    shown = chosen[2].demos
    assert chosen[2].system_prompt == r.original.system_prompt and chosen[2].tool_format == r.original.tool_format
    assert (shown.select, shown.k, shown.style) == ("nearest", 3, "full") and len(tier2) == 6
    assert [d.task_id for d in shown.items] == [t.id for t in tier2]
    assert [d.messages for d in shown.items] == references
    assert tier2[0].id not in {d.task_id for d in shown.for_task(tier2[0])}  # never a task's own solution


def test_without_new_tier_demos_a_tier_nothing_scores_on_takes_the_best_config(tmp_path, tiny_model_dir):
    r = _round(tmp_path, tiny_model_dir, new_tier_demos=0)
    try:
        chosen = pipeline.best_per_tier(r, _evolved(r, tier2_of_tool_child=0.0))
    finally:
        r.bench.store.close()
    assert chosen[2].name == "demos-sampled" and not chosen[2].demos.items


def test_a_tier_where_the_original_stays_best_is_sampled_with_its_own_references(tmp_path, tiny_model_dir):
    r = _round(tmp_path, tiny_model_dir, new_tier_demos=3)
    try:
        chosen = pipeline.best_per_tier(r, _evolved(r, tier2_of_tool_child=0.5, tier1_of_demos_child=0.5))
    finally:
        r.bench.store.close()
    assert chosen[2].name == "tool-sampled"  # tier 2: the tool child beats the original there
    assert chosen[1].system_prompt == r.original.system_prompt and len(chosen[1].demos.items) == 6
    assert {d.task_id for d in chosen[1].demos.items} <= {t.id for t in r.bench.env.tasks("train")[:12] if t.tier == 1}
