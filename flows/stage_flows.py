"""One flow per stage, each callable on its own for a run id and round (another process, a GPU worker).

A stage flow reads what the stages before it handed on from the store and records its own result there;
a stage that finished before is loaded, not redone. The round flow runs the same stage functions in-process.

Run: python -m autoevolve_flows.stage_flows distill configs/quickstart.yaml --round 0
"""

import argparse
import os
from typing import Any

from prefect import flow

from autoevolve import loop
from autoevolve.config import RunConfig, load_config
from autoevolve.stages import pipeline


def run_one(config: RunConfig, stage: str, round: int) -> dict[str, Any]:
    """Open the round, run (or load) one stage, close the store; returns what the stage recorded."""
    r = loop.open_round(config, round=round)
    try:
        pipeline.run_stage(r, stage)
        found = r.bench.store.stage_result(r.bench.run_id, round, stage)
    finally:
        r.bench.store.close()
    assert found is not None
    return found[0]


@flow(name="autoevolve-plan")
def plan_flow(config: RunConfig, round: int) -> dict[str, Any]:
    """A round's task plan on its own (stage 1 makes it too when it has not been made)."""
    return run_one(config, "plan", round)


@flow(name="autoevolve-evolve")
def evolve_flow(config: RunConfig, round: int) -> dict[str, Any]:
    """Stage 1 of a round on its own: prompt evolution."""
    return run_one(config, "evolve", round)


@flow(name="autoevolve-select")
def select_flow(config: RunConfig, round: int) -> dict[str, Any]:
    """Stage 2 of a round on its own: trajectory selection (needs stage 1)."""
    return run_one(config, "select", round)


@flow(name="autoevolve-distill")
def distill_flow(config: RunConfig, round: int) -> dict[str, Any]:
    """Stage 3 of a round on its own: distillation into the expert's next adapter (needs stages 1-2)."""
    return run_one(config, "distill", round)


@flow(name="autoevolve-gate")
def gate_flow(config: RunConfig, round: int) -> dict[str, Any]:
    """The dev gate of a round on its own (needs the distilled adapter)."""
    return run_one(config, "gate", round)


@flow(name="autoevolve-report")
def report_flow(config: RunConfig, round: int) -> dict[str, Any]:
    """The held-out test 2x2 of a round on its own (needs the decision)."""
    return run_one(config, "report", round)


STAGE_FLOWS = {
    "plan": plan_flow,
    "evolve": evolve_flow,
    "select": select_flow,
    "distill": distill_flow,
    "gate": gate_flow,
    "report": report_flow,
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run one stage of a round on its own.")
    parser.add_argument("stage", choices=sorted(STAGE_FLOWS))
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("--round", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    STAGE_FLOWS[args.stage](load_config(args.config), args.round)
