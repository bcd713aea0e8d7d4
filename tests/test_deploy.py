"""Deployments: prefect.yaml through Prefect's own loader, `autoevolve deploy` and `prefect deploy` against the test
API, the scheduled run's name, and a round whose distillation runs as a flow run of a served deployment."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from autoevolve import loop
from autoevolve.config import DeploySettings, load_config
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]
CPU = DeploySettings().cpu_pool
GPU = DeploySettings().gpu_pool
NAMES = {
    "autoevolve-evolve/cpu": CPU,
    "autoevolve-select/cpu": CPU,
    "autoevolve-gate/cpu": CPU,
    "autoevolve-report/cpu": CPU,
    "autoevolve-distill/gpu": GPU,
}


def _env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that talks to the session's Prefect API."""
    from prefect.settings import get_current_settings

    return os.environ | {"PREFECT_API_URL": str(get_current_settings().api.url), "HF_HUB_OFFLINE": "1"} | extra


@pytest.fixture(scope="module")
def pools(prefect_harness):
    """The two work pools: a process pool, and a docker pool with the Docker worker's own job template."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    # The Docker worker's template as Prefect ships it (prefect-docker itself is not installed here).
    views = Path(sys.modules["prefect"].__file__).parent / "server/api/collections_data/views"
    docker = json.loads((views / "aggregate-worker-metadata.json").read_text())["prefect-docker"]["docker"]
    templates = {
        CPU: ("process", ProcessWorker.get_default_base_job_template()),
        GPU: ("docker", docker["default_base_job_configuration"]),
    }
    with get_client(sync_client=True) as client:
        existing = {p.name for p in client.read_work_pools()}
        for name, (kind, template) in templates.items():
            if name not in existing:
                client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template))
    return templates


def test_prefect_yaml_passes_prefects_loader_and_matches_the_run_config_defaults(monkeypatch) -> None:
    from prefect.cli.deploy._config import _load_deploy_configs_and_actions
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.templating import apply_values
    from rich.console import Console

    from autoevolve_flows.deploy import gpu_job_variables

    PrefectYamlModel.model_validate(yaml.safe_load((ROOT / "prefect.yaml").read_text()))  # raises on a bad field
    said = io.StringIO()
    configs, actions = _load_deploy_configs_and_actions(ROOT / "prefect.yaml", console=Console(file=said))
    assert said.getvalue() == ""  # `prefect deploy` skips a file it cannot validate, with a warning here

    found = {}
    for d in configs:
        flow = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        found[f"{flow.name}/{d['name']}"] = d
        if d.get("parameters"):
            flow.validate_parameters(d["parameters"])  # the flow accepts the deployment's parameters
    assert {k: d["work_pool"]["name"] for k, d in found.items()} == NAMES | {"autoevolve-evolution/quickstart": CPU}

    loop_deployment = found["autoevolve-evolution/quickstart"]
    [schedule] = loop_deployment["schedules"]
    defaults = DeploySettings()
    assert (schedule["cron"], schedule["timezone"]) == (defaults.cron, defaults.timezone)
    CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])  # Prefect's own cron check
    assert load_config(ROOT / loop_deployment["parameters"]["config_path"]).run_id == "quickstart"
    assert all(not d.get("schedules") for k, d in found.items() if k in NAMES)
    assert loop_deployment["concurrency_limit"] == 1

    # Resolved the way `prefect deploy` resolves it, the GPU job is the one `autoevolve deploy` makes by default.
    monkeypatch.setenv("AUTOEVOLVE_HOME", "/srv/autoevolve")
    job = apply_values(found["autoevolve-distill/gpu"]["work_pool"]["job_variables"], {})
    pull = apply_values(actions["pull"], {})
    assert job == gpu_job_variables(defaults, Path("/srv/autoevolve"))
    assert job["volumes"] == ["/srv/autoevolve:/srv/autoevolve"] and job["image"] == defaults.gpu_image
    assert job["container_create_kwargs"]["device_requests"] == [
        {"driver": "nvidia", "count": 1, "capabilities": [["gpu"]]}
    ]
    assert pull == [{"prefect.deployments.steps.set_working_directory": {"directory": "/srv/autoevolve"}}]


def test_deploy_dry_run_prints_the_deployments_and_contacts_no_server(tmp_path: Path) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(f"hcp: {ROOT}/prompts/life.yaml\ndeploy: {{cron: '15 4 * * *', gpu_image: reg/ae:cu124}}\n")
    env = os.environ | {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "autoevolve.cli", "deploy", str(path), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"autoevolve-evolution/nightly: pool {CPU}, flows/deploy.py:evolution_flow, cron '15 4 * * *' UTC, "
        f'parameters {{"config_path": "{path}"}}'
    )
    assert [line.split(":")[0] for line in lines[1:6]] == list(NAMES)
    assert '"image": "reg/ae:cu124"' in lines[5] and f'"volumes": ["{ROOT}:{ROOT}"]' in lines[5]
    assert lines[-1] == f"dry run: nothing created; flow runs would start in {ROOT}"


def test_deploy_creates_and_updates_the_deployments_on_the_server(tmp_path: Path, pools, capsys, monkeypatch) -> None:
    from prefect.client.orchestration import get_client

    from autoevolve.cli import main

    path = tmp_path / "nightly.yaml"
    path.write_text(
        f"hcp: {ROOT}/prompts/life.yaml\n"
        "deploy: {cron: '30 3 * * 1', timezone: Europe/Berlin, gpu_job_variables: {mem_limit: 64g}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "autoevolve.cli", "deploy", str(path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("6 deployments created or updated on http")

    with get_client(sync_client=True) as client:
        scheduled = client.read_deployment_by_name("autoevolve-evolution/nightly")
        stages = {name: client.read_deployment_by_name(name) for name in NAMES}
    [s] = scheduled.schedules
    assert (s.schedule.cron, s.schedule.timezone, s.active) == ("30 3 * * 1", "Europe/Berlin", True)
    assert scheduled.work_pool_name == CPU and scheduled.parameters == {"config_path": str(path)}
    assert scheduled.global_concurrency_limit.limit == 1  # one run of the loop at a time: one store writer
    start_here = [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    assert scheduled.pull_steps == start_here and scheduled.entrypoint == "flows/deploy.py:evolution_flow"
    assert {name: d.work_pool_name for name, d in stages.items()} == NAMES
    assert all(d.pull_steps == start_here and d.schedules == [] for d in stages.values())
    gpu = stages["autoevolve-distill/gpu"].job_variables
    assert gpu["mem_limit"] == "64g" and gpu["volumes"] == [f"{ROOT}:{ROOT}"]  # merged over the defaults
    assert gpu["container_create_kwargs"]["device_requests"][0]["driver"] == "nvidia"
    # A run config is a deployment parameter: its JSON schema travels with the stage deployments.
    schema = stages["autoevolve-distill/gpu"].parameter_openapi_schema
    assert schema["required"] == ["config", "round"] and "RunConfig" in schema["definitions"]

    # Deploying again updates in place: the same deployment, the new cron.
    path.write_text(f"hcp: {ROOT}/prompts/life.yaml\ndeploy: {{cron: '0 5 * * *'}}\n")
    monkeypatch.chdir(ROOT)  # the checkout flow runs start in
    assert main(["deploy", str(path)]) == 0
    with get_client(sync_client=True) as client:
        again = client.read_deployment_by_name("autoevolve-evolution/nightly")
    assert again.id == scheduled.id and [x.schedule.cron for x in again.schedules] == ["0 5 * * *"]
    capsys.readouterr()


def test_deploy_names_the_work_pool_that_is_missing(tmp_path: Path, pools, capsys, monkeypatch) -> None:
    from autoevolve.cli import main

    path = tmp_path / "elsewhere.yaml"
    path.write_text(f"hcp: {ROOT}/prompts/life.yaml\ndeploy: {{gpu_pool: a100-pool}}\n")
    monkeypatch.chdir(ROOT)
    assert main(["deploy", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "autoevolve: work pool 'a100-pool' not found: create it with `prefect work-pool create a100-pool --type docker`"
    )


def _fleet(tmp_path: Path, store: str, cron: str = "30 3 * * *") -> Path:
    """Two experts' run configs writing ``store`` and the fleet file that lists them (the second on ``cron``)."""
    for name in ("life", "chat"):
        (tmp_path / f"{name}.yaml").write_text(
            f"hcp: {ROOT}/prompts/life.yaml\nexpert: L1-{name}\nstore: '{store}'\nrun_dir: {tmp_path}/runs\n"
        )
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"training_limit: 2\nexperts:\n  - config: life.yaml\n  - config: chat.yaml\n    cron: '{cron}'\n")
    return fleet


def test_a_fleet_deploys_every_experts_loop_the_stages_once_and_the_training_limit(tmp_path, pools, capsys) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    from autoevolve.cli import main

    fleet = _fleet(tmp_path, "postgresql://ae@db.internal/autoevolve")
    env = os.environ | {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # a dry run contacts nothing
    done = subprocess.run(
        [sys.executable, "-m", "autoevolve.cli", "deploy", str(fleet), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    names = ["autoevolve-evolution/life", *NAMES, "autoevolve-evolution/chat"]  # the stages once, for both
    assert [line.split(":")[0] for line in lines[:7]] == names
    assert "cron '0 2 * * *'" in lines[0] and "cron '30 3 * * *'" in lines[6]
    assert lines[7] == f"work pool {GPU}: at most 2 distillations at once"
    assert lines[8].startswith("note: L1-life, L1-chat distil in the loop's own process")

    assert main(["deploy", str(fleet)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("7 deployments created or updated for 2 experts")
    with get_client(sync_client=True) as client:
        loops = [client.read_deployment_by_name(f"autoevolve-evolution/{n}") for n in ("life", "chat")]
        assert client.read_work_pool(GPU).concurrency_limit == 2
        client.update_work_pool(GPU, WorkPoolUpdate(concurrency_limit=None))  # as the other tests found it
    assert [d.schedules[0].schedule.cron for d in loops] == ["0 2 * * *", "30 3 * * *"]
    assert all(d.global_concurrency_limit.limit == 1 for d in loops)  # one run of each expert at a time


@pytest.mark.parametrize(
    ("store", "error"),
    [
        ("trajectories/shared.duckdb", "2 experts would write the DuckDB file trajectories/shared.duckdb at once"),
        ("postgresql://ae@db/x", "experts[1].cron: "),
    ],
)
def test_a_fleet_that_cannot_run_is_refused_naming_why(tmp_path: Path, store: str, error: str, capsys) -> None:
    from autoevolve.cli import main

    fleet = _fleet(tmp_path, store, cron="30 3 * *" if "postgresql" in store else "30 3 * * *")
    assert main(["deploy", str(fleet), "--dry-run"]) == 2
    assert error in capsys.readouterr().err


def test_prefect_deploy_all_makes_the_deployments_of_prefect_yaml(pools) -> None:
    from prefect.client.orchestration import get_client

    done = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "deploy", "--all", "--no-prompt"],
        cwd=ROOT, env=_env(AUTOEVOLVE_HOME=str(ROOT)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with get_client(sync_client=True) as client:
        scheduled = client.read_deployment_by_name("autoevolve-evolution/quickstart")
        gpu = client.read_deployment_by_name("autoevolve-distill/gpu")
    assert [(s.schedule.cron, s.schedule.timezone) for s in scheduled.schedules] == [("0 2 * * *", "UTC")]
    assert scheduled.parameters == {"config_path": "configs/quickstart.yaml"} and scheduled.work_pool_name == CPU
    assert scheduled.global_concurrency_limit.limit == 1
    assert gpu.work_pool_name == GPU and gpu.job_variables["volumes"] == [f"{ROOT}:{ROOT}"]
    assert gpu.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]


@pytest.mark.parametrize(("zone", "date"), [("UTC", "2026-11-30"), ("America/Los_Angeles", "2026-11-29")])
def test_a_scheduled_run_is_named_after_the_config_and_its_scheduled_date(tmp_path: Path, zone: str, date: str):
    from autoevolve_flows.deploy import scheduled_run_id

    path = tmp_path / "quickstart.yaml"
    path.write_text(f"hcp: {ROOT}/prompts/life.yaml\ndeploy: {{timezone: {zone}}}\n")
    when = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)  # 19:00 the day before in Los Angeles
    assert scheduled_run_id(load_config(path), when) == f"quickstart-{date}"


# -- distillation on a deployment ----------------------------------------------------------------------------------


DEPLOYMENT = "autoevolve-distill/test-remote"


@contextmanager
def _serving(entrypoint: str, name: str, deployment: str) -> Iterator[str]:
    """A flow served by a runner in its own process; like a worker, it loads the entrypoint from the checkout."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    code = (
        "from prefect import serve\n"
        "from prefect.deployments.runner import RunnerDeployment\n"
        "from prefect.runner.storage import LocalStorage\n"
        f"storage = LocalStorage({str(ROOT)!r})\n"
        f"serve(RunnerDeployment.from_storage(storage, {entrypoint!r}, {name!r}))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(PREFECT_RUNNER_POLL_FREQUENCY="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    with get_client(sync_client=True) as client:
        for _ in range(240):
            try:
                client.read_deployment_by_name(deployment)
                break
            except ObjectNotFound:
                assert proc.poll() is None, "the runner exited before serving"
                time.sleep(0.5)
    yield deployment
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def served(prefect_harness):
    """The distill stage flow, served."""
    with _serving("flows/stage_flows.py:distill_flow", "test-remote", DEPLOYMENT) as deployment:
        yield deployment


@pytest.mark.slow  # a Prefect runner in its own process picks the stage up
def test_a_round_distils_on_the_deployment_and_loads_the_adapter_it_registered(
    tmp_path: Path, served, tiny_model_dir
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        DeploymentFilter,
        DeploymentFilterId,
    )

    from autoevolve_flows.round import round_flow
    from tests.test_resume import _config, _prepared_store

    extra = f"select: {{train_tasks: 12}}\ndistill: {{epochs: 1, batch_size: 4, deployment: {served}}}\n"
    path = _config(tmp_path, tiny_model_dir, "remote", extra)
    _prepared_store(path)  # stages 1-2 done: 12 kept rollouts to distil
    state = round_flow(load_config(path), return_state=True)
    report = state.result()

    # The adapter the worker trained and registered is the one the round gated, reported and wrote down.
    with Store(tmp_path / "remote" / "s.duckdb", read_only=True) as store:
        [adapter] = store.adapters()
        stored = store.stage_result("resume", 0, "distill")
    assert adapter.version == 1 and adapter.run_id == "resume" and report["adapter"] == adapter.ref
    assert stored is not None and report["train"] == stored[0]["train"] and report["train"]["steps"] == 3
    assert report["eval"]["n_tasks"] == 4 and report["gate"]["decision"] in ("promote", "reject")

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(served)
        [run] = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
        [markdown] = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["autoevolve-resume-round-0"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    assert run.state.is_completed() and run.parameters["round"] == 0
    assert run.parameters["config"]["distill"]["deployment"] == served and run.parent_task_run_id is not None
    assert f"{report['eval']['new_original']:.3f} [" in markdown.data
    assert f"**Gate (dev, 4 tasks): {report['gate']['decision']}**" in markdown.data


def _remote_error(tmp_path: Path, model_dir: Path, deployment: str, extra: str = "") -> str:
    """The error of distilling remotely for a run whose stages 1-2 never ran."""
    from autoevolve_flows.round import remote_stage
    from tests.stages.test_select import NoCalls
    from tests.test_resume import _config

    tmp_path.mkdir(exist_ok=True)
    config = load_config(_config(tmp_path, model_dir, "early", extra))
    r = loop.open_round(config, policy=NoCalls(), round=0)
    try:
        with pytest.raises(RuntimeError) as caught:
            remote_stage(r, "distill", deployment)
    finally:
        r.bench.store.close()
    return str(caught.value)


@pytest.mark.slow
def test_a_remote_stage_that_fails_says_which_flow_run_and_why(tmp_path: Path, served, tiny_model_dir) -> None:
    said = _remote_error(tmp_path, tiny_model_dir, served)
    assert said.startswith(f"stage distill on deployment '{served}' did not complete: flow run ")
    assert " is Failed: " in said and "stage 'evolve' has not finished" in said


def test_a_remote_stage_nobody_serves_or_deployed_says_so(tmp_path: Path, pools, tiny_model_dir) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner.storage import LocalStorage

    said = _remote_error(tmp_path / "missing", tiny_model_dir, "autoevolve-distill/nowhere")
    assert said == (
        "stage distill: deployment 'autoevolve-distill/nowhere' not found on the Prefect API; "
        "create it with `autoevolve deploy CONFIG` against the server PREFECT_API_URL names"
    )
    # Deployed on the GPU pool, but no worker polls it: the round stops waiting after deploy.remote_timeout_s.
    storage = LocalStorage(str(ROOT))
    RunnerDeployment.from_storage(storage, "flows/stage_flows.py:distill_flow", "unpolled", work_pool_name=GPU).apply()
    extra = "deploy: {remote_timeout_s: 1}\n"
    said = _remote_error(tmp_path / "unpolled", tiny_model_dir, "autoevolve-distill/unpolled", extra)
    assert said.endswith(f"is still Scheduled after 1 s (is a worker polling work pool '{GPU}'?)")
    with get_client(sync_client=True) as client:
        client.delete_deployment(client.read_deployment_by_name("autoevolve-distill/unpolled").id)


@pytest.mark.parametrize(
    ("deploy", "error"),
    [
        ("{cron: '0 2 * *'}", "deploy.cron: Value error, '0 2 * *' is not a five-field cron (minute hour day month"),
        ("{timezone: Mars/Olympus}", "deploy.timezone: Value error, unknown time zone 'Mars/Olympus' (an IANA name"),
        ("{gpu_pools: x}", "deploy.gpu_pools: unknown key"),
    ],
)
def test_a_bad_deploy_section_stops_at_load_with_the_field(tmp_path: Path, deploy: str, error: str) -> None:
    from autoevolve.config import ConfigError

    path = tmp_path / "bad.yaml"
    path.write_text(f"hcp: {ROOT}/prompts/life.yaml\ndeploy: {deploy}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: {error}")


# -- approval under a deployment ------------------------------------------------------------------------------------


@pytest.mark.slow  # a Prefect runner in its own process runs the flow, twice
def test_approval_under_a_deployment_suspends_the_run_and_an_answer_runs_it_again(tmp_path: Path, prefect_harness):
    from prefect import resume_flow_run
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    path, log = tmp_path / "run.yaml", tmp_path / "log"
    path.write_text(
        f"run_id: approve\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        "registry: {approval: true, approval_timeout_s: 600}\n"
    )

    def state_of(run_id, done) -> str:  # noqa: ANN001 - waits until done(state), then returns its name
        with get_client(sync_client=True) as client:
            for _ in range(480):
                state = client.read_flow_run(run_id).state
                if done(state):
                    return state.name
                time.sleep(0.5)
        raise AssertionError(f"flow run still {state.name}")

    with _serving("tests/approval_flow.py:approval_root", "test-approval", "approval-root/test-approval") as name:
        run = run_deployment(name, parameters={"config_path": str(path), "log": str(log)}, timeout=0)
        # Suspended, not paused: the flow run's process ended (no decision was written) and frees its worker.
        assert state_of(run.id, lambda s: s.is_paused()) == "Suspended"
        assert log.read_text().split() == ["asked"]
        with get_client(sync_client=True) as client:
            details = client.read_flow_run(run.id).state.state_details
        assert details.pause_reschedule and details.pause_key == "approve-approve-0"
        resume_flow_run(run.id, run_input={"approve": False, "note": "not tonight"})
        assert state_of(run.id, lambda s: s.is_final()) == "Completed"
    # Run again from the top: the subflow asked once more, read the answer, and the promotion was declined.
    assert log.read_text().split() == ["asked", "asked", "reject"]
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        [stored] = store.evaluations("approve")
    assert stored.decision == "reject" and stored.reason.endswith("; not approved: declined: not tonight")
