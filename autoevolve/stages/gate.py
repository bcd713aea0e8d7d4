"""The gate and the held-out table: {live adapter A_r, new adapter A_r+1} x {original, evolved config}, with
bootstrap intervals (cell names and the table's text: ``autoevolve.views.twobytwo``).

The promotion decision is made on dev tasks only: the new adapter with the original config must beat the live
adapter with it, and an exact paired sign-flip test of that gain must give p < alpha (0.025, one-sided: the level
of a 95% interval's lower end). The exact test holds its level on few tasks with 0/1 rewards, where a percentile
bootstrap interval is too narrow; the interval is reported beside it. Test tasks fill the report and decide
nothing. Retention = gain / (live_evolved - live_original): how much of what the evolved prompt gave the live
adapter the new adapter now gives with the short original prompt. The functions here are the only writers of
evaluations to the store (``_record``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import GRAMMAR, Cell, EvalReport, Guard, Task
from autoevolve.stats import ALPHA, bootstrap_ci, mean, sign_flip_p


def cells(
    bench: Workbench,
    tasks: list[Task],
    configs: dict[str, HCPConfig],
    adapters: dict[str, str],
    stage: str,
    evolved_tasks: int | None = None,
) -> tuple[dict[str, Cell], dict[str, list[float]]]:
    """Every cell ('<adapter key>_<config key>', e.g. 'live_original') on the tasks, and each cell's rewards in task
    order. With ``evolved_tasks`` the evolved-config cells run on the first that many tasks only (they decide
    nothing, and their long prompts cost most of a table)."""
    table, rewards = {}, {}
    for adapter_key, adapter in adapters.items():
        for config_key, hcp in configs.items():
            used = tasks[:evolved_tasks] if config_key == "evolved" else tasks
            trajs = bench.rollouts(hcp, used, adapter=adapter, stage=stage)
            name = f"{adapter_key}_{config_key}"
            rewards[name] = [t.reward for t in trajs]
            table[name] = Cell(
                adapter=adapter,
                hcp_id=hcp.id,
                mean=mean(rewards[name]),
                n=len(trajs),
                ci=bootstrap_ci(rewards[name], bench.seed),
                prompt_tokens=mean([float(t.prompt_tokens) for t in trajs]),
            )
    return table, rewards


def by_tier(tasks: list[Task], rewards: dict[str, list[float]]) -> dict[str, dict[str, float | int]]:
    """Each cell's mean reward per task tier (over the tasks it ran on: a cell's rewards follow the task order,
    and may stop early), and the tier's task count."""
    out: dict[str, dict[str, float | int]] = {}
    for tier in sorted({t.tier for t in tasks}):
        at = [i for i, t in enumerate(tasks) if t.tier == tier]
        means: dict[str, float | int] = {
            name: mean([values[i] for i in at if i < len(values)]) for name, values in rewards.items()
        }
        out[str(tier)] = means | {"n_tasks": len(at)}
    return out


def compare(
    bench: Workbench, split: str, table: dict[str, Cell], rewards: dict[str, list[float]], tasks: list[Task]
) -> EvalReport:
    """The report of a 2x2: the paired gain of the new adapter over the live one under the original config, its
    interval, retention (on the tasks the evolved cells ran on, when those are fewer)."""
    diffs = [a - b for a, b in zip(rewards["new_original"], rewards["live_original"], strict=True)]
    n = len(rewards["live_evolved"])
    prompt_gain = table["live_evolved"].mean - mean(rewards["live_original"][:n])
    gain = mean(diffs)
    kept = mean(diffs[:n])
    return EvalReport(
        run_id=bench.run_id,
        round=bench.round,
        split=split,
        cells=table,
        decision="report",
        reason="",
        gain=gain,
        gain_ci=bootstrap_ci(diffs, bench.seed),
        p_value=sign_flip_p(diffs, bench.seed),
        retention=kept / prompt_gain if prompt_gain > 0 else None,
        tiers=by_tier(tasks, rewards),
    )


def gate(
    bench: Workbench,
    original: HCPConfig,
    evolved: HCPConfig,
    live: str,
    candidate: str,
    dev_tasks: list[Task],
    min_gain: float = 0.0,
    tier_tolerance: float | None = None,
    evolved_tasks: int | None = None,
    alpha: float = ALPHA,
) -> EvalReport:
    """The 2x2 on dev of ``live`` (A_r's ref, '' for the bare base model) and ``candidate`` (A_{r+1}); promote
    only if the gain beats ``min_gain`` and its exact sign-flip p-value is below ``alpha``, and (with
    ``tier_tolerance``) no tier of the dev tasks drops by more than the tolerance."""
    configs, adapters = {"original": original, "evolved": evolved}, {"live": live, "new": candidate}
    report = compare(bench, "dev", *cells(bench, dev_tasks, configs, adapters, "gate", evolved_tasks), dev_tasks)
    (low, high), p = report.gain_ci, report.p_value
    promote = gate_decision(report.gain, p, min_gain, alpha)
    c = report.cells
    why = "" if promote else (" (needs a gain above the minimum)" if report.gain <= min_gain else " (not significant)")
    reason = (
        f"{candidate} + original config scores {c['new_original'].mean:.3f} on {len(dev_tasks)} dev tasks vs "
        f"{live or 'base model'} + original {c['live_original'].mean:.3f}: gain {report.gain:+.3f}, 95% CI "
        f"[{low:+.3f}, {high:+.3f}], sign-flip p = {p:.4f}{why}; required: gain > {min_gain:.3f} and p < {alpha:g}"
    )
    if tier_tolerance is not None:
        gains = {k: v["new_original"] - v["live_original"] for k, v in report.tiers.items()}
        worse = [k for k, g in gains.items() if g < -tier_tolerance - 1e-9]
        shown = ", ".join(f"tier {k} {g:+.3f}" for k, g in gains.items())
        reason += f"; per tier: {shown} (tolerance {tier_tolerance:.3f})"
        if worse:
            promote = False
            reason += f": tier {worse[0]} dropped beyond it"
    return _record(bench, report.model_copy(update={"decision": "promote" if promote else "reject", "reason": reason}))


def length_judge(bench: Workbench, original: HCPConfig, tasks: list[Task], ref: str) -> Callable[[str, int], float]:
    """What chooses a training length on dev (``distill.epoch_grid``): an epoch's adapter folder scored under the
    original config on the tasks, its rollouts stored under '<ref>-epoch<N>'."""

    def judge(path: str, epoch: int) -> float:
        weights = (Path(path) / "adapter_model.safetensors").read_bytes()
        name = f"{ref}-epoch{epoch}-{hashlib.sha256(weights).hexdigest()[:8]}"  # these weights' own rollouts; no '.'
        bench.policy.add_adapter(name, path)
        try:
            return mean([t.reward for t in bench.rollouts(original, tasks, adapter=name, stage="distill")])
        finally:
            bench.policy.remove_adapter(name)

    return judge


def gate_decision(gain: float, p_value: float | None, min_gain: float = 0.0, alpha: float = ALPHA) -> bool:
    """Whether a paired dev gain promotes: above the minimum, and significant at ``alpha`` (one-sided)."""
    return gain > min_gain and p_value is not None and p_value < alpha


def guard_check(
    bench: Workbench, hcp: HCPConfig, live: str, candidate: str, tasks: list[Task], tolerance: float, label: str
) -> Guard:
    """Both adapters on the guard tasks (another tier or environment) under that environment's original config."""
    means = [mean([t.reward for t in bench.rollouts(hcp, tasks, adapter=a, stage="guard")]) for a in (live, candidate)]
    return Guard(env=label, n=len(tasks), base=means[0], candidate=means[1], tolerance=tolerance)


def with_guard(bench: Workbench, report: EvalReport, guard: Guard) -> EvalReport:
    """The gate's report with the guard's verdict added; a drop beyond the tolerance turns a promotion into a reject."""
    verdict = (
        f"guard ({guard.env}, {guard.n} tasks): {guard.base:.3f} -> {guard.candidate:.3f}, "
        f"drop {guard.drop:+.3f}, tolerance {guard.tolerance:.3f}{'' if guard.ok else ' exceeded'}"
    )
    decision = report.decision if guard.ok else "reject"
    return _record(
        bench, report.model_copy(update={"decision": decision, "reason": f"{report.reason}; {verdict}", "guard": guard})
    )


def decline(bench: Workbench, report: EvalReport, why: str) -> EvalReport:
    """The gate's report turned into a rejection by the approval step, with why."""
    reason = f"{report.reason}; not approved: {why}"
    return _record(bench, report.model_copy(update={"decision": "reject", "reason": reason}))


def held_out(
    bench: Workbench,
    original: HCPConfig,
    evolved: HCPConfig,
    live: str,
    candidate: str,
    test_tasks: list[Task],
    evolved_tasks: int | None = None,
) -> EvalReport:
    """The 2x2 on test tasks, for the report only."""
    configs, adapters = {"original": original, "evolved": evolved}, {"live": live, "new": candidate}
    table, rewards = cells(bench, test_tasks, configs, adapters, "report", evolved_tasks)
    report = compare(bench, "test", table, rewards, test_tasks)
    n = min(evolved_tasks or len(test_tasks), len(test_tasks))
    shown = f" (evolved config on the first {n})" if n < len(test_tasks) else ""
    reason = f"held-out table on {len(test_tasks)} test tasks{shown}; it decides nothing"
    report = report.model_copy(update={"reason": reason})
    if evolved.decoding.constrain != "none" and original.decoding.constrain == "none":
        report = with_grammar_cell(bench, report, original, live, test_tasks, rewards)
    return _record(bench, report)


def with_grammar_cell(
    bench: Workbench,
    report: EvalReport,
    original: HCPConfig,
    live: str,
    tasks: list[Task],
    rewards: dict[str, list[float]],
) -> EvalReport:
    """The report with ``live_grammar`` (the live adapter, original config, decoding under the tool-call grammar)
    and the grammar's retention: how much of what the grammar alone gave, the new adapter keeps without it."""
    grammar = original.model_copy(update={"decoding": original.decoding.model_copy(update={"constrain": "tool_call"})})
    table, _ = cells(bench, tasks, {"grammar": grammar}, {"live": live}, "report")
    grammar_gain = table[GRAMMAR].mean - mean(rewards["live_original"])
    retention = report.gain / grammar_gain if grammar_gain > 0 else None
    return report.model_copy(update={"cells": report.cells | table, "grammar_retention": retention})


def _record(bench: Workbench, report: EvalReport) -> EvalReport:
    """Store an evaluation (one row per run, round and split: a later one replaces it) and return it."""
    bench.store.put_evaluation(report)
    return report
