"""A deployed flow whose subflow asks for approval of a promotion, as a round does: served by a runner in
tests/test_deploy.py. Each start of the subflow and the decision it returns are appended to a log file."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from autoevolve.config import load_config
from autoevolve.envs.life import LifeEnv
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Cell, EvalReport
from autoevolve.round import Round
from autoevolve.store import Store
from autoevolve_flows.round import approval
from tests.stages.test_select import NoCalls


def gate_report(run_id: str) -> EvalReport:
    """A dev report that proposes a promotion."""
    cell = Cell(adapter="", hcp_id="h", mean=0.5, n=4)
    reason = "gain +0.5, 95% CI [+0.25, +0.75]; required: gain > 0.000 and CI above 0"
    return EvalReport(run_id=run_id, round=0, split="dev", cells={"live_original": cell}, decision="promote",
                      reason=reason)  # fmt: skip


@flow
def ask(config_path: str, log: str) -> str:
    """The approval step of round 0 of the config's run."""
    config = load_config(config_path)
    with Path(log).open("a") as out:
        out.write("asked\n")
    with Store(config.store) as store:
        bench = Workbench(NoCalls(), LifeEnv(tiers=(1,)), store, run_id=str(config.run_id), progress=None)
        r = Round(config=config, bench=bench, original=config.original_hcp(), base_adapter=None)
        return approval(r, gate_report(str(config.run_id))).decision


@flow
def approval_root(config_path: str, log: str) -> str:
    """The deployed flow: the approval step runs in a subflow, as it does in the loop's round."""
    decision = ask(config_path, log)
    with Path(log).open("a") as out:
        out.write(f"{decision}\n")
    return decision
