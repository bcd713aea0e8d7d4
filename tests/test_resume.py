"""A run killed with SIGKILL resumes: nothing completed is lost or redone, and it ends as an uninterrupted run.

Each run here is a real subprocess (the round or a stage flow, the tiny random model, the session's Prefect API)
that is killed once its progress output shows it is mid-stage, then started again with the same run id.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from autoevolve import loop
from autoevolve.config import load_config
from autoevolve.records import Candidate, Trajectory
from autoevolve.stages import pipeline
from autoevolve.stages.plan import train_tasks
from autoevolve.store import TRAJ_KEY, Store
from tests.stages.test_select import NoCalls

ROOT = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, model_dir: Path, name: str, extra: str = "") -> Path:
    """A tiny-model run config whose store and run folder live in tmp_path/name."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"run_id: resume\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path / name}/s.duckdb\n"
        f"run_dir: {tmp_path / name}/runs\nmodel: {{name: {model_dir}, batch_size: 8}}\n"
        "env: {tiers: [1], n_train: 24, n_dev: 4, n_test: 4}\n" + extra
    )
    return path


def _run(args: list[str], kill_after: str | None = None, count: int = 1) -> tuple[int, str]:
    """Run ``python -m <args>``; SIGKILL it once ``kill_after`` has appeared ``count`` times in its output."""
    from prefect.settings import get_current_settings

    env = os.environ | {"PREFECT_API_URL": str(get_current_settings().api.url), "HF_HUB_OFFLINE": "1"}
    env["AUTOEVOLVE_PROGRESS_EVERY"] = "0"  # a line per training step: the kill lands mid-training
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as a whole like a crashed machine's
    )
    seen: list[str] = []

    def watch() -> None:
        assert proc.stdout is not None
        buffer = b""
        while chunk := proc.stdout.read1(4096):
            buffer += chunk
            *lines, buffer = re.split(rb"[\r\n]", buffer)
            seen.extend(line.decode(errors="replace") for line in lines)
            if kill_after and sum(kill_after in line for line in seen) >= count and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    thread = threading.Thread(target=watch)
    thread.start()
    code = proc.wait(timeout=600)
    thread.join()
    return code, "\n".join(seen)


def _rows(store_path: Path) -> dict[tuple, tuple]:
    """Every stored trajectory by key: (its content without timing, when it was written)."""
    with Store(store_path, read_only=True) as store:
        rows = store.trajectories("resume")
        stamps = dict(
            ((*key,), at)
            for *key, at in store._all(f"SELECT {', '.join(TRAJ_KEY)}, created_at FROM trajectories")  # noqa: SLF001
        )
        total = store._all(
            "SELECT count(*), count(DISTINCT (run_id, hcp_id, adapter, task_id, sample)) FROM trajectories"
        )  # noqa: SLF001
    assert total[0][0] == total[0][1] == len(rows)  # zero duplicate rows
    out = {}
    for t in rows:
        key = tuple(getattr(t, c) for c in TRAJ_KEY)
        out[key] = (t.model_dump(exclude={"latency_s"}), stamps[key])
    return out


def _same_report(a: dict, b: dict) -> None:
    """Two round reports agree on everything but wall-clock seconds."""
    for report in (a, b):
        report.pop("seconds")
        report["evolve"]["budget"].pop("seconds")
    assert a == b


EVOLVE = "evolve: {train_tasks: 8, minibatch: 4, candidates: 3, mutators: [tool_format, scaffold, demos]}\n"


def test_a_round_killed_during_stage_one_resumes_without_losing_or_redoing_rollouts(
    tmp_path: Path, prefect_harness, tiny_model_dir
) -> None:
    whole = _config(tmp_path, tiny_model_dir, "whole", EVOLVE + "select: {train_tasks: 8}\n")
    killed = _config(tmp_path, tiny_model_dir, "killed", EVOLVE + "select: {train_tasks: 8}\n")
    code, _ = _run(["autoevolve.cli", "run", str(whole)])
    assert code == 0
    # Killed after its third batch of stage-1 rollouts was stored, while stage 1 still had more to do.
    code, log = _run(["autoevolve.cli", "run", str(killed)], kill_after=" evolve ", count=3)
    assert code == -signal.SIGKILL and " select " not in log
    before = _rows(tmp_path / "killed" / "s.duckdb")
    assert 0 < len(before) < len(_rows(tmp_path / "whole" / "s.duckdb"))
    with Store(tmp_path / "killed" / "s.duckdb", read_only=True) as store:
        assert {s for _, s in store.finished_stages("resume")} == {"start", "plan"}  # stage 1 had not finished

    code, log = _run(["autoevolve.cli", "run", str(killed)])
    assert code == 0
    after = _rows(tmp_path / "killed" / "s.duckdb")
    # Zero lost completed rollouts: every one stored before the kill is still there, unchanged, never rewritten.
    assert all(after[key] == value for key, value in before.items())
    # And the resumed run equals the uninterrupted one: the same rollouts, ledger and report.
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in _rows(tmp_path / "whole" / "s.duckdb").items()}
    reports = [json.loads((tmp_path / n / "runs" / "resume" / "report.json").read_text()) for n in ("whole", "killed")]
    _same_report(*reports)
    assert reports[1]["rollouts"] == len(after)

    # A third start finds the round finished and redoes nothing.
    code, log = _run(["autoevolve.cli", "run", str(killed)])
    assert code == 0 and "finished before" in log and _rows(tmp_path / "killed" / "s.duckdb") == after


def _prepared_store(config_path: Path) -> None:
    """A round whose stages 1-2 are done: an evolved config with demos beat the original on 12 train tasks.

    The rollouts are the environment's reference conversations (reward 1) against the original's failures
    (reward 0); stage 2 runs for real on them (it reads stored rollouts back, it generates nothing).
    """
    config = load_config(config_path)
    run = str(config.run_id)
    r = loop.open_round(config, policy=NoCalls())
    try:
        env, original = r.bench.env, r.original
        evolved = original.model_copy(
            update={"name": "evolved", "system_prompt": original.system_prompt + "\nBe brief."}
        )
        tasks = train_tasks(env, config.select.train_tasks, config.seed)
        store = r.bench.store
        for hcp, reward in ((original, 0.0), (evolved, 1.0)):
            store.put_hcp(hcp.id, hcp.name, hcp.model_dump(mode="json"))
            store.put_trajectories(
                [
                    Trajectory(
                        run_id=run,
                        task_id=t.id,
                        split="train",
                        tier=t.tier,
                        hcp_id=hcp.id,
                        messages=env.reference(t),
                        reward=reward,
                        stage="evolve",
                    )
                    for t in tasks
                ]
            )
        for hcp, mean in ((original, 0.0), (evolved, 1.0)):
            store.put_candidate(
                Candidate(
                    run_id=run,
                    round=0,
                    hcp_id=hcp.id,
                    mutator="seed" if mean == 0 else "demos",
                    status="keep",
                    scores={},
                    mean_reward=mean,
                )
            )
        store.put_stage(run, 0, "evolve", {"best": evolved.id, "budget": {}}, 1.0)
        assert len(pipeline.run_stage(r, "select").items) == 12
    finally:
        r.bench.store.close()


def test_distillation_killed_mid_training_resumes_to_the_same_adapter(
    tmp_path: Path, prefect_harness, tiny_model_dir
) -> None:
    extra = "select: {train_tasks: 12}\ndistill: {epochs: 2, batch_size: 2}\n"
    whole = _config(tmp_path, tiny_model_dir, "whole", extra)
    killed = _config(tmp_path, tiny_model_dir, "killed", extra)
    _prepared_store(whole)
    (tmp_path / "killed").mkdir()
    shutil.copy(tmp_path / "whole" / "s.duckdb", tmp_path / "killed" / "s.duckdb")
    code, _ = _run(["autoevolve_flows.stage_flows", "distill", str(whole), "--round", "0"])
    assert code == 0
    code, log = _run(
        ["autoevolve_flows.stage_flows", "distill", str(killed), "--round", "0"], kill_after=" train (loss", count=3
    )
    assert code == -signal.SIGKILL
    with Store(tmp_path / "killed" / "s.duckdb", read_only=True) as store:
        assert store.adapters() == [] and store.stage_result("resume", 0, "distill") is None

    code, log = _run(["autoevolve_flows.stage_flows", "distill", str(killed), "--round", "0"])
    assert code == 0
    with Store(tmp_path / "killed" / "s.duckdb", read_only=True) as store:
        [adapter] = store.adapters()  # one version, not one per attempt
        result = store.stage_result("resume", 0, "distill")
    assert adapter.version == 1 and adapter.round == 0 and result is not None and result[0]["train"]["steps"] == 12
    weights = [
        load_file(tmp_path / n / "runs" / "resume" / "adapters" / "L1-life-v1" / "adapter_model.safetensors")
        for n in ("whole", "killed")
    ]
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 0
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert any(k for k in weights[0] if "lora_B" in k and weights[0][k].abs().sum() > 0)  # it did train

    # Run again: the finished stage is loaded, not trained a second time.
    code, log = _run(["autoevolve_flows.stage_flows", "distill", str(killed), "--round", "0"])
    assert code == 0 and "distill: finished before" in log and "train (loss" not in log
    with Store(tmp_path / "killed" / "s.duckdb", read_only=True) as store:
        assert len(store.adapters()) == 1


@pytest.mark.parametrize("stage", ["select", "gate"])
def test_a_stage_run_before_its_inputs_names_what_is_missing(tmp_path: Path, tiny_model_dir, stage: str) -> None:
    config = load_config(_config(tmp_path, tiny_model_dir, "early"))
    r = loop.open_round(config, policy=NoCalls(), round=0)
    try:
        with pytest.raises(LookupError, match=r"run resume round 0: stage '(evolve|distill)' has not finished"):
            pipeline.run_stage(r, stage)
    finally:
        r.bench.store.close()
