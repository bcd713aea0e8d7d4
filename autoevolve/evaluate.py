"""The gate and the held-out table: {base, new adapter} x {original, evolved config}.

The promotion decision is made on dev tasks only; test tasks fill the report and decide nothing.
"""

from __future__ import annotations

from autoevolve.hcp import HCPConfig
from autoevolve.records import Cell, EvalReport, Task
from autoevolve.workbench import Workbench, mean

CELLS = ("base_original", "base_evolved", "adapter_original", "adapter_evolved")


def cells(
    bench: Workbench,
    tasks: list[Task],
    configs: dict[str, HCPConfig],
    adapters: dict[str, str],
    names: tuple[str, ...],
    stage: str,
) -> dict[str, Cell]:
    """Score each named cell ('<adapter key>_<config key>') on the tasks."""
    out = {}
    for name in names:
        adapter_key, config_key = name.split("_", 1)
        hcp, adapter = configs[config_key], adapters[adapter_key]
        trajs = bench.rollouts(hcp, tasks, adapter=adapter, stage=stage)
        out[name] = Cell(
            adapter=adapter,
            hcp_id=hcp.id,
            mean=mean([t.reward for t in trajs]),
            n=len(trajs),
            prompt_tokens=mean([float(t.prompt_tokens) for t in trajs]),
        )
    return out


def gate(
    bench: Workbench,
    original: HCPConfig,
    base: str,
    candidate: str,
    dev_tasks: list[Task],
    min_gain: float = 0.0,
) -> EvalReport:
    """Promote only if the candidate adapter with the original config beats the base with it on dev."""
    configs, adapters = {"original": original}, {"base": base, "adapter": candidate}
    table = cells(bench, dev_tasks, configs, adapters, ("base_original", "adapter_original"), "gate")
    gain = table["adapter_original"].mean - table["base_original"].mean
    verdict = "promote" if gain > min_gain else "reject"
    words = "beats" if verdict == "promote" else "does not beat"
    reason = (
        f"{candidate} + original config scores {table['adapter_original'].mean:.3f} on {len(dev_tasks)} dev tasks, "
        f"{gain:+.3f} vs {base or 'base'} + original ({table['base_original'].mean:.3f}); "
        f"it {words} the required gain of more than {min_gain:.3f}"
    )
    report = EvalReport(
        run_id=bench.run_id, round=bench.round, split="dev", cells=table, decision=verdict, reason=reason
    )
    bench.store.put_evaluation(report)
    return report


def held_out(
    bench: Workbench, original: HCPConfig, evolved: HCPConfig, base: str, candidate: str, test_tasks: list[Task]
) -> EvalReport:
    """The full 2x2 on test tasks, for the report only."""
    configs, adapters = {"original": original, "evolved": evolved}, {"base": base, "adapter": candidate}
    table = cells(bench, test_tasks, configs, adapters, CELLS, "report")
    report = EvalReport(
        run_id=bench.run_id,
        round=bench.round,
        split="test",
        cells=table,
        decision="report",
        reason=f"held-out table on {len(test_tasks)} test tasks; it decides nothing",
    )
    bench.store.put_evaluation(report)
    return report


def format_table(report: EvalReport) -> str:
    """The 2x2 as aligned text with mean prompt tokens per config."""
    c = report.cells
    rows = [f"{'':<16}{'original config':>18}{'evolved config':>18}"]
    for key, label in (("base", "base model"), ("adapter", "new adapter")):
        vals = [c.get(f"{key}_{cfg}") for cfg in ("original", "evolved")]
        rows.append(f"{label:<16}" + "".join(f"{v.mean:>18.3f}" if v else f"{'-':>18}" for v in vals))
    tokens = [c.get(f"base_{cfg}") for cfg in ("original", "evolved")]
    rows.append(f"{'prompt tokens':<16}" + "".join(f"{v.prompt_tokens:>18.0f}" if v else f"{'-':>18}" for v in tokens))
    n = next(iter(c.values())).n if c else 0
    return f"{report.split} split, {n} tasks, mean reward\n" + "\n".join(rows)
