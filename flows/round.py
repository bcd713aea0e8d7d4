"""The round flow: one Prefect task per stage, read top to bottom like the round itself.

Run: autoevolve run configs/quickstart.yaml   (or: python -m flows.round configs/quickstart.yaml)
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, pause_flow_run, task
from prefect.cache_policies import NONE
from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput

from autoevolve import loop
from autoevolve.config import RunConfig, load_config
from autoevolve.evaluate import format_table
from autoevolve.records import EvalReport

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


class Approval(RunInput):
    """A person's answer to a proposed promotion."""

    approve: bool
    note: str = ""


def approval(r: loop.Round, dev: EvalReport, poll_s: int = 10) -> EvalReport:
    """Pause the flow run until a person approves the promotion (Prefect UI or resume_flow_run with run_input)."""
    s = r.config.registry
    description = (
        f"## Promote {r.config.expert}? (run {r.bench.run_id}, round {r.bench.round})\n\n"
        f"```\n{format_table(dev)}\n```\n\n{dev.reason}"
    )
    print(f"waiting up to {s.approval_timeout_s} s for approval of the promotion (Prefect: resume this flow run)")
    try:
        answer = pause_flow_run(
            wait_for_input=Approval.with_initial_data(description=description, approve=False),
            timeout=s.approval_timeout_s,
            poll_interval=poll_s,
        )
    except FlowPauseTimeout:
        return loop.declined(r, dev, f"no answer within {s.approval_timeout_s} s")
    if not answer.approve:
        return loop.declined(r, dev, f"declined{': ' + answer.note if answer.note else ''}")
    return dev


@stage
def decide_stage(r: loop.Round, record, dev):
    """Promote or reject in the registry; promotion hooks tell the serving fleet."""
    return loop.stage_decide(r, record, dev)


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
        dev = gate_stage(r, evolved, record)
        if dev.decision == "promote" and r.config.registry.approval:
            dev = approval(r, dev)
        record = decide_stage(r, record, dev)
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
