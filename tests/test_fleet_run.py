"""Four experts evolving at once on one Prefect process pool, into one PostgreSQL store and registry, served while
they run.

`autoevolve deploy fleet.yaml` makes each expert's loop a deployment (one run at a time) and limits the training
pool to one distillation at once; real workers poll both pools. Every round writes the one store, distils on the
training pool (a process pool standing in for the GPU one) and is decided by its gate. A server started on the
empty registry before the runs answers throughout, and a promotion reaches it through the run config's ``vllm``
hook: it serves the new expert without a restart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from autoevolve.config import load_config
from autoevolve.store import Store
from tests.test_resume import _prepared_store

ROOT = Path(__file__).resolve().parents[1]
CPU, GPU = "fleet-cpu", "fleet-gpu"
SPLITS = "n_train: 24, n_dev: 4, n_test: 4"
ENVS = {
    "life": f"hcp: {ROOT}/prompts/life.yaml\nenv: {{tiers: [1], {SPLITS}}}\n",
    "bfcl": f"hcp: {ROOT}/prompts/bfcl.yaml\n"
    f"env: {{name: fncall, args: {{path: ['bfcl_eval:data/BFCL_v4_simple_python.json']}}, {SPLITS}}}\n",
    "shop": f"hcp: {ROOT}/examples/shop/hcp.yaml\n"
    f"env: {{name: trl, args: {{environment: '{ROOT}/examples/shop/shop_env.py:ShopEnv', "
    f"data: {ROOT}/examples/shop/tasks.jsonl, name: shop, columns: {{id: id, reference: solution}}}}, {SPLITS}}}\n",
    "units": f"hcp: {ROOT}/examples/units/hcp.yaml\n"
    f"env: {{loader: '{ROOT}/examples/units/units_env.py:UnitsEnv', {SPLITS}}}\n",
}
# The training pool is a process pool here: the Docker worker's keys are left out of the distillation deployment.
DEPLOY = (
    f"deploy: {{cpu_pool: {CPU}, gpu_pool: {GPU}, remote_timeout_s: 900, gpu_job_variables: "
    "{image: null, volumes: null, image_pull_policy: null, container_create_kwargs: null}}\n"
)


def _configs(tmp_path: Path, model_dir: Path, store: str, server: str) -> list[Path]:
    """Each expert's run config: its environment, the one store, distillation on the training pool, the server's
    vllm hook; stages 1-2 already done (12 kept rollouts each), so every round distils."""
    paths = []
    for name, env in ENVS.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f"run_id: {name}\nexpert: L1-{name}\nstore: '{store}'\nrun_dir: {tmp_path}/runs\n{env}"
            f"model: {{name: {model_dir}, batch_size: 8}}\nselect: {{train_tasks: 12}}\n"
            "distill: {epochs: 1, batch_size: 4, deployment: autoevolve-distill/gpu}\n"
            "gate: {dev_tasks: 4, test_tasks: 4}\n"
            f"registry: {{hooks: [{{kind: vllm, servers: ['{server}'], timeout_s: 60}}]}}\n{DEPLOY}"
        )
        _prepared_store(path)
        paths.append(path)
    return paths


def _pools() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        for name in (CPU, GPU):
            template = ProcessWorker.get_default_base_job_template()
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))


def _workers(env: dict[str, str], log: Path) -> list[subprocess.Popen]:
    """A process worker polling each pool, every second, from the checkout."""
    out = log.open("ab")
    return [
        subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        for pool in (CPU, GPU)
    ]


def _finished(client, ids: list, timeout_s: float) -> list:  # noqa: ANN001
    """The flow runs once every one is final (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [client.read_flow_run(i) for i in ids]
        if all(r.state.is_final() for r in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(2)


@pytest.mark.slow
def test_four_experts_evolve_on_one_pool_into_one_registry_served_while_they_run(
    tmp_path: Path, prefect_harness, tiny_model_dir, postgres_url: str, monkeypatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.deployments import run_deployment
    from prefect.settings import get_current_settings

    from autoevolve.cli import _publisher
    from autoevolve.fleet import registry
    from autoevolve.fleet.fleetfile import load_fleet
    from autoevolve.fleet.serving.app import create_app
    from autoevolve.fleet.serving.runtime_lora import RuntimeLoRA
    from autoevolve.fleet.serving.startup import open_fleet, recorded_folders
    from autoevolve.policy.local import LocalPolicy
    from autoevolve_flows.deploy import apply_fleet
    from tests.fleet.serving.helpers import running

    Store(postgres_url).close()
    fleet = open_fleet(postgres_url, LocalPolicy(str(tiny_model_dir), dtype="float32"), say=lambda _: None)
    runtime = RuntimeLoRA(recorded=recorded_folders(postgres_url))
    with running(create_app(fleet, runtime=runtime)) as url:
        paths = _configs(tmp_path, tiny_model_dir, postgres_url, url)
        (tmp_path / "fleet.yaml").write_text(
            "training_limit: 1\nexperts:\n" + "".join(f"  - config: {p}\n" for p in paths)
        )
        _pools()
        monkeypatch.setenv("AUTOEVOLVE_HOME", str(ROOT))
        fleet_file, configs = load_fleet(tmp_path / "fleet.yaml")
        apply_fleet(fleet_file, configs)

        answers: list[int] = []
        done = threading.Event()

        def ask_throughout() -> None:  # the server keeps answering while the runs write the store
            while not done.is_set():
                ask = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                answers.append(httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=120).status_code)
                time.sleep(1)

        asker = threading.Thread(target=ask_throughout, daemon=True)
        asker.start()
        api = str(get_current_settings().api.url)
        env = os.environ | {"PREFECT_API_URL": api, "HF_HUB_OFFLINE": "1", "PREFECT_WORKER_QUERY_SECONDS": "1"}
        started = [
            run_deployment(f"autoevolve-evolution/{name}", parameters={"run_id": name}, timeout=0) for name in ENVS
        ]
        workers = _workers(env, tmp_path / "workers.log")
        try:
            with get_client(sync_client=True) as client:
                runs = _finished(client, [r.id for r in started], timeout_s=1500)
                distill = client.read_deployment_by_name("autoevolve-distill/gpu")
                trained = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[distill.id]))
                )
        finally:
            for w in workers:
                os.killpg(w.pid, 15)
                w.wait(60)
            done.set()
            asker.join(120)
        log = (tmp_path / "workers.log").read_text()[-3000:]
        assert [r.state.type.value for r in runs] == ["COMPLETED"] * 4, log
        assert {r.work_pool_name for r in runs} == {CPU}

        # Four distillations on the training pool, one at a time (its concurrency limit).
        assert len(trained) == 4 and all(r.state.is_completed() and r.work_pool_name == GPU for r in trained)
        spans = sorted((r.start_time, r.end_time) for r in trained)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), spans

        # One store, one registry: every expert's round wrote it and its gate decided, with the reason.
        with Store.snapshot(postgres_url) as store:
            experts = {e.name for e in store.experts()}
            assert experts == {f"L1-{name}" for name in ENVS}
            for name in ENVS:
                assert {s for _, s in store.finished_stages(name)} >= {"plan", "evolve", "select", "distill", "gate"}
                [adapter] = store.adapters(f"L1-{name}")
                assert adapter.status in ("live", "rejected") and adapter.reason, adapter
        assert answers and set(answers) == {200}

        # A promotion reaches the running server through the hook: it serves the expert without a restart.
        with Store(postgres_url) as store:
            for path in paths:
                config = load_config(path)
                if store.adapters(config.expert)[0].status != "live":
                    registry.promote(store, config.expert, 1, "promoted by hand", _publisher(str(path)))
        served = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert {f"L1-{name}" for name in ENVS} <= served
        for name in ENVS:
            ask = {"model": f"L1-{name}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=120).json()["model"] == f"L1-{name}@v1"
