"""One real round on SmolLM2-135M with small budgets: the proof that data flows through all three stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from autoevolve.config import load_config
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]

SMALL = """
run_id: it-round
seed: 0
hcp: {root}/prompts/life.yaml
store: {tmp}/store.duckdb
run_dir: {tmp}/runs
env: {{tiers: [1], n_train: 96, n_dev: 16, n_test: 16}}
evolve: {{train_tasks: 12, candidates: 1, mutators: [demos], demo_pool: 12}}
select: {{train_tasks: 24}}
distill: {{epochs: 2, batch_size: 4}}
gate: {{dev_tasks: 8, test_tasks: 8}}
"""


@pytest.mark.integration
def test_round_end_to_end(tmp_path: Path, prefect_harness, smol_policy, monkeypatch) -> None:
    from flows.round import round_flow

    path = tmp_path / "run.yaml"
    path.write_text(SMALL.format(root=ROOT, tmp=tmp_path))
    config = load_config(path)
    monkeypatch.setattr("autoevolve.loop.make_policy", lambda config: smol_policy)  # share the loaded model
    base_before = {
        k.replace(".base_layer", ""): v.clone() for k, v in smol_policy.base.state_dict().items() if "lora_" not in k
    }

    report = round_flow(config)

    with Store(config.store, read_only=True) as store:
        assert store.count_trajectories("it-round") == report["rollouts"] > 0
        [adapter] = store.adapters("L1-life")
        selection = store.selection(adapter.selection_id)
        ledger = store.candidates("it-round")
    assert [c.hcp_id for c in ledger] == [c["hcp_id"] for c in report["candidates"]]  # every attempt has a row
    assert ledger[0].mutator == "seed" and all(c.parents == [ledger[0].hcp_id] for c in ledger[1:])
    assert len(ledger[0].scores) == 16 and report["evolve"]["budget"]["rollouts"] == ledger[-1].rollouts_used
    assert report["selected"] == len(selection.items) >= 1
    assert adapter.hcp_id == config.original_hcp().id and adapter.evolved_hcp_id == report["hcp"]["evolved"]
    assert adapter.status in ("promoted", "rejected") and adapter.reason
    assert adapter.status == ("promoted" if report["promoted"] else "rejected")
    lora = load_file(Path(report["adapter_path"]) / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora.items())  # B starts at zero
    after = {k.replace(".base_layer", ""): v for k, v in smol_policy.base.state_dict().items() if "lora_" not in k}
    assert after.keys() == base_before.keys()
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)  # serving weights untouched
    saved = json.loads((Path(report["adapter_path"]) / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    on_disk = json.loads((tmp_path / "runs" / "it-round" / "report.json").read_text())
    assert set(on_disk["eval"]) >= {"base_original", "base_evolved", "adapter_original", "adapter_evolved", "n_tasks"}
    assert on_disk["eval"]["n_tasks"] == 8 and set(on_disk["seconds"]) == {
        "evolve",
        "select",
        "distill",
        "gate",
        "report",
    }
