"""The TRL-style example (examples/shop/: a class written for GRPOTrainer over a task file) runs a full round with
`autoevolve run`, nothing under autoevolve/ naming it. (The units example runs in tests/test_docs_environments.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from autoevolve import cli
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]
SHOP = ROOT / "examples" / "shop"


def test_nothing_in_the_package_names_the_examples() -> None:
    text = "\n".join(p.read_text() for p in (ROOT / "autoevolve").rglob("*.py"))
    assert "ShopEnv" not in text and "shop_env" not in text and "UnitsEnv" not in text


@pytest.mark.integration
@pytest.mark.slow  # a full round on SmolLM2: a few minutes
def test_the_trl_style_shop_runs_a_round(tmp_path: Path, monkeypatch, prefect_harness, smol_policy) -> None:
    for name in ("shop_env.py", "tasks.jsonl", "hcp.yaml", "run.yaml"):
        shutil.copy(SHOP / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("autoevolve.loop.make_policy", lambda config: smol_policy)  # share the loaded model
    assert cli.main(["run", "run.yaml", "--auto-approve"]) == 0
    report = json.loads((tmp_path / "trajectories/runs/shop/report.json").read_text())
    assert report["selected"] >= 1 and report["eval"]["n_tasks"] == 32
    with Store(tmp_path / "trajectories/shop.duckdb", read_only=True) as store:
        trajs = store.trajectories("shop")
        [adapter] = store.adapters("L1-shop")
    assert {t.task_id.split("-")[0] for t in trajs} == {"shop"} and max(t.reward for t in trajs) == 1.0
    calls = {c.name for t in trajs for m in t.messages for c in m.tool_calls}
    assert "order" in calls  # the TRL class's method, called as a tool
    assert Path(adapter.path, "adapter_model.safetensors").is_file() and adapter.status in ("promoted", "rejected")
