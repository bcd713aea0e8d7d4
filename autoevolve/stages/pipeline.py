"""The round's stages as library code: how each runs on a ``Round``, what it leaves in the store when it finishes,
and how that is loaded back (``STAGES``, in the round's order); ``run_stage`` runs one unless it finished before.

plan its tasks (the live adapter A_r's frontier, with a curriculum) -> evolve configs around A_r -> select what the
best config unlocked -> distil it into A_{r+1} under the original config -> gate on dev -> promote or reject ->
report the 2x2 on test. Each stage's own logic lives in its module under ``autoevolve.stages``; the functions here
adapt a round to it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from autoevolve.fleet import registry
from autoevolve.harness.hcp import Demo, Demos, HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.model import base_model_id
from autoevolve.policy import Policy
from autoevolve.records import AdapterRecord, EvalReport, Selection, Task, TaskPlan, TrainResult, Trajectory
from autoevolve.round import Decided, Distilled, Round, Stage
from autoevolve.stages import labels, plan
from autoevolve.stages.distill.fit import Judge
from autoevolve.stages.distill.trainers import TRAINERS, DistillJob
from autoevolve.stages.evolve import EvolveResult, evolve, make_mutators
from autoevolve.stages.gate import decline, gate, guard_check, held_out, length_judge, with_guard
from autoevolve.stages.select import select
from autoevolve.stats import mean
from autoevolve.views.narration import say


def finished(r: Round, stage: str) -> bool:
    """Whether a stage of this round has finished (in this process or an earlier one)."""
    return stage in r.results or r.bench.store.stage_result(r.bench.run_id, r.bench.round, stage) is not None


def result(r: Round, stage: str) -> Any:
    """A finished stage's result, loaded from the store if another process produced it."""
    if stage not in r.results:
        found = r.bench.store.stage_result(r.bench.run_id, r.bench.round, stage)
        if found is None:
            raise LookupError(
                f"run {r.bench.run_id} round {r.bench.round}: stage {stage!r} has not finished; run it first"
            )
        r.results[stage], r.seconds[stage] = STAGES[stage].load(r, found[0]), found[1]
    return r.results[stage]


def run_stage(r: Round, stage: str, *args: Any) -> Any:
    """Run a stage unless it finished before (then load its result); record its result and seconds."""
    if finished(r, stage):
        say(f"  {stage}: finished before, loaded from {r.bench.store.path}")
        return result(r, stage)
    started = time.perf_counter()
    value = STAGES[stage].run(r, *args)
    seconds = round(time.perf_counter() - started, 1)
    r.bench.store.put_stage(r.bench.run_id, r.bench.round, stage, STAGES[stage].dump(value), seconds)
    r.results[stage], r.seconds[stage] = value, seconds
    say(f"  {stage}: {SUMMARY[stage](value)} ({seconds:.0f} s)")
    return value


def stage_warm(r: Round) -> Decided:
    """Round 0's starting adapter from the labels (``labels.warm_start``): LoRA SFT on the labelled references from the
    base, registered, gated on dev against the bare base under the original config, promoted if it passes; a promoted
    one is the live adapter A_r the rest of the round works around."""
    name, store, d = r.config.expert, r.bench.store, r.config.distill
    version = store.next_adapter_version(name)
    out = registry.adapter_dir(r.run_dir / "adapters", name, version)
    tiers = sorted({t.tier for t in r.bench.env.tasks("dev")})
    judge = dev_judge(r, f"{name}@v{version}", tiers) if d.epoch_grid else None
    refs = labels.references(r.bench.env, r.trained_labels)
    empty = Selection(id=f"warm-{r.bench.run_id}", run_id=r.bench.run_id, round=0, baseline_hcp_id=r.original.id,
                      evolved_hcp_id=r.original.id, adapter="", items=[])  # fmt: skip
    job = DistillJob(store, r.bench.env, empty, r.original, r.config.model.name, out, references=refs, judge=judge)
    say(f"  warm start: LoRA SFT on the {len(refs)} labelled references")
    trained = TRAINERS["sft"](job, d)
    (Path(trained.path) / "train_result.json").write_text(trained.model_dump_json(indent=2))
    registry.write_harness(trained.path, r.original)
    record = registry.register(
        store, name=name, path=trained.path, base_model=base_model_id(r.config.model.name), parent_version=None,
        run_id=r.bench.run_id, round=0, hcp_id=r.original.id, evolved_hcp_id="", selection_id="",
    )  # fmt: skip
    r.bench.policy.add_adapter(record.ref, record.path)
    dev = gated_tasks(r, tiers)
    g = r.config.gate
    report = gate(r.bench, r.original, r.original, "", record.ref, dev, g.min_gain, alpha=g.alpha)
    decided = registry.decide(store, record, report, registry.Publisher.from_settings(r.config.registry))
    say(f"  warm start: {report.decision}: {report.reason}")
    return _warmed(r, Decided(decided, report), decided.status == "promoted", load=False)


def _warmed(r: Round, warm: Decided, went_live: bool, load: bool) -> Decided:
    """The round works around the warm-start adapter if it went live when it was decided (a resumed round 0 too,
    after its own adapter has since replaced it); ``load`` it into the policy when it is not there yet."""
    if went_live:
        r.base_adapter = warm.adapter
        if load:
            r.bench.policy.add_adapter(warm.adapter.ref, warm.adapter.path)
    return warm


def stage_plan(r: Round) -> TaskPlan:
    """The round's tiers in play and train tasks: A_r's frontier with a curriculum, else a fixed seeded draw."""
    c, n = r.config.curriculum, max(r.config.evolve.train_tasks, r.config.select.train_tasks)
    exclude = frozenset(t.id for t in r.labelled or [])  # stages 1 and 2 work on unlabelled tasks
    if c is None:
        task_plan = plan.fixed_plan(r.bench, n, r.config.seed, exclude)
    else:
        before = r.bench.store.stage_result(r.bench.run_id, r.bench.round - 1, "plan") if r.bench.round else None
        tiers = TaskPlan.model_validate(before[0]).tiers if before else None
        task_plan = plan.plan(r.bench, r.original, r.base_ref, c, n, r.config.seed, tiers, exclude)
    return task_plan


def task_plan(r: Round) -> TaskPlan:
    """The round's plan: loaded if it finished, else made now (a stage run on its own needs it too)."""
    return result(r, "plan") if finished(r, "plan") else run_stage(r, "plan")


def tasks_in_play(r: Round, split: str, n: int) -> list[Task]:
    """The first n dev or test tasks of the tiers in play this round."""
    return plan.split_tasks(r.bench, split, task_plan(r).tiers, n)  # type: ignore[arg-type]


def stage_evolve(r: Round) -> EvolveResult:
    """Stage 1: search HCP configs (train minibatches, dev scores) around the frozen adapter A_r."""
    e = r.config.evolve
    tasks = plan.train_of(r.bench, task_plan(r), e.train_tasks)
    dev = tasks_in_play(r, "dev", e.dev_tasks)
    reflector = make_reflector(r) if "reflective" in e.mutators else None
    own = e.reflection.model == "policy"  # the policy reflects with the adapter it serves; another model with none
    ops = make_mutators(e, reflector, adapter=(r.base_ref or None) if own else None)
    carried = [r.evolved_before] if r.evolved_before else []
    shown = labelled_demos(r, task_plan(r).tiers)
    return evolve(
        r.bench, r.original, e, train=tasks, dev=dev, mutators=ops, adapter=r.base_ref, carried=carried,
        labelled=r.labelled, labelled_demos=shown,
    )  # fmt: skip


def labelled_demos(r: Round, tiers: list[int]) -> HCPConfig | None:
    """The original config showing the labelled references of the tiers in play as demos, the fewest of
    ``evolve.demo_k`` per task in the first of ``evolve.demo_styles`` (the search's first child); None without a
    labelled budget, or with fewer than two labels."""
    e = r.config.evolve
    refs = labels.references(r.bench.env, [t for t in r.labelled or [] if t.tier in tiers])
    if len(refs) < 2:
        return None
    return labels.demos_config(r.original, refs, min(e.demo_k), e.demo_styles[0])


def make_reflector(r: Round) -> Policy:
    """The optimiser LLM of the reflective mutator: a served model, or the round's own policy."""
    s = r.config.evolve.reflection
    if s.model == "policy":
        return r.bench.policy
    if s.base_url is None:
        from autoevolve.policy.local import LocalPolicy

        return LocalPolicy(s.model, batch_size=1)
    from autoevolve.policy.openai import OpenAIPolicy

    return OpenAIPolicy(s.model, s.base_url, s.api_key_env)


def stage_select(r: Round) -> Selection:
    """Stage 2: pair evolved-config rollouts with the original's per train task; keep the wins."""
    s, evolved = r.config.select, result(r, "evolve")
    tasks = plan.train_of(r.bench, task_plan(r), s.train_tasks)  # includes stage 1's tasks: reused
    kept = [evolved.configs[c.hcp_id] for c in evolved.candidates if c.status == "keep" and c.hcp_id != r.original.id]
    order = [evolved.best] + [h for h in reversed(kept) if h.id != evolved.best.id]
    sampled = best_per_tier(r, evolved) if s.best_of > 1 else None
    budget = None
    if s.rollouts is not None:  # what the search left of its budget is harvested too
        limit = r.config.evolve.budget.rollouts
        budget = s.rollouts + max(0, limit - evolved.budget.get("rollouts", limit)) if limit else s.rollouts
    return select(r.bench, r.original, order, tasks, s, adapter=r.base_ref, sampled=sampled, budget=budget)


def best_per_tier(r: Round, evolved: EvolveResult) -> dict[int, HCPConfig]:
    """Per tier in play, the kept config with the best dev score on that tier's tasks (the best overall among
    equals), sampled at the select temperature: a new tier's samples come from the config that opened it. A tier
    where no kept config beats the original (nothing scores there, or the search found nothing better) is sampled
    with its own references as demos (``select.new_tier_demos``): the original's own samples repeat the live
    adapter's failures."""
    s = r.config.select
    tier_of = {t.id: t.tier for t in tasks_in_play(r, "dev", r.config.evolve.dev_tasks)}
    kept = [c for c in evolved.candidates if c.status == "keep"]
    out = {}
    for tier in task_plan(r).tiers:
        score = {c.hcp_id: mean([v for task, v in c.scores.items() if tier_of.get(task) == tier]) for c in kept}
        top = max(kept, key=lambda c: (score[c.hcp_id], c.hcp_id == evolved.best.id))
        hcp = evolved.configs[top.hcp_id]
        stuck = score[top.hcp_id] == 0.0 or score[top.hcp_id] <= score.get(r.original.id, 0.0)
        if stuck and s.new_tier_demos and r.config.evolve.references:
            hcp = tier_demos(r, tier, s.new_tier_demos) or hcp
        out[tier] = hcp.sampled(s.temperature)
    return out


def tier_demos(r: Round, tier: int, k: int) -> HCPConfig | None:
    """The original config showing k of a tier's labelled train solutions as full demos, the nearest per task
    (a task never sees its own); None when the tier's train tasks have no labels."""
    tasks = r.labelled
    if tasks is None:
        tasks = plan.train_of(r.bench, task_plan(r), r.config.select.train_tasks)
    items = [Demo(task_id=t.id, messages=m) for t in tasks if t.tier == tier and (m := r.bench.env.reference(t))]
    if len(items) < 2:
        return None
    demos = Demos(items=items, select="nearest", k=min(k, len(items) - 1), style="full")
    return r.original.model_copy(update={"demos": demos})


def stage_distill(r: Round) -> Distilled:
    """Stage 3: train the expert's next version from A_r under the original config (SFT, DPO or GRPO).

    The trained adapter is registered once per (run, round): if a crash came after registering it, the
    registered one is taken back instead of training a second version.
    """
    evolved, selection = result(r, "evolve"), result(r, "select")
    if not selection.items and not r.trained_labels:
        raise ValueError("selection kept no trajectories: the evolved config beat the original on no train task")
    name, store = r.config.expert, r.bench.store
    mine = [  # a warm start's adapter holds no selection
        a for a in store.adapters(name) if a.run_id == r.bench.run_id and a.round == r.bench.round and a.selection_id
    ]
    if mine:
        trained = TrainResult.model_validate_json((Path(mine[0].path) / "train_result.json").read_text())
        r.bench.policy.add_adapter(mine[0].ref, mine[0].path)
        return Distilled(mine[0], trained)
    version = store.next_adapter_version(name)
    out = registry.adapter_dir(r.run_dir / "adapters", name, version)  # absolute: the registry must not depend on cwd
    d = r.config.distill
    init = r.base_adapter.path if r.base_adapter and d.init == "live" else None
    replay = lineage_selections(r) if d.replay else []
    rehearsal = rehearsed(r)
    refs = labels.references(r.bench.env, r.trained_labels)
    judge = dev_judge(r, f"{name}@v{version}") if d.epoch_grid else None
    job = DistillJob(
        r.bench.store, r.bench.env, selection, r.original, r.config.model.name, out, init_adapter=init, replay=replay,
        rehearsal=rehearsal, references=refs, judge=judge,
    )  # fmt: skip
    trained = TRAINERS[r.config.distill.trainer](job, r.config.distill)
    (Path(trained.path) / "train_result.json").write_text(trained.model_dump_json(indent=2))
    registry.write_harness(trained.path, r.original)  # served under the config it learned under
    record = registry.register(
        store,
        name=name,
        path=trained.path,
        base_model=base_model_id(r.config.model.name),
        parent_version=r.base_adapter.version if r.base_adapter else None,
        run_id=r.bench.run_id,
        round=r.bench.round,
        hcp_id=r.original.id,
        evolved_hcp_id=evolved.best.id,
        selection_id=selection.id,
    )
    r.bench.policy.add_adapter(record.ref, record.path)
    return Distilled(record, trained)


def judged_tasks(r: Round, tiers: list[int]) -> list[Task]:
    """The dev tasks that choose the training length (``distill.epoch_grid``): the last ``distill.dev_tasks`` of the
    tiers; none without a grid."""
    if not r.config.distill.epoch_grid:
        return []
    return plan.in_play(r.bench.env.tasks("dev"), tiers)[-r.config.distill.dev_tasks :]


def gated_tasks(r: Round, tiers: list[int]) -> list[Task]:
    """The dev tasks the gate decides on: the first ``gate.dev_tasks`` of the tiers, never one that chose the
    training length (the gate must not score an adapter on the tasks it was picked on)."""
    judged = {t.id for t in judged_tasks(r, tiers)}
    dev = [t for t in plan.in_play(r.bench.env.tasks("dev"), tiers) if t.id not in judged]
    return dev[: r.config.gate.dev_tasks]


def dev_judge(r: Round, ref: str, tiers: list[int] | None = None) -> Judge:
    """Scores an adapter folder for choosing the training length on ``judged_tasks`` of the tiers in play (or of
    ``tiers``), under the original config."""
    return length_judge(r.bench, r.original, judged_tasks(r, tiers or task_plan(r).tiers), ref)


def rehearsed(r: Round) -> list[Trajectory]:
    """A_r's full-reward rollouts under the original config on the round's pool tasks (the plan's), one per task;
    none unless ``distill.rehearse`` is on and this round is ``distill.rehearse_from_round`` or later."""
    d = r.config.distill
    if not d.rehearse or r.bench.round < d.rehearse_from_round:
        return []
    solved = sorted(task for task, reward in task_plan(r).pool.items() if reward >= 1.0)
    found = r.bench.store.trajectories(
        r.bench.run_id, hcp_id=r.original.id, adapter=r.base_ref, task_ids=solved, min_reward=1.0
    )
    own = [t for t in found if t.sample == 0]  # the plan's rollout: one per task (the store's key)
    say(f"  distill: the live adapter solves {len(own)} pool tasks; those no selection holds are rehearsed")
    return own


def lineage_selections(r: Round) -> list[Selection]:
    """The selections that trained the live adapter and its ancestors, newest first (replayed in training)."""
    out, adapter, store = [], r.base_adapter, r.bench.store
    while adapter is not None:
        if adapter.selection_id:
            out.append(store.selection(adapter.selection_id))
        adapter = store.adapter(adapter.name, adapter.parent_version) if adapter.parent_version else None
    return out


def stage_gate(r: Round) -> EvalReport:
    """Gate on dev: should A_{r+1} replace A_r under the original config? (The guard set can still say no.)"""
    evolved, record = result(r, "evolve"), result(r, "distill").adapter
    dev = gated_tasks(r, task_plan(r).tiers)
    report = gate(
        r.bench, r.original, evolved.best, r.base_ref, record.ref, dev, r.config.gate.min_gain,
        tier_tolerance=r.config.gate.tier_tolerance, evolved_tasks=r.config.gate.evolved_tasks,
        alpha=r.config.gate.alpha,
    )  # fmt: skip
    g = r.config.gate.guard
    if g is not None:
        b = r.bench
        env = g.env.make()
        bench = Workbench(b.policy, env, b.store, b.run_id, b.round, b.seed, endpoint_stop=b.endpoint_stop)
        hcp = HCPConfig.from_yaml(g.hcp).with_env_tools(env.tools()) if g.hcp else r.original
        tasks = bench.env.tasks("dev")[: g.tasks]
        report = with_guard(bench, report, guard_check(bench, hcp, r.base_ref, record.ref, tasks, g.tolerance, g.label))
    return report


def declined(r: Round, report: EvalReport, why: str) -> EvalReport:
    """The gate's report turned into a rejection by the approval step, with why."""
    return decline(r.bench, report, why)


def stage_decide(r: Round, dev: EvalReport | None = None) -> Decided:
    """Promote or reject in the registry as the (approved) dev report says; promotion hooks tell the fleet.

    A version that is live already (a crash came after its promotion) is not promoted a second time.
    """
    record = result(r, "distill").adapter
    dev = dev or result(r, "gate")
    live = r.bench.store.promoted_adapter(record.name)
    if dev.decision == "promote" and live is not None and live.version == record.version:
        return Decided(live, dev)
    return Decided(
        registry.decide(r.bench.store, record, dev, registry.Publisher.from_settings(r.config.registry)), dev
    )


def stage_report(r: Round) -> EvalReport:
    """The 2x2 on held-out test tasks of every tier (reported, never used to decide): the same tasks every round,
    so rounds compare task by task."""
    evolved, record = result(r, "evolve"), result(r, "decide").adapter
    test = r.bench.env.tasks("test")[: r.config.gate.test_tasks]
    return held_out(r.bench, r.original, evolved.best, r.base_ref, record.ref, test, r.config.gate.evolved_tasks)


def _load_evolve(r: Round, data: dict[str, Any]) -> EvolveResult:
    """The search's result from its ledger rows and stored configs."""
    store = r.bench.store
    candidates = store.candidates(r.bench.run_id, r.bench.round)
    configs = {r.original.id: r.original}
    for c in candidates:
        if c.status != "crash" and c.hcp_id not in configs:  # a crashed proposal has no config
            configs[c.hcp_id] = HCPConfig.model_validate(store.get_hcp(c.hcp_id))
    return EvolveResult(configs[data["best"]], r.original, candidates, configs, data["budget"])


def _load_adapter(r: Round, name: str, version: int) -> AdapterRecord:
    """A registered adapter, made available to the round's policy."""
    record = r.bench.store.adapter(name, version)
    r.bench.policy.add_adapter(record.ref, record.path)
    return record


def _load_warm(r: Round, data: dict[str, Any]) -> Decided:
    """The warm start's adapter and gate report, the adapter made A_r if it went live."""
    adapter = r.bench.store.adapter(data["name"], data["version"])
    went_live = data.get("live", adapter.status == "promoted")  # stored before "live" was: its status now
    return _warmed(r, Decided(adapter, EvalReport.model_validate(data["dev"])), went_live, load=True)


def _dump_adapter(a: AdapterRecord) -> dict[str, Any]:
    return {"name": a.name, "version": a.version}


STAGES: dict[str, Stage] = {  # in the round's order
    "warm": Stage(
        stage_warm,
        lambda x: {
            **_dump_adapter(x.adapter),
            "live": x.adapter.status == "promoted",
            "dev": x.dev.model_dump(mode="json"),
        },
        _load_warm,
    ),
    "plan": Stage(stage_plan, lambda p: p.model_dump(mode="json"), lambda r, d: TaskPlan.model_validate(d)),
    "evolve": Stage(stage_evolve, lambda e: {"best": e.best.id, "budget": e.budget}, _load_evolve),
    "select": Stage(
        stage_select, lambda s: {"selection_id": s.id}, lambda r, d: r.bench.store.selection(d["selection_id"])
    ),
    "distill": Stage(
        stage_distill,
        lambda x: {**_dump_adapter(x.adapter), "train": x.train.model_dump(mode="json")},
        lambda r, d: Distilled(_load_adapter(r, d["name"], d["version"]), TrainResult.model_validate(d["train"])),
    ),
    "gate": Stage(stage_gate, lambda dev: dev.model_dump(mode="json"), lambda r, d: EvalReport.model_validate(d)),
    "decide": Stage(
        stage_decide,
        lambda x: {**_dump_adapter(x.adapter), "dev": x.dev.model_dump(mode="json")},
        lambda r, d: Decided(_load_adapter(r, d["name"], d["version"]), EvalReport.model_validate(d["dev"])),
    ),
    "report": Stage(stage_report, lambda test: test.model_dump(mode="json"), lambda r, d: EvalReport.model_validate(d)),
}


def _trained(x: Distilled) -> str:
    """What stage 3 did, in one line."""
    t = x.train
    chosen = f", epoch {t.epochs:g} chosen on dev" if t.epochs is not None else ""
    return f"{x.adapter.ref} trained on {t.examples} examples, {t.steps} steps{chosen}"


def _unpaired(s: Selection) -> str:
    """How many kept wins had no rollout of the original beside them (``select.unpaired_after``)."""
    n = sum(i.baseline_sample < 0 for i in s.items)
    return f" ({n} unpaired: the original solves none of their tier's stored tasks)" if n else ""


SUMMARY: dict[str, Any] = {  # each stage's one line when it ends
    "warm": lambda x: f"{x.adapter.ref} {x.adapter.status} (dev gain {x.dev.gain:+.3f})",
    "plan": lambda p: p.why,
    "evolve": lambda e: (
        f"{len(e.candidates) - 1} children tried, best dev {e.best_dev:.3f} (the original "
        f"{e.candidates[0].mean_reward:.3f}), {e.budget.get('rollouts', 0)} rollouts, stopped on {e.budget.get('stop')}"
    ),
    "select": lambda s: f"kept {len(s.items)} wins on {len({i.task_id for i in s.items})} tasks" + _unpaired(s),
    "distill": _trained,
    "gate": lambda dev: f"{dev.decision} (dev gain {dev.gain:+.3f}, p = {dev.p_value:.4f})",
    "decide": lambda x: f"{x.adapter.ref} {x.adapter.status}",
    "report": lambda test: f"test gain {test.gain:+.3f} [{test.gain_ci[0]:+.3f}, {test.gain_ci[1]:+.3f}]",
}
