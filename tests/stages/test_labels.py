"""The labelled budget: a seeded, stratified, nested draw of labelled train tasks, read by nothing outside it."""

from __future__ import annotations

import json
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
    with pytest.raises(ConfigError, match=r"no label is read; set labels.budget: 0, or leave out labels$"):
        load_config(config("{budget: 8}", "evolve: {references: false}"))
    assert load_config(config("{budget: 0}", "evolve: {references: false}")).labels.budget == 0  # as it advises
    with pytest.raises(ConfigError, match=r"labels.budget: required setting is missing"):
        load_config(config("{train: true}"))
    with pytest.raises(ConfigError, match=r"labels.warm_start: .* registry.approval .*; turn one of them off$"):
        load_config(config("{budget: 8, warm_start: true}", "registry: {approval: true}"))


def test_the_gate_never_decides_on_the_dev_tasks_that_chose_the_training_length(tmp_path: Path, tiny_model_dir) -> None:
    from autoevolve import loop
    from autoevolve.stages import pipeline

    path = tmp_path / "run.yaml"
    path.write_text(
        f"hcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: {tiny_model_dir}}}\nenv: {{tiers: [1, 2], n_train: 8, n_dev: 24, n_test: 4}}\n"
        "distill: {epoch_grid: [1, 2], dev_tasks: 6}\ngate: {dev_tasks: 48}\n"
    )
    r = loop.open_round(load_config(path))
    r.bench.store.close()
    dev = r.bench.env.tasks("dev")
    judged, gated = pipeline.judged_tasks(r, [1, 2]), pipeline.gated_tasks(r, [1, 2])
    assert [t.id for t in judged] == [t.id for t in dev[-6:]]
    assert {t.id for t in gated} == {t.id for t in dev[:-6]}  # every other dev task, as many as gate.dev_tasks asks
    tier2 = [t.id for t in dev if t.tier == 2]
    assert [t.id for t in pipeline.gated_tasks(r, [2])] == tier2[:-6]  # the judged ones are the tiers' own last


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


def test_warm_start_makes_sft_on_the_labels_the_rounds_live_adapter(
    tmp_path: Path, tiny_model_dir, monkeypatch
) -> None:
    from autoevolve import loop
    from autoevolve.stages import pipeline

    path = tmp_path / "warm.yaml"
    path.write_text(
        f"run_id: warm\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: {tiny_model_dir}, batch_size: 8}}\nenv: {{tiers: [1], n_train: 16, n_dev: 4, n_test: 4}}\n"
        "labels: {budget: 4, warm_start: true}\nevolve: {train_tasks: 4, candidates: 1, mutators: [tool_format]}\n"
        "select: {train_tasks: 4}\ndistill: {epochs: 1, batch_size: 2, lora_r: 4, lora_alpha: 8, max_length: 384}\n"
        "gate: {dev_tasks: 4, test_tasks: 4}\n"
    )
    config = load_config(path)
    real = pipeline.gate

    def warm_passes(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the tiny model learns nothing: say it did
        report = real(*args, **kwargs)
        return report.model_copy(update={"decision": "promote"}) if args[4] == "L1-life@v1" else report

    monkeypatch.setattr(pipeline, "gate", warm_passes)
    r = loop.open_round(config)
    assert r.warm_start_due
    report = loop.run_round(r)
    r.bench.store.close()
    assert report["warm_start"]["adapter"] == "L1-life@v1" and report["warm_start"]["decision"] == "promote"
    assert report["live_adapter"] == "L1-life@v1" and report["adapter"] == "L1-life@v2"
    with Store(config.store, read_only=True) as store:
        v1, v2 = store.adapters("L1-life")
    assert (v1.selection_id, v1.status) == ("", "promoted") and v2.parent_version == 1  # the round's A_r is v1
    assert v2.selection_id and json.loads((Path(v2.path) / "train_result.json").read_text())["examples"] == 4
    again = loop.open_round(config, round=0)  # a resumed round 0 starts from the warm adapter, not the bare base
    assert again.base_ref == "L1-life@v1" and not again.warm_start_due
    again.bench.store.close()
