"""A whole round against a policy endpoint that fails: transient faults are retried away, lasting ones become
failed trajectories, and the round completes and says how many failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoevolve.config import load_config
from autoevolve.envs.life import LifeEnv
from autoevolve.store import Store
from tests.policy.test_openai_faults import fake  # noqa: F401 - the fake endpoint fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fault", ["503:1", "hang:1", "drop:1"])
def test_a_round_completes_and_counts_the_rollouts_the_endpoint_failed(
    tmp_path: Path,
    prefect_harness,
    fake,  # noqa: F811 - the fixture imported above
    fault: str,
    capfd,
) -> None:
    from autoevolve_flows.round import round_flow

    url, state = fake
    env = LifeEnv(tiers=(1,), n_train=16, n_dev=4, n_test=4)
    doomed = env.tasks("dev")[1]
    state.doomed.add(doomed.request)  # every call for this task fails, however often retried
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_id: faults\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: '{fault}', backend: openai, openai: {{base_url: '{url}', timeout_s: 0.5, max_retries: 2}}}}\n"
        "env: {tiers: [1], n_train: 16, n_dev: 4, n_test: 4}\n"
        "evolve: {train_tasks: 4, candidates: 1, mutators: [tool_format]}\nselect: {train_tasks: 4}\n"
    )
    try:
        report = round_flow(load_config(path))
    finally:
        state.doomed.clear()
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        rows = store.trajectories("faults")
    failed = [t for t in rows if t.error.startswith("backend error")]
    # The doomed dev task was rolled out once (the seed's dev score); its three attempts all failed.
    assert [t.task_id for t in failed] == [doomed.id] and failed[0].reward == 0.0
    assert "after 3 attempts" in failed[0].error
    assert report["failed_rollouts"] == 1 and report["rollouts"] == len(rows) == 12
    # Every other request failed the first time the way this endpoint fails, and a retry went through.
    doomed_key = (fault, doomed.request)
    assert state.hits[doomed_key] == 3
    assert all(n >= 2 for key, n in state.hits.items() if key[0] == fault and key != doomed_key)
    shown = capfd.readouterr()
    assert "1 of 12 rollouts failed at the policy endpoint" in shown.out + shown.err  # printed, or logged (log_prints)
    assert json.loads((tmp_path / "runs" / "faults" / "report.json").read_text())["failed_rollouts"] == 1


def _faults_config(tmp_path: Path, url: str, model: str, extra: str = "") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_id: faults\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: '{model}', backend: openai, openai: {{base_url: '{url}', timeout_s: 2, max_retries: 1, "
        "api_key_env: AUTOEVOLVE_TEST_KEY}}\nenv: {tiers: [1], n_train: 16, n_dev: 4, n_test: 4}\n"
        "evolve: {train_tasks: 4, candidates: 1, mutators: [tool_format]}\nselect: {train_tasks: 4}\n" + extra
    )
    return path


def _every_table(store: Store) -> str:
    """Every row of every table of a store, as text."""
    tables = [r[0] for r in store.con.execute("SELECT table_name FROM information_schema.tables").fetchall()]
    return "\n".join(str(store.con.execute(f'SELECT * FROM "{t}"').fetchall()) for t in tables)


def test_the_api_key_never_reaches_the_store_the_reports_the_logs_or_the_artifacts(
    tmp_path: Path,
    prefect_harness,
    fake,  # noqa: F811 - the fixture imported above
    capfd,
    monkeypatch,
) -> None:
    from prefect import get_client

    from autoevolve_flows.round import round_flow

    key = "sk-test-5ecret-c0de-9f1e"
    monkeypatch.setenv("AUTOEVOLVE_TEST_KEY", key)
    url, state = fake
    env = LifeEnv(tiers=(1,), n_train=16, n_dev=4, n_test=4)
    shown = env.tasks("dev")[2]
    state.echo_key.add(shown.request)  # the server answers this task with a 401 that repeats the key it was sent
    try:
        report = round_flow(load_config(_faults_config(tmp_path, url, "echo")))
    finally:
        state.echo_key.clear()
    out = capfd.readouterr()
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        [failed] = [t for t in store.trajectories("faults") if t.error]
        tables = _every_table(store)
    assert report["failed_rollouts"] == 1 and failed.task_id == shown.id
    assert failed.error.startswith("backend error: AuthenticationError after 1 attempt: Error code: 401")
    assert "invalid key Bearer ***" in failed.error  # what the server said, the key blanked out
    files = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "runs").rglob("*") if p.is_file())
    with get_client(sync_client=True) as client:
        artifacts = "\n".join(str(a.data) + str(a.description) for a in client.read_artifacts())
    assert "faults" in files and "faults" in artifacts and shown.id in tables
    places = {"store": tables, "run folder": files, "output": out.out + out.err, "artifacts": artifacts}
    assert [where for where, text in places.items() if key in text] == []


def test_a_stage_stops_when_most_of_a_batch_fails_alike_at_the_endpoint(
    tmp_path: Path,
    prefect_harness,
    fake,  # noqa: F811 - the fixture imported above
) -> None:
    from autoevolve.harness.workbench import EndpointDown
    from autoevolve_flows.round import round_flow

    url, state = fake
    env = LifeEnv(tiers=(1,), n_train=16, n_dev=4, n_test=4)
    refused = env.tasks("dev")[:3]
    state.echo_key |= {t.request for t in refused}  # 3 of the 4 dev rollouts get the same 401
    try:
        with pytest.raises(EndpointDown) as stopped:
            round_flow(load_config(_faults_config(tmp_path, url, "stop")))
    finally:
        state.echo_key.clear()
    message = str(stopped.value)
    assert message.startswith("3 of 4 rollouts failed at the policy endpoint with the same error")
    assert "The endpoint said: AuthenticationError after 1 attempt: Error code: 401" in message
    assert "The request it refused: 2 messages [system, user], no tools= field, adapter none (base model)" in message
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        kept = store.trajectories("faults")
        candidates = store.candidates("faults")
    assert [t.task_id for t in kept] == [env.tasks("dev")[3].id] and not kept[0].error  # the failed ones: resent later
    assert candidates == []  # the seed was never scored by the failures


def test_stages_are_retried_on_transient_errors_only() -> None:
    from prefect.states import Failed

    from autoevolve.config import ConfigError
    from autoevolve.harness.workbench import EndpointDown
    from autoevolve.store import StoreBusy
    from autoevolve_flows.round import evolve_stage, retry_transient

    def retried(error: BaseException) -> bool:
        return retry_transient(evolve_stage, None, Failed(data=error))

    assert evolve_stage.retries == 2 and evolve_stage.retry_condition_fn is retry_transient
    assert [retried(e) for e in (EndpointDown(True, "503s"), StoreBusy("held"), ConnectionResetError())] == [True] * 3
    refused = [EndpointDown(False, "401s"), ConfigError("bad field"), ValueError("bad data"), KeyError("code")]
    assert [retried(e) for e in refused] == [False] * 4


def test_the_cli_ends_a_run_the_endpoint_refuses_with_exit_1_and_what_it_said(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.policy.fake_http import JSONHandler, serving

    class Refusing(JSONHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(400, {"error": {"message": "tool messages need a tool_call_id"}})

    with serving(Refusing) as url:
        path = _faults_config(tmp_path, url, "refused")
        done = subprocess.run(
            [sys.executable, "-m", "autoevolve.cli", "run", str(path)], capture_output=True, text=True, cwd=ROOT
        )
    assert done.returncode == 1
    [last] = [line for line in done.stderr.splitlines() if line.startswith("autoevolve: ")]
    assert last.startswith("autoevolve: 4 of 4 rollouts failed at the policy endpoint with the same error")
    assert "BadRequestError after 1 attempt: Error code: 400" in last and "need a tool_call_id" in last
