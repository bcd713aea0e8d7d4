"""The round flow: ``loop.run_round`` with one Prefect task per stage.

Stages that call the policy endpoint retry on transient errors only (every stage is idempotent: stored rollouts are
reused) and carry the tag ``autoevolve-policy``, so ``prefect concurrency-limit create autoevolve-policy 4`` bounds
how many of them run against the endpoint at once. With ``distill.deployment`` set, stage 3 runs as a flow run of
that deployment (the GPU work pool). Each round leaves a Markdown report and a table of its candidates as
artifacts, and a progress artifact follows its rollouts while they run.

Run: autoevolve run configs/quickstart.yaml   (or: python -m autoevolve_flows.round configs/quickstart.yaml)
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any
from uuid import UUID

from prefect import flow, pause_flow_run, suspend_flow_run, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import FlowPauseTimeout, ObjectNotFound, Pause
from prefect.input import RunInput, keyset_from_base_key, read_flow_run_input
from prefect.runtime import flow_run

from autoevolve import loop
from autoevolve.config import RunConfig, load_config
from autoevolve.harness.hcp import diff
from autoevolve.harness.workbench import Progress
from autoevolve.records import EvalReport
from autoevolve.round import Round
from autoevolve.stages import pipeline
from autoevolve.views.markdown import candidate_rows, round_markdown
from autoevolve.views.narration import say
from autoevolve.views.twobytwo import format_table

POLICY_TAG = "autoevolve-policy"


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a stage only on an error that may pass (endpoint down, store busy, network), never on a config, data or
    code error: those would fail the same way again."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(error, BaseException) and loop.transient(error)


# Stage inputs are live objects (policy, store); they are not cached across runs, the store is the cache.
stage = task(cache_policy=NONE)
# A retry reruns the whole stage, which loads every rollout already stored and generates only the missing ones.
policy_stage = task(
    cache_policy=NONE, retries=2, retry_delay_seconds=30, retry_condition_fn=retry_transient, tags=[POLICY_TAG]
)


@policy_stage
def warm_stage(r: Round):
    """Round 0's starting adapter: LoRA SFT on the labelled references, gated (labels.warm_start)."""
    return pipeline.run_stage(r, "warm")


@policy_stage
def plan_stage(r: Round):
    """The round's tasks: tiers in play and train tasks from the live adapter's frontier."""
    return pipeline.run_stage(r, "plan")


@policy_stage
def evolve_stage(r: Round):
    """Stage 1: prompt evolution."""
    return pipeline.run_stage(r, "evolve")


@policy_stage
def select_stage(r: Round):
    """Stage 2: trajectory selection."""
    return pipeline.run_stage(r, "select")


@stage
def distill_stage(r: Round):
    """Stage 3: context distillation into the expert's LoRA, here or on the deployment ``distill.deployment`` names."""
    name = r.config.distill.deployment
    if name is None or pipeline.finished(r, "distill"):
        return pipeline.run_stage(r, "distill")
    return remote_stage(r, "distill", name)


def remote_stage(r: Round, name: str, deployment: str) -> Any:
    """Run a stage as a flow run of a deployment (a worker elsewhere) and load the result it stored."""
    r.bench.store.close()  # the worker opens the DuckDB file, and DuckDB allows one writing process at a time
    parameters = {"config": json.loads(r.config.model_dump_json()), "round": r.bench.round}
    timeout = r.config.deploy.remote_timeout_s
    say(f"  {name}: running on deployment {deployment} (waiting for its flow run)")
    try:
        run = run_deployment(deployment, parameters=parameters, timeout=timeout)
    except ObjectNotFound:
        raise RuntimeError(
            f"stage {name}: deployment {deployment!r} not found on the Prefect API; create it with `autoevolve "
            "deploy CONFIG` against the server PREFECT_API_URL names"
        ) from None
    state = run.state
    if state is None or not state.is_completed():
        if state is not None and not state.is_final():
            what = f"still {state.name} after {timeout:.0f} s (is a worker polling work pool {run.work_pool_name!r}?)"
        else:
            what = f"{state.name}: {state.message or 'no message'}" if state else "without a state"
        raise RuntimeError(
            f"stage {name} on deployment {deployment!r} did not complete: flow run {run.name} ({run.id}) is {what}"
        )
    loop.reopen(r)
    return pipeline.result(r, name)


@policy_stage
def gate_stage(r: Round):
    """The promotion gate on dev tasks."""
    return pipeline.run_stage(r, "gate")


class Approval(RunInput):
    """A person's answer to a proposed promotion."""

    approve: bool
    note: str = ""


def approval(r: Round, dev: EvalReport, poll_s: int = 10) -> EvalReport:
    """Wait for a person to approve the promotion (Prefect UI, or resume_flow_run with run_input).

    Under a deployment the top flow run is suspended: its process exits and frees the worker, and resuming it
    with an answer runs the flow again, which reloads every finished stage from the store and reads the answer
    here (the suspension's key is the run's and round's, so it fires once). Prefect fails a suspended run that
    gets no answer within ``registry.approval_timeout_s``; the candidate then stays unpromoted. A run without a
    deployment (``autoevolve run``) pauses in place instead, and no answer in time rejects the promotion.
    """
    s = r.config.registry
    description = (
        f"## Promote {r.config.expert}? (run {r.bench.run_id}, round {r.bench.round})\n\n"
        f"```\n{format_table(dev)}\n```\n\n{dev.reason}"
    )
    ask = Approval.with_initial_data(description=description, approve=False)
    deployed = deployed_root()
    if deployed is not None:
        key = f"approve-{r.bench.run_id}-{r.bench.round}"
        keyset = keyset_from_base_key(f"suspended-{key}")  # the suspension's input keys (Prefect's naming)
        given = read_flow_run_input(keyset["response"], flow_run_id=deployed)
        if given is None:
            again = suspend_flow_run(wait_for_input=ask, flow_run_id=deployed, timeout=s.approval_timeout_s, key=key)
            if again is not None:  # this suspension fired before, and the run went on without an answer
                return pipeline.declined(r, dev, "resumed without an answer")
            # Prefect keeps the form on the calling (sub)flow run; resuming reads it from the suspended one.
            ask.save(keyset, flow_run_id=deployed)
            say(f"suspended flow run {deployed} for approval of the promotion (resume it with an answer)")
            with get_client(sync_client=True) as client:
                raise Pause(state=client.read_flow_run(deployed).state)  # ends this process, freeing its worker
        answer = Approval.model_validate(given)
    else:
        say(f"waiting up to {s.approval_timeout_s} s for approval of the promotion (Prefect: resume this flow run)")
        try:
            answer = pause_flow_run(wait_for_input=ask, timeout=s.approval_timeout_s, poll_interval=poll_s)
        except FlowPauseTimeout:
            return pipeline.declined(r, dev, f"no answer within {s.approval_timeout_s} s")
    if not answer.approve:
        return pipeline.declined(r, dev, f"declined{': ' + answer.note if answer.note else ''}")
    return dev


def deployed_root() -> UUID | None:
    """The top flow run of this one when it runs a deployment (only such a run can be suspended), else None."""
    root = UUID(flow_run.root_flow_run_id)
    with get_client(sync_client=True) as client:
        return root if client.read_flow_run(root).deployment_id else None


# Idempotent too: a version that is live already is not promoted (nor its hooks fired) a second time.
@task(cache_policy=NONE, retries=2, retry_delay_seconds=10)
def decide_stage(r: Round, dev: EvalReport | None = None):
    """Promote or reject in the registry; promotion hooks tell the serving fleet."""
    return pipeline.run_stage(r, "decide", dev)


@policy_stage
def report_stage(r: Round):
    """The held-out 2x2 on test tasks."""
    return pipeline.run_stage(r, "report")


@flow(name="autoevolve-round")
def round_flow(config: RunConfig, round: int | None = None) -> dict[str, Any]:
    """One round (``loop.run_round``), each stage a task; a crashed round resumes where it stopped."""
    r = loop.open_round(config, round=round)
    r.bench.progress = RolloutProgress(f"{artifact_key(r)}-progress", r.bench.progress)
    try:
        if loop.round_report(r.bench.store, r.bench.run_id, r.bench.round) is not None:
            return loop.run_round(r)  # finished before: its report
        report = loop.run_round(r, step=as_task, approve=approval)
        changes = diff(r.original, pipeline.result(r, "evolve").best)
    finally:
        r.bench.store.close()
    publish(r, report, changes)
    if "eval" not in report:  # nothing to distil: the report says so instead of training on nothing
        say(f"no rollout of the evolved configs beat the original: nothing to distil ({r.run_dir})")
        return report
    test, dev = pipeline.result(r, "report"), pipeline.result(r, "decide").dev
    say(format_table(test))
    say(f"gate (dev): {dev.decision}: {dev.reason}")
    if test.retention is not None:
        say(f"retention (test): {test.retention:.2f} of the evolved prompt's gain kept with the original prompt")
    say(f"report: {r.run_dir / 'report.json'}")
    return report


def as_task(r: Round, stage: str, *args: Any) -> Any:
    """``loop.run_round``'s step: run a stage as its Prefect task."""
    return STAGE_TASKS[stage](r, *args)


STAGE_TASKS = {
    "warm": warm_stage,
    "plan": plan_stage,
    "evolve": evolve_stage,
    "select": select_stage,
    "distill": distill_stage,
    "gate": gate_stage,
    "decide": decide_stage,
    "report": report_stage,
}


# -- artifacts: what a round shows in the Prefect UI ----------------------------------------------------------------


def artifact_key(r: Round) -> str:
    """``autoevolve-<run>-round-<n>``; Prefect keys allow lowercase letters, digits and dashes only."""
    run = re.sub(r"[^a-z0-9-]+", "-", r.bench.run_id.lower()).strip("-")
    return f"autoevolve-{run}-round-{r.bench.round}"


def publish(r: Round, report: dict[str, Any], changes: str) -> None:
    """The round's report as a Markdown artifact and its stage-1 candidates as a table artifact."""
    key, where = artifact_key(r), f"run {r.bench.run_id}, round {r.bench.round}"
    create_markdown_artifact(round_markdown(report, changes), key=key, description=f"Round report ({where})")
    create_table_artifact(candidate_rows(report), key=f"{key}-candidates", description=f"Stage-1 candidates ({where})")


class RolloutProgress:
    """The workbench's progress callback, mirrored into a progress artifact; the terminal bar still shows."""

    def __init__(self, key: str, show: Progress | None) -> None:
        self.key, self.show = key, show
        self.label: str | None = None
        self.artifact: UUID | None = None
        self.complete = True

    def __call__(self, label: str, done: int, total: int) -> None:
        """Update the artifact; each new batch of rollouts (a config on some tasks) starts a new version of it."""
        if self.show is not None:
            self.show(label, done, total)
        percent, text = 100.0 * done / max(total, 1), f"{label}: {done}/{total} tasks rolled out"
        if self.artifact is None or self.complete or label != self.label:
            self.label, self.artifact = label, create_progress_artifact(percent, key=self.key, description=text)
        else:
            update_progress_artifact(self.artifact, percent, description=text)
        self.complete = done >= total


if __name__ == "__main__":
    round_flow(load_config(sys.argv[1]))
