"""A round of the loop as library code: open it, run its stages in order, finish it; ``flows/`` runs each stage as
a Prefect task. Without Prefect (a notebook, a script)::

    r = loop.open_round(load_config("configs/quickstart.yaml"))
    report = loop.run_round(r)

Every stage records what it handed on in the store when it finishes (``stages.pipeline.run_stage``), so re-running a
crashed run with the same run id resumes: finished stages are loaded, not redone, and the unfinished one reuses every
rollout already stored. A stage can also run on its own (another process, a GPU worker) for a run id and round: it
reads its inputs from the stages before it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoevolve.config import ConfigError, RunConfig, changed_settings
from autoevolve.fleet import registry
from autoevolve.harness.workbench import EndpointDown, Workbench
from autoevolve.model import base_model_id
from autoevolve.policy import Policy
from autoevolve.records import EvalReport
from autoevolve.round import Round
from autoevolve.stages import labels
from autoevolve.stages.pipeline import STAGES, declined, finished, result, run_stage
from autoevolve.stages.report import write_report
from autoevolve.store import Store, StoreBusy
from autoevolve.views.narration import say


def make_policy(config: RunConfig) -> Policy:
    """The policy the config names."""
    m = config.model
    if m.backend == "openai":
        from autoevolve.policy.openai import OpenAIPolicy

        o = m.openai
        return OpenAIPolicy(
            m.name,
            o.base_url,
            o.api_key_env,
            o.concurrency,
            o.timeout_s,
            o.max_retries,
            load_adapters=o.load_adapters,
        )
    from autoevolve.policy.local import LocalPolicy

    return LocalPolicy(m.name, batch_size=m.batch_size, dtype=m.dtype)


def next_round(store: Store, run_id: str) -> int:
    """The first round of a run that has not finished (0 for a new run)."""
    done = {r for r, stage in store.finished_stages(run_id) if stage == "round"}
    return next(r for r in range(len(done) + 1) if r not in done)


def open_round(config: RunConfig, policy: Policy | None = None, round: int | None = None) -> Round:
    """Open the store, build env and policy, and load the round's starting adapter A_r (if there is one).

    Without an explicit ``round``, it is the run's first unfinished one: a crashed round is resumed, a finished
    run goes on with the next. A_r is recorded when a round first starts, so a resumed round keeps the adapter
    it started from even if it had already promoted its successor.
    """
    store = Store(config.store)
    run_id = str(config.run_id)
    try:
        check_run(store, config)
    except ConfigError:
        store.close()
        raise
    round = next_round(store, run_id) if round is None else round
    store.put_run(run_id, json.loads(config.model_dump_json()))
    started = store.stage_result(run_id, round, "start")
    if started is None:
        live = store.promoted_adapter(config.expert)
        store.put_stage(run_id, round, "start", {"adapter": live.version if live else None}, 0.0)
    else:
        version = started[0]["adapter"]
        live = store.adapter(config.expert, version) if version is not None else None
    env = config.env.make()
    policy = policy or make_policy(config)
    if live is not None:
        policy.add_adapter(live.ref, live.path)
    bench = Workbench(
        policy=policy,
        env=env,
        store=store,
        run_id=run_id,
        round=round,
        seed=config.seed,
        endpoint_stop=config.model.endpoint_stop,
    )
    budget = config.labels.budget if config.labels else None
    labelled = None if budget is None else labels.labelled_tasks(env, budget, config.seed)
    r = Round(config=config, bench=bench, original=config.original_hcp(), base_adapter=live, labelled=labelled)
    if finished(r, "warm"):  # round 0 started from SFT on the labels: that adapter is A_r
        result(r, "warm")
    return r


def check_run(store: Store, config: RunConfig) -> None:
    """Refuse, with ConfigError, a run that could not go on: recorded under other settings (its rounds would not
    be comparable), or an expert whose live adapter is gone or was trained on another base model."""
    expert = next((e for e in store.experts() if e.name == config.expert), None)
    base = base_model_id(config.model.name)
    if expert is not None and expert.base_model != base:
        raise ConfigError(
            f"expert {config.expert} in {store.path} is trained on {expert.base_model}, but model.name is {base}: "
            "set model.name to it, or name another expert"
        )
    live = store.promoted_adapter(config.expert)
    if live is not None:
        try:
            registry.check_adapter_folder(Path(live.path), base)
        except ValueError as exc:
            raise ConfigError(
                f"live adapter {live.ref}: {exc}; restore the folder, or put back an earlier version with "
                f"`autoevolve registry --store {store.path} rollback {config.expert}`"
            ) from None
    stored = store.run_config(str(config.run_id))
    changes = changed_settings(stored, json.loads(config.model_dump_json())) if stored else []
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise ConfigError(
            f"run {config.run_id} in {store.path} was recorded with other settings: {'; '.join(changes[:3])}{more}; "
            "put them back to go on with it, or give the new settings a new run_id"
        )


def transient(exc: BaseException) -> bool:
    """Whether running a stage again later may succeed: an endpoint that failed transiently, a store held by another
    process, a dropped connection; never a config, data or code error (those fail the same way every time)."""
    if isinstance(exc, EndpointDown):
        return exc.transient
    return isinstance(exc, StoreBusy | ConnectionError | TimeoutError)


def reopen(r: Round) -> None:
    """A fresh connection to the round's store, after another process (a remote stage's worker) wrote to the file."""
    r.bench.store = Store(r.config.store)


Step = Callable[..., Any]  # (round, stage name, *its arguments) -> the stage's result: run_stage, or a flow's task


def run_round(
    r: Round, step: Step = run_stage, approve: Callable[[Round, EvalReport], EvalReport] | None = None
) -> dict[str, Any]:
    """The round, stage by stage, each through ``step``; returns its report (a finished round's, loaded).

    When selection keeps nothing and there are no labels to train on, there is nothing to distil: the round ends after
    stage 2 and its report says so.
    With ``registry.approval``, a promotion the gate proposes waits for ``approve`` (a flow asks a person); with no
    one to ask, it is declined.
    """
    done = round_report(r.bench.store, r.bench.run_id, r.bench.round)
    if done is not None:
        say(f"round {r.bench.round} of run {r.bench.run_id} finished before: {r.run_dir / 'report.json'}")
        return done
    if r.warm_start_due or finished(r, "warm"):
        step(r, "warm")
    step(r, "plan")
    step(r, "evolve")
    if step(r, "select").items or r.trained_labels:  # nothing kept and no labels: nothing to train on
        step(r, "distill")
        dev = step(r, "gate")
        if dev.decision == "promote" and r.config.registry.approval and not finished(r, "decide"):
            dev = approve(r, dev) if approve else declined(r, dev, "nobody to ask (run the round as a flow)")
        step(r, "decide", dev)
        step(r, "report")
    return finish_round(r)


def finish_round(r: Round) -> dict[str, Any]:
    """Write report.json from the finished stages and mark the round finished; returns the report."""
    get = {s: result(r, s) if finished(r, s) else None for s in STAGES}
    distilled, decided = get["distill"], get["decide"]
    record, train = (distilled.adapter, distilled.train) if distilled else (None, None)
    record, dev = (decided.adapter, decided.dev) if decided else (record, get["gate"])
    report = write_report(r, get["plan"], get["evolve"], get["select"], record, train, dev, get["report"])
    if report["failed_rollouts"]:
        say(
            f"{report['failed_rollouts']} of {report['rollouts']} rollouts failed at the policy endpoint after "
            "retries; they are stored as failed trajectories with reward 0"
        )
    r.bench.store.put_stage(r.bench.run_id, r.bench.round, "round", report, sum(r.seconds.values()))
    return report


def round_report(store: Store, run_id: str, round: int) -> dict[str, Any] | None:
    """The report of a finished round, or None if it has not finished."""
    found = store.stage_result(run_id, round, "round")
    return found[0] if found else None
