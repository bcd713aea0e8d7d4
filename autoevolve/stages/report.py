"""What a round leaves behind: report.json per round, rounds.json per run, and their text summaries."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoevolve.records import CELLS, GRAMMAR, AdapterRecord, EvalReport, Selection, TaskPlan, renamed_cells
from autoevolve.views.table import text_table
from autoevolve.views.twobytwo import SHORT_LABELS, score

if TYPE_CHECKING:  # types only: reading reports needs no engine
    from autoevolve.config import RunConfig
    from autoevolve.records import TrainResult
    from autoevolve.round import Round
    from autoevolve.stages.evolve import EvolveResult


def write_report(
    r: Round,
    task_plan: TaskPlan | None,
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
        "live_adapter": r.base_ref or None,
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
        "plan": _plan(r, task_plan),
        "warm_start": _warm(r),
        "labels": None if r.labelled is None else {"budget": len(r.labelled), "tasks": [t.id for t in r.labelled]},
        "rollouts": r.bench.store.count_trajectories(r.bench.run_id, r.bench.round),
        "failed_rollouts": r.bench.store.count_trajectories(r.bench.run_id, r.bench.round, backend_failed=True),
        "selected": len(selection.items),
        "selection": _selection(r, evolved, selection),
        "selection_id": selection.id,
        "promoted": bool(record and record.status == "promoted"),
        "adapter": record.ref if record else None,
        "adapter_path": record.path if record else None,
        "train": train.model_dump() if train else None,
        "seconds": dict(r.seconds),
    }
    if test is not None and dev is not None:
        c = test.cells
        report["eval"] = {name: c[name].mean for name in CELLS} | {"n_tasks": c["live_original"].n, "split": "test"}
        report["eval_ci"] = {name: list(c[name].ci) for name in CELLS}
        report["eval_tiers"] = test.tiers
        report["gain"] = {"test": test.gain, "test_ci": list(test.gain_ci), "test_p": test.p_value}
        report["gain"] |= {"dev": dev.gain, "dev_ci": list(dev.gain_ci), "dev_p": dev.p_value}
        report["retention"] = {"test": test.retention, "dev": dev.retention}
        if GRAMMAR in c:  # the evolved config decodes under the tool-call grammar
            g = c[GRAMMAR]
            report["grammar"] = {GRAMMAR: g.mean, "ci": list(g.ci), "retention": test.grammar_retention}
        report["prompt_tokens"] = {
            "original": c["live_original"].prompt_tokens,
            "evolved": c["live_evolved"].prompt_tokens,
        }
        report["gate"] = {
            "split": "dev",
            "decision": dev.decision,
            "reason": dev.reason,
            "cells": {k: v.mean for k, v in dev.cells.items()},
            "n_tasks": dev.cells["live_original"].n,
            "p_value": dev.p_value,
            "guard": dev.guard.model_dump() | {"drop": dev.guard.drop} if dev.guard else None,
            "tiers": dev.tiers,
        }
    r.run_dir.mkdir(parents=True, exist_ok=True)
    (r.run_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _warm(r: Round) -> dict[str, Any] | None:
    """Round 0's start from SFT on the labels, when there was one: the adapter and the dev gate's verdict."""
    warm = r.results.get("warm")
    if warm is None:
        return None
    return {"adapter": warm.adapter.ref, "decision": warm.dev.decision, "dev_gain": warm.dev.gain}


def _plan(r: Round, task_plan: TaskPlan | None) -> dict[str, Any] | None:
    """What the round worked on: tiers in play, the frontier, and the tiers of its drawn train tasks."""
    if task_plan is None:
        return None
    drawn = task_plan.train[: max(r.config.evolve.train_tasks, r.config.select.train_tasks)]
    tier_of = {t.id: str(t.tier) for t in r.bench.env.tasks("train")}
    counts = Counter(tier_of[task_id] for task_id in drawn)
    frontier = set(task_plan.frontier)
    return {
        "tiers": task_plan.tiers,
        "dev_scores": task_plan.dev_scores,
        "pool": len(task_plan.pool),
        "frontier": len(task_plan.frontier),
        "drawn_from_frontier": sum(i in frontier for i in drawn),
        "drawn_per_tier": dict(sorted(counts.items())),
        "why": task_plan.why,
    }


def _selection(r: Round, evolved: EvolveResult, selection: Selection) -> dict[str, Any]:
    """Where the kept rollouts came from: the search's configs or best-of-k samples, and the tiers of their tasks."""
    searched = {c.hcp_id for c in evolved.candidates}
    tier_of = {t.id: str(t.tier) for t in r.bench.env.tasks("train")}
    per_tier = Counter(tier_of[item.task_id] for item in selection.items)
    by_id = {c.hcp_id: c for c in evolved.candidates if c.parents}  # a config's proposal, not its re-score
    lineage, at, seen = [], by_id.get(evolved.best.id), set()
    while at is not None and at.hcp_id not in seen:  # the mutators that made the best config, first one first
        seen.add(at.hcp_id)
        lineage.insert(0, at.mutator)
        at = by_id.get(at.parents[0])
    return {
        "items": len(selection.items),
        "from_search": sum(i.hcp_id in searched for i in selection.items),
        "from_samples": sum(i.hcp_id not in searched for i in selection.items),
        "per_tier": dict(sorted(per_tier.items())),
        "best_lineage": lineage,
    }


def round_row(report: dict[str, Any]) -> dict[str, Any]:
    """One round's line of the loop summary: decision, test 2x2 with intervals, gain, retention, cost. A report
    written with the older cell names (base_*, adapter_*) reads under today's."""
    report = renamed_cells(report)
    return {
        "round": report["round"],
        "adapter": report["adapter"],
        "live_adapter": report.get("live_adapter"),
        "promoted": report["promoted"],
        "decision": report.get("gate", {}).get("decision", "nothing selected"),
        "eval": report.get("eval"),
        "eval_ci": report.get("eval_ci"),
        "tiers": report.get("eval_tiers"),
        "plan": report.get("plan"),
        "selected": report.get("selected"),
        "selection": report.get("selection"),
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
    """The loop summary as aligned text: per round, the new adapter's test score under the original config
    (A_r+1+orig) and the decision."""
    head = ["round", "adapter", "decision", SHORT_LABELS["new_original"], "retention", "rollouts"]
    rows = []
    for row in map(round_row, reports):
        kept = (row["retention"] or {}).get("test")
        shown = score(row["eval"]["new_original"]) if row["eval"] else "-"
        rows.append([str(row["round"]), row["adapter"] or "-", row["decision"], shown,
                     "-" if kept is None else f"{kept:.2f}", str(row["rollouts"])])  # fmt: skip
    return text_table(head, rows, right=(3, 4, 5))
