"""One round of the loop as plain library functions; ``flows/`` wraps each in a Prefect task.

round r: evolve configs around adapter A_r -> select what the best config unlocked -> distil it into A_{r+1}
under the original config -> gate on dev -> promote or reject -> report the 2x2 on test.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoevolve import registry
from autoevolve.config import RunConfig
from autoevolve.distill import TrainResult
from autoevolve.distill.trainers import TRAINERS, DistillJob
from autoevolve.envs import make_env
from autoevolve.evaluate import CELLS, gate, guard_check, held_out, with_guard
from autoevolve.evolve import EvolveResult, evolve, make_mutators, train_tasks
from autoevolve.hcp import HCPConfig
from autoevolve.model import base_model_id
from autoevolve.policy import Policy
from autoevolve.records import AdapterRecord, EvalReport, Selection
from autoevolve.select import select
from autoevolve.store import Store
from autoevolve.workbench import Workbench


@dataclass
class Round:
    """Everything one round shares: the config, the workbench, the original config and the live adapter."""

    config: RunConfig
    bench: Workbench
    original: HCPConfig
    base_adapter: AdapterRecord | None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def base_ref(self) -> str:
        """Adapter name of A_r ('' when the bare base model serves the expert)."""
        return self.base_adapter.ref if self.base_adapter else ""

    @property
    def evolved_before(self) -> HCPConfig | None:
        """The evolved config whose rollouts trained A_r (None for the bare base, or if it was the original)."""
        a = self.base_adapter
        if a is None or not a.evolved_hcp_id or a.evolved_hcp_id == self.original.id:
            return None
        return HCPConfig.model_validate(self.bench.store.get_hcp(a.evolved_hcp_id))

    @property
    def run_dir(self) -> Path:
        """Folder of this run's report and adapters."""
        return Path(self.config.run_dir) / str(self.config.run_id)


def make_policy(config: RunConfig) -> Policy:
    """The policy the config names."""
    m = config.model
    if m.backend == "openai":
        from autoevolve.policy.openai import OpenAIPolicy

        o = m.openai
        return OpenAIPolicy(m.name, o.base_url, o.api_key_env, o.concurrency, o.timeout_s, o.max_retries)
    from autoevolve.policy.local import LocalPolicy

    return LocalPolicy(m.name, batch_size=m.batch_size)


def open_round(config: RunConfig, policy: Policy | None = None, round: int | None = None) -> Round:
    """Open the store, build env and policy, and load the expert's live adapter (A_r) if there is one.

    Without an explicit ``round``, the round number is the count of adapters this run already trained, so
    running the same config again starts the next round from the adapter the last one promoted.
    """
    store = Store(config.store)
    if round is None:
        round = sum(a.run_id == config.run_id for a in store.adapters(config.expert))
    store.put_run(str(config.run_id), json.loads(config.model_dump_json()))
    env = make_env(config.env.name, **config.env.options())
    policy = policy or make_policy(config)
    live = store.promoted_adapter(config.expert)
    if live is not None:
        policy.add_adapter(live.ref, live.path)
    bench = Workbench(policy=policy, env=env, store=store, run_id=str(config.run_id), round=round, seed=config.seed)
    return Round(config=config, bench=bench, original=config.original_hcp(), base_adapter=live)


def timed(r: Round, stage: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a stage function and record its wall-clock seconds."""
    started = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        r.seconds[stage] = round(time.perf_counter() - started, 1)


def stage_evolve(r: Round) -> EvolveResult:
    """Stage 1: search HCP configs (train minibatches, dev scores) around the frozen adapter A_r."""
    e = r.config.evolve
    tasks = train_tasks(r.bench.env, e.train_tasks, r.config.seed)
    dev = r.bench.env.tasks("dev")[: e.dev_tasks]
    reflector = make_reflector(r) if "reflective" in e.mutators else None
    own = e.reflection.model == "policy"  # the policy reflects with the adapter it serves; another model with none
    ops = make_mutators(e, reflector, adapter=(r.base_ref or None) if own else None)
    carried = [r.evolved_before] if r.evolved_before else []
    return evolve(r.bench, r.original, e, train=tasks, dev=dev, mutators=ops, adapter=r.base_ref, carried=carried)


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


def stage_select(r: Round, evolved: EvolveResult) -> Selection:
    """Stage 2: pair evolved-config rollouts with the original's per train task; keep the wins."""
    s = r.config.select
    tasks = train_tasks(r.bench.env, s.train_tasks, r.config.seed)  # includes stage 1's tasks: reused
    kept = [evolved.configs[c.hcp_id] for c in evolved.candidates if c.status == "keep" and c.hcp_id != r.original.id]
    order = [evolved.best] + [h for h in reversed(kept) if h.id != evolved.best.id]
    return select(
        r.bench,
        r.original,
        order,
        tasks,
        adapter=r.base_ref,
        margin=s.margin,
        min_reward=s.min_reward,
        samples=s.samples,
        max_per_task=s.max_per_task,
        tier_ratio=s.tier_ratio,
    )


def stage_distill(r: Round, evolved: EvolveResult, selection: Selection) -> tuple[AdapterRecord, TrainResult]:
    """Stage 3: train the expert's next version from A_r under the original config (SFT, DPO or GRPO)."""
    if not selection.items:
        raise ValueError("selection kept no trajectories: the evolved config beat the original on no train task")
    name, version = r.config.expert, r.bench.store.next_adapter_version(r.config.expert)
    out = registry.adapter_dir(r.run_dir / "adapters", name, version)  # absolute: the registry must not depend on cwd
    init = r.base_adapter.path if r.base_adapter else None
    job = DistillJob(r.bench, selection, r.original, r.config.model.name, out, init_adapter=init)
    result = TRAINERS[r.config.distill.trainer](job, r.config.distill)
    record = registry.register(
        r.bench.store,
        name=name,
        path=result.path,
        base_model=base_model_id(r.config.model.name),
        parent_version=r.base_adapter.version if r.base_adapter else None,
        run_id=r.bench.run_id,
        round=r.bench.round,
        hcp_id=r.original.id,
        evolved_hcp_id=evolved.best.id,
        selection_id=selection.id,
    )
    r.bench.policy.add_adapter(record.ref, record.path)
    return record, result


def stage_gate(r: Round, evolved: EvolveResult, record: AdapterRecord) -> EvalReport:
    """Gate on dev: should A_{r+1} replace A_r under the original config? (The guard set can still say no.)"""
    dev = r.bench.env.tasks("dev")[: r.config.gate.dev_tasks]
    report = gate(r.bench, r.original, evolved.best, r.base_ref, record.ref, dev, r.config.gate.min_gain)
    g = r.config.gate.guard
    if g is not None:
        b = r.bench
        bench = Workbench(b.policy, make_env(g.env.name, **g.env.options()), b.store, b.run_id, b.round, b.seed)
        hcp = HCPConfig.from_yaml(g.hcp) if g.hcp else r.original
        tasks = bench.env.tasks("dev")[: g.tasks]
        report = with_guard(bench, report, guard_check(bench, hcp, r.base_ref, record.ref, tasks, g.tolerance, g.label))
    return report


def declined(r: Round, report: EvalReport, why: str) -> EvalReport:
    """The gate's report turned into a rejection by the approval step, with why."""
    report = report.model_copy(update={"decision": "reject", "reason": f"{report.reason}; not approved: {why}"})
    r.bench.store.put_evaluation(report)
    return report


def stage_decide(r: Round, record: AdapterRecord, report: EvalReport) -> AdapterRecord:
    """Promote or reject in the registry as the (approved) report says; promotion hooks tell the fleet."""
    return registry.decide(r.bench.store, record, report, registry.Publisher.from_settings(r.config.registry))


def stage_report(r: Round, evolved: EvolveResult, record: AdapterRecord) -> EvalReport:
    """The 2x2 on held-out test tasks (reported, never used to decide)."""
    test = r.bench.env.tasks("test")[: r.config.gate.test_tasks]
    return held_out(r.bench, r.original, evolved.best, r.base_ref, record.ref, test)


def write_report(
    r: Round,
    evolved: EvolveResult,
    selection: Selection,
    record: AdapterRecord | None = None,
    train: TrainResult | None = None,
    dev: EvalReport | None = None,
    test: EvalReport | None = None,
) -> dict[str, Any]:
    """Write report.json in the run folder and return it; without an adapter, the round stopped after selection."""
    report: dict[str, Any] = {
        "run_id": r.bench.run_id,
        "round": r.bench.round,
        "hcp": {"original": r.original.id, "evolved": evolved.best.id},
        "candidates": [
            {
                "hcp_id": x.hcp_id,
                "parents": x.parents,
                "mutator": x.mutator,
                "components": x.components,
                "status": x.status,
                "dev_mean": x.mean_reward if x.status == "keep" else None,
                "note": x.note,
            }
            for x in evolved.candidates
        ],
        "evolve": {
            "dev_original": evolved.candidates[0].mean_reward,
            "dev_best": evolved.best_dev,
            "budget": evolved.budget,
        },
        "rollouts": r.bench.store.count_trajectories(r.bench.run_id, r.bench.round),
        "selected": len(selection.items),
        "selection_id": selection.id,
        "promoted": bool(record and record.status == "promoted"),
        "adapter": record.ref if record else None,
        "adapter_path": record.path if record else None,
        "train": train.model_dump() if train else None,
        "seconds": dict(r.seconds),
    }
    if test is not None and dev is not None:
        c = test.cells
        report["eval"] = {name: c[name].mean for name in CELLS} | {"n_tasks": c["base_original"].n, "split": "test"}
        report["eval_ci"] = {name: list(c[name].ci) for name in CELLS}
        report["gain"] = {"test": test.gain, "test_ci": list(test.gain_ci)}
        report["gain"] |= {"dev": dev.gain, "dev_ci": list(dev.gain_ci)}
        report["retention"] = {"test": test.retention, "dev": dev.retention}
        report["prompt_tokens"] = {
            "original": c["base_original"].prompt_tokens,
            "evolved": c["base_evolved"].prompt_tokens,
        }
        report["gate"] = {
            "split": "dev",
            "decision": dev.decision,
            "reason": dev.reason,
            "cells": {k: v.mean for k, v in dev.cells.items()},
            "n_tasks": dev.cells["base_original"].n,
            "guard": dev.guard.model_dump() | {"drop": dev.guard.drop} if dev.guard else None,
        }
    r.run_dir.mkdir(parents=True, exist_ok=True)
    (r.run_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def round_row(report: dict[str, Any]) -> dict[str, Any]:
    """One round's line of the loop summary: decision, test 2x2 with intervals, gain, retention, cost."""
    return {
        "round": report["round"],
        "adapter": report["adapter"],
        "promoted": report["promoted"],
        "decision": report.get("gate", {}).get("decision", "nothing selected"),
        "eval": report.get("eval"),
        "eval_ci": report.get("eval_ci"),
        "gain": report.get("gain"),
        "retention": report.get("retention"),
        "prompt_tokens": report.get("prompt_tokens"),
        "rollouts": report["rollouts"],
        "train_seconds": (report.get("train") or {}).get("seconds"),
    }


def write_rounds(config: RunConfig, reports: list[dict[str, Any]]) -> Path:
    """Write rounds.json (one row per round) in the run folder; returns its path."""
    path = Path(config.run_dir) / str(config.run_id) / "rounds.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([round_row(r) for r in reports], indent=2))
    return path


def format_rounds(reports: list[dict[str, Any]]) -> str:
    """The loop summary as aligned text: per round, the test score of adapter + original config and the decision."""
    lines = [f"{'round':<7}{'adapter':<16}{'decision':<18}{'adapter+original':>18}{'retention':>11}{'rollouts':>10}"]
    for row in map(round_row, reports):
        score = f"{row['eval']['adapter_original']:.3f}" if row["eval"] else "-"
        kept = (row["retention"] or {}).get("test")
        lines.append(
            f"{row['round']:<7}{row['adapter'] or '-':<16}{row['decision']:<18}{score:>18}"
            f"{'-' if kept is None else f'{kept:.2f}':>11}{row['rollouts']:>10}"
        )
    return "\n".join(lines)
