"""A round whose policy is OpenAIPolicy, against autoevolve serve (the tiny random model on both sides)."""

from __future__ import annotations

from pathlib import Path

from autoevolve.config import load_config
from autoevolve.fleet.serving import Fleet
from autoevolve.fleet.serving.app import create_app
from autoevolve.fleet.serving.runtime_lora import RuntimeLoRA
from autoevolve.store import Store
from tests.fleet.serving.helpers import random_adapter, running

ROOT = Path(__file__).resolve().parents[3]


def test_a_round_with_the_openai_backend_runs_against_autoevolve_serve(
    tmp_path: Path, prefect_harness, tiny_model_dir
) -> None:
    from autoevolve.policy import ChatRequest
    from autoevolve.policy.local import LocalPolicy
    from autoevolve.policy.openai import OpenAIPolicy
    from autoevolve_flows.round import round_flow

    fleet = Fleet(LocalPolicy(str(tiny_model_dir), batch_size=8, dtype="float32"), str(tiny_model_dir))
    with running(create_app(fleet, runtime=RuntimeLoRA(roots=(tmp_path,)))) as url:
        path = tmp_path / "served.yaml"
        path.write_text(
            f"run_id: served\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
            f"model: {{name: {tiny_model_dir}, backend: openai, openai: {{base_url: '{url}/v1', max_retries: 0}}}}\n"
            "env: {tiers: [1], n_train: 16, n_dev: 4, n_test: 4}\n"
            "evolve: {train_tasks: 4, candidates: 1, mutators: [tool_format]}\nselect: {train_tasks: 4}\n"
        )
        report = round_flow(load_config(path))
        with Store(tmp_path / "s.duckdb", read_only=True) as store:
            trajectories = store.trajectories("served")
        # The adapter path of a round: OpenAIPolicy loads a version into the server, then rolls out under it.
        policy = OpenAIPolicy(str(tiny_model_dir), f"{url}/v1", load_adapters=True, max_retries=0)
        folder = random_adapter(str(tiny_model_dir), tmp_path / "L1-life-v1", 1, str(tiny_model_dir))
        policy.add_adapter("L1-life@v1", folder)
        [answer] = policy.generate(
            [ChatRequest(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4)], "L1-life@v1"
        )
        policy.close()
    assert report["rollouts"] == len(trajectories) == 12  # as the local backend's round (tests/test_flow.py)
    assert not [t.error for t in trajectories if t.error.startswith("backend error")]
    assert sum(t.completion_tokens for t in trajectories) > 0 and fleet.stats["calls"] >= 12
    assert answer.error == "" and answer.completion_tokens == 4
    assert fleet.slots["L1-life@v1"].path == folder and fleet.stats["loads"] == 1
