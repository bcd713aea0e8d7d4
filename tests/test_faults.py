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
    capsys,
) -> None:
    from flows.round import round_flow

    url, state = fake
    env = LifeEnv(tiers=(1,), n_train=16, n_dev=4, n_test=4)
    doomed = env.tasks("dev")[1]
    state.doomed.add(doomed.request)  # every call for this task fails, however often retried
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_id: faults\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: '{fault}', backend: openai, openai: {{base_url: '{url}', timeout_s: 0.5, max_retries: 2, "
        "backoff_s: 0.05}}\nenv: {tiers: [1], n_train: 16, n_dev: 4, n_test: 4}\n"
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
    assert "1 of 12 rollouts failed at the policy endpoint" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs" / "faults" / "report.json").read_text())["failed_rollouts"] == 1
