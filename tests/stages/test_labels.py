"""The labelled budget: a seeded, stratified, nested draw of labelled train tasks, read by nothing outside it."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from autoevolve.config import ConfigError, load_config
from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.stages import labels
from autoevolve.stages.evolve.mutators import DemoBootstrap
from autoevolve.stages.evolve.proposal import Evidence
from autoevolve.stages.plan import fixed_plan
from autoevolve.stats import hierarchical_ci, holm
from autoevolve.store import Store
from tests.stages.test_select import NoCalls

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def life() -> LifeEnv:
    return LifeEnv(tiers=(1, 2, 3), n_train=120, n_dev=12, n_test=12)


def test_a_budget_takes_every_stratum_in_turn_and_a_smaller_one_lies_inside_a_larger(life: LifeEnv) -> None:
    strata = {labels.stratum(t) for t in life.tasks("train")}
    assert len(strata) == 8  # life: tier 1 table/ride/event/hotel, tiers 2 and 3 table/hotel
    eight = labels.labelled_tasks(life, 8, seed=3)
    assert Counter(labels.stratum(t) for t in eight) == Counter(dict.fromkeys(strata, 1))  # one of each
    ids = {n: {t.id for t in labels.labelled_tasks(life, n, seed=3)} for n in (4, 8, 16, 48)}
    assert ids[4] < ids[8] < ids[16] < ids[48] and len(ids[48]) == 48
    assert ids[8] != {t.id for t in labels.labelled_tasks(life, 8, seed=4)}  # the seed draws another set
    assert [t.id for t in eight] == sorted(t.id for t in eight)


def test_references_of_the_labelled_set_and_the_config_that_shows_them(life: LifeEnv) -> None:
    tasks = labels.labelled_tasks(life, 4, seed=0)
    refs = labels.references(life, tasks)
    assert list(refs) == [t.id for t in tasks] and all(
        m[0].content == t.request for t, m in zip(tasks, refs.values(), strict=True)
    )
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    shown = labels.demos_config(original, refs, k=2, style="first_call")
    assert [d.task_id for d in shown.demos.items] == list(refs) and shown.id != original.id
    assert (shown.demos.k, shown.demos.style, shown.demos.select) == (2, "first_call", "nearest")
    assert all(d.task_id != tasks[0].id for d in shown.demos.for_task(tasks[0]))  # never its own
    with pytest.raises(ValueError, match="has no reference solution"):
        labels.references(life, life.tasks("dev")[:1])


def test_the_plan_draws_only_unlabelled_train_tasks(life: LifeEnv, tmp_path: Path) -> None:
    labelled = frozenset(t.id for t in labels.labelled_tasks(life, 16, seed=0))
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(NoCalls(), life, store, run_id="r", progress=None)
        plan = fixed_plan(bench, 200, seed=0, exclude=labelled)
        unlabelled = fixed_plan(bench, 50, seed=0)
    assert len(plan.train) == 104 and not labelled & set(plan.train) and "104 unlabelled" in plan.why
    assert len(unlabelled.train) == 50  # without labels: the whole split, as before


def test_demos_top_up_only_from_the_labelled_set(life: LifeEnv) -> None:
    train = {t.id: t for t in life.tasks("train") if t.tier == 1}
    labelled = {t.id: t for t in labels.labelled_tasks(life, 8, seed=0, tiers=[1])}
    evidence = Evidence(trajectories=[], tasks=train, reference=life.reference, labelled=labelled)
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    child = DemoBootstrap(pool=16, ks=(2,)).mutate(original, evidence, random.Random(0))
    assert {d.task_id for d in child.demos.items} == set(labelled)  # 8 shown although 16 were wanted
    with pytest.raises(ValueError, match="no labelled solutions"):
        DemoBootstrap().mutate(original, Evidence([], train, life.reference, labelled={}), random.Random(0))
    anywhere = DemoBootstrap(pool=16).mutate(original, Evidence([], train, life.reference), random.Random(0))
    assert len(anywhere.demos.items) == 16  # no labelled budget: any train task's reference, as before


def test_a_labelled_budget_needs_references_and_the_sft_trainer(tmp_path: Path) -> None:
    def config(labelled: str, extra: str = "") -> Path:
        path = tmp_path / "run.yaml"
        path.write_text(f"hcp: {ROOT}/prompts/life.yaml\nlabels: {labelled}\n{extra}")
        return path

    assert load_config(config("{budget: 8}")).labels.budget == 8
    with pytest.raises(ConfigError, match=r"run.yaml: labels.train: only trainer sft .* set labels.train: false$"):
        load_config(config("{budget: 8}", "distill: {trainer: dpo}"))
    assert load_config(config("{budget: 8, train: false}", "distill: {trainer: dpo}")).distill.trainer == "dpo"
    with pytest.raises(ConfigError, match=r"no label is read; set labels.budget: 0 instead$"):
        load_config(config("{budget: 8}", "evolve: {references: false}"))
    with pytest.raises(ConfigError, match=r"labels.budget: required setting is missing"):
        load_config(config("{train: true}"))


def test_the_hierarchical_interval_carries_the_spread_between_seeds() -> None:
    flat = [[1.0, 0.0] * 16] * 5
    spread = [[1.0] * 32, [0.0] * 32, [1.0] * 32, [0.0] * 32, [1.0] * 32]
    lo, hi = hierarchical_ci(flat)
    slo, shi = hierarchical_ci(spread)
    assert lo < 0.5 < hi and shi - slo > 2 * (hi - lo)  # same mean, far wider when the seeds disagree
    assert hierarchical_ci([[0.25] * 8] * 3) == (0.25, 0.25)


def test_holm_multiplies_by_the_hypotheses_left_and_keeps_the_order() -> None:
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
