"""The round flow: one Prefect task per stage, read top to bottom like the round itself.

Run: autoevolve run configs/quickstart.yaml   (or: python -m flows.round configs/quickstart.yaml)
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from autoevolve import loop
from autoevolve.config import RunConfig, load_config
from autoevolve.evaluate import format_table

# Stage inputs are live objects (policy, store); they are not cached across runs, the store is the cache.
stage = task(cache_policy=NONE)


@stage
def evolve_stage(r: loop.Round):
    """Stage 1: prompt evolution."""
    return loop.timed(r, "evolve", loop.stage_evolve, r)


@stage
def select_stage(r: loop.Round, evolved):
    """Stage 2: trajectory selection."""
    return loop.timed(r, "select", loop.stage_select, r, evolved)


@stage
def distill_stage(r: loop.Round, evolved, selection):
    """Stage 3: context distillation into the expert's LoRA."""
    return loop.timed(r, "distill", loop.stage_distill, r, evolved, selection)


@stage
def gate_stage(r: loop.Round, evolved, record):
    """The promotion gate on dev tasks."""
    return loop.timed(r, "gate", loop.stage_gate, r, evolved, record)


@stage
def report_stage(r: loop.Round, evolved, record):
    """The held-out 2x2 on test tasks."""
    return loop.timed(r, "report", loop.stage_report, r, evolved, record)


@flow(name="autoevolve-round")
def round_flow(config: RunConfig, round: int | None = None) -> dict[str, Any]:
    """One round: evolve -> select -> distil -> gate -> report."""
    r = loop.open_round(config, round=round)
    try:
        evolved = evolve_stage(r)
        selection = select_stage(r, evolved)
        if not selection.items:  # nothing to distil: say so in the report instead of training on nothing
            report = loop.write_report(r, evolved, selection)
            print(f"no rollout of the evolved configs beat the original: nothing to distil ({r.run_dir})")
            return report
        record, train = distill_stage(r, evolved, selection)
        dev, record = gate_stage(r, evolved, record)
        test = report_stage(r, evolved, record)
        report = loop.write_report(r, evolved, selection, record, train, dev, test)
    finally:
        r.bench.store.close()
    print(format_table(test))
    print(f"gate (dev): {dev.decision}: {dev.reason}")
    if test.retention is not None:
        print(f"retention (test): {test.retention:.2f} of the evolved prompt's gain kept with the original prompt")
    print(f"report: {r.run_dir / 'report.json'}")
    return report


if __name__ == "__main__":
    round_flow(load_config(sys.argv[1]))
