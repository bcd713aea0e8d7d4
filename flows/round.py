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
    return loop.run_stage(r, "evolve")


@stage
def select_stage(r: loop.Round):
    """Stage 2: trajectory selection."""
    return loop.run_stage(r, "select")


@stage
def distill_stage(r: loop.Round):
    """Stage 3: context distillation into the expert's LoRA."""
    return loop.run_stage(r, "distill")


@stage
def gate_stage(r: loop.Round):
    """The promotion gate on dev tasks."""
    return loop.run_stage(r, "gate")


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
def decide_stage(r: loop.Round, dev: EvalReport):
    """Promote or reject in the registry; promotion hooks tell the serving fleet."""
    return loop.run_stage(r, "decide", dev)


@stage
def report_stage(r: loop.Round):
    """The held-out 2x2 on test tasks."""
    return loop.run_stage(r, "report")


@flow(name="autoevolve-round")
def round_flow(config: RunConfig, round: int | None = None) -> dict[str, Any]:
    """One round: evolve -> select -> distil -> gate -> decide -> report; a crashed round resumes where it stopped."""
    r = loop.open_round(config, round=round)
    try:
        done = loop.round_report(r.bench.store, r.bench.run_id, r.bench.round)
        if done is not None:
            print(f"round {r.bench.round} of run {r.bench.run_id} finished before: {r.run_dir / 'report.json'}")
            return done
        evolve_stage(r)
        selection = select_stage(r)
        if selection.items:
            distill_stage(r)
            dev = gate_stage(r)
            if dev.decision == "promote" and r.config.registry.approval and not loop.finished(r, "decide"):
                dev = approval(r, dev)
            decide_stage(r, dev)
            report_stage(r)
        report = loop.finish_round(r)
    finally:
        r.bench.store.close()
    if "eval" not in report:  # nothing to distil: the report says so instead of training on nothing
        print(f"no rollout of the evolved configs beat the original: nothing to distil ({r.run_dir})")
        return report
    test, dev = loop.result(r, "report"), loop.result(r, "decide")[1]
    print(format_table(test))
    print(f"gate (dev): {dev.decision}: {dev.reason}")
    if test.retention is not None:
        print(f"retention (test): {test.retention:.2f} of the evolved prompt's gain kept with the original prompt")
    print(f"report: {r.run_dir / 'report.json'}")
    return report


if __name__ == "__main__":
    round_flow(load_config(sys.argv[1]))
