"""Production orchestration: the loop on a cron schedule and each stage as a deployment on its work pool.

autoevolve-evolution/<run>   the loop, on the config's cron, on the CPU pool (entry flow: ``evolution_flow``)
autoevolve-<stage>/cpu       evolve, select, gate, report: rollout stages on the CPU pool
autoevolve-distill/gpu       distillation on the GPU pool (a Docker work pool: image, GPU request, the checkout mounted)

Every flow run starts in the checkout (``$AUTOEVOLVE_HOME``, default the folder this runs in), which must be at the
same path on every worker: the store, the run folders and the adapters live under it.

Run: autoevolve deploy configs/quickstart.yaml [--dry-run]   (or, from prefect.yaml: prefect deploy --all)
     autoevolve deploy fleet.yaml [--dry-run]   (several experts at once: ``autoevolve.fleet.fleetfile``)
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolUpdate
from prefect.deployments.runner import DeploymentApplyError, RunnerDeployment
from prefect.exceptions import ObjectNotFound
from prefect.runner.storage import LocalStorage
from prefect.runtime import flow_run
from prefect.schedules import Cron
from prefect.settings import get_current_settings

from autoevolve.config import DeploySettings, RunConfig, load_config
from autoevolve.fleet.fleetfile import FleetFile
from autoevolve.views.narration import say
from autoevolve_flows.loop_flow import loop_flow

TAGS = ["autoevolve"]
CPU_STAGES = ("evolve", "select", "gate", "report")


class DeployError(RuntimeError):
    """Deployments that cannot be made; the message is one line that says what to do."""


@flow(name="autoevolve-evolution")
def evolution_flow(config_path: str, run_id: str | None = None) -> list[dict[str, Any]]:
    """The scheduled loop: read the run config on the worker and run its rounds as a new run.

    Without ``run_id`` the run is named after the config's run id (its file stem unless it sets one) and the date
    the flow run was scheduled for, in ``deploy.timezone``: ``quickstart-2026-11-30``. So each scheduled run is a
    new run that starts from the registry's live adapter, and a Prefect retry of a crashed or failed flow run (same
    flow run, same parameters, same scheduled date) gets the same run id and resumes it: finished rounds and stages
    are loaded, not redone. Pass ``run_id`` to resume or name a run by hand.
    """
    config = load_config(config_path)
    config.run_id = run_id or scheduled_run_id(config, flow_run.scheduled_start_time)
    say(f"run {config.run_id} from {config_path}")
    return loop_flow(config)


def scheduled_run_id(config: RunConfig, when: datetime) -> str:
    """The config's run id and the scheduled date in the deploy time zone, e.g. ``quickstart-2026-11-30``."""
    return f"{config.run_id}-{when.astimezone(ZoneInfo(config.deploy.timezone)).date().isoformat()}"


def deployments(config: RunConfig, config_path: str, home: Path) -> list[RunnerDeployment]:
    """The run's deployments: the scheduled loop, the rollout stages and distillation, code read from ``home``."""
    d = config.deploy

    def make(entrypoint: str, name: str, pool: str, **options: Any) -> RunnerDeployment:
        storage = LocalStorage(str(home))  # its pull step: start every flow run in the checkout
        return RunnerDeployment.from_storage(storage, entrypoint, name, work_pool_name=pool, tags=TAGS, **options)

    parameters = {"config_path": worker_path(config_path, home)}
    made = [
        make(
            "flows/deploy.py:evolution_flow",
            str(config.run_id),
            d.cpu_pool,
            schedules=[Cron(d.cron, timezone=d.timezone)],
            parameters=parameters,
            concurrency_limit=1,  # the store takes one writer: a run still going when the next is due makes it wait
        )
    ]
    made += [make(f"flows/stage_flows.py:{stage}_flow", "cpu", d.cpu_pool) for stage in CPU_STAGES]
    made.append(make("flows/stage_flows.py:distill_flow", "gpu", d.gpu_pool, job_variables=gpu_job_variables(d, home)))
    return made


def gpu_job_variables(d: DeploySettings, home: Path) -> dict[str, Any]:
    """Docker worker job variables: the image, the checkout mounted at its own path, then the config's own keys."""
    merged = {"image": d.gpu_image, "volumes": [f"{home}:{home}"]} | d.gpu_job_variables
    return {k: v for k, v in merged.items() if v is not None}


def worker_path(config_path: str, home: Path) -> str:
    """The config's path as a worker sees it: relative to the checkout when inside it."""
    path = Path(config_path).resolve()
    return str(path.relative_to(home)) if path.is_relative_to(home) else str(path)


def describe(x: RunnerDeployment) -> str:
    """One line: full name, pool, entrypoint, schedule, parameters and job variables."""
    line = f"{x.flow_name}/{x.name}: pool {x.work_pool_name}, {x.entrypoint}"
    for s in x.schedules or []:
        line += f", cron '{s.schedule.cron}' {s.schedule.timezone}"
    if x.parameters:
        line += f", parameters {json.dumps(x.parameters)}"
    if x.job_variables:
        line += f", job variables {json.dumps(x.job_variables, sort_keys=True)}"
    return line


def apply_deployments(config: RunConfig, config_path: str, dry_run: bool = False) -> list[str]:
    """Create or update the run's deployments on the Prefect API (``dry_run``: only describe them); lines to print."""
    home = Path(os.environ.get("AUTOEVOLVE_HOME") or Path.cwd()).resolve()
    made = deployments(config, config_path, home)
    lines = [describe(x) for x in made]
    if config.distill.deployment is None:
        lines.append("note: distill.deployment is not set, so the loop distils in its own process; set it to "
                     "autoevolve-distill/gpu to train on the GPU pool")  # fmt: skip
    if dry_run:
        return [*lines, f"dry run: nothing created; flow runs would start in {home}"]
    url = _applied([config.deploy], made)
    return [*lines, f"{len(made)} deployments created or updated on {url}; flow runs start in {home}"]


def apply_fleet(fleet: FleetFile, configs: list[tuple[str, RunConfig]], dry_run: bool = False) -> list[str]:
    """Every expert's deployments (the loop of each on its own cron; the stages, shared, once) and the GPU pool's
    concurrency limit of ``fleet.training_limit`` distillations at once; lines to print (``dry_run``: only those)."""
    home = Path(os.environ.get("AUTOEVOLVE_HOME") or Path.cwd()).resolve()
    made: dict[str, RunnerDeployment] = {}
    for path, config in configs:
        for x in deployments(config, path, home):
            made.setdefault(f"{x.flow_name}/{x.name}", x)  # stage deployments are the same for every expert
    pools = {config.deploy.gpu_pool for _, config in configs}
    lines = [describe(x) for x in made.values()]
    lines += [f"work pool {pool}: at most {fleet.training_limit} distillations at once" for pool in sorted(pools)]
    local = [str(config.expert) for _, config in configs if config.distill.deployment is None]
    if local:
        lines.append(f"note: {', '.join(local)} distil in the loop's own process (distill.deployment not set), "
                     "outside the GPU pool and its limit")  # fmt: skip
    if dry_run:
        return [*lines, f"dry run: nothing created; flow runs would start in {home}"]
    url = _applied([c.deploy for _, c in configs], list(made.values()), {p: fleet.training_limit for p in pools})
    return [*lines, f"{len(made)} deployments created or updated for {len(configs)} experts on {url}"]


def _applied(settings: list[DeploySettings], made: list[RunnerDeployment], limits: dict[str, int] | None = None) -> str:
    """Check the work pools, apply the deployments and set pools' concurrency ``limits`` on the Prefect API; its
    URL. DeployError when there is none, it cannot be reached, or it refuses."""
    url = get_current_settings().api.url
    if not url:
        raise DeployError("no Prefect server: set PREFECT_API_URL (e.g. http://prefect-host:4200/api) first")
    try:
        for each in {d.model_dump_json(): d for d in settings}.values():
            _check_pools(each)
        for x in made:
            x.apply()
        with get_client(sync_client=True) as client:
            for pool, limit in (limits or {}).items():
                client.update_work_pool(pool, WorkPoolUpdate(concurrency_limit=limit))
    except httpx.HTTPError as exc:
        raise DeployError(f"cannot reach the Prefect API at {url}: {exc}") from None
    except DeploymentApplyError as exc:
        raise DeployError(f"the Prefect API refused a deployment: {exc}") from None
    return url


def _check_pools(d: DeploySettings) -> None:
    """Both work pools must exist; the error names the command that makes the missing one."""
    with get_client(sync_client=True) as client:
        for pool, kind in ((d.cpu_pool, "process"), (d.gpu_pool, "docker")):
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                raise DeployError(
                    f"work pool {pool!r} not found: create it with `prefect work-pool create {pool} --type {kind}`"
                ) from None


if __name__ == "__main__":
    print("\n".join(apply_deployments(load_config(sys.argv[1]), sys.argv[1], dry_run="--dry-run" in sys.argv)))
