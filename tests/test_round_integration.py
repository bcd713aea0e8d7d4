"""One real round on SmolLM2-135M with small budgets: the proof that data flows through all three stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from autoevolve import registry
from autoevolve.config import load_config
from autoevolve.distill import SFTSettings, render_examples, train_sft
from autoevolve.envs import make_env
from autoevolve.evaluate import gate
from autoevolve.records import Trajectory
from autoevolve.store import Store
from autoevolve.workbench import Workbench

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
gate: {{dev_tasks: 8, test_tasks: 8, guard: {{env: {{tiers: [2], n_train: 8, n_dev: 4, n_test: 4}}, tasks: 4}}}}
"""


@pytest.fixture(scope="module")
def round_run(tmp_path_factory, prefect_harness, smol_policy):  # noqa: ANN001, ANN201
    """One real round (config, report, the serving weights before it); later tests build on its adapter."""
    from flows.round import round_flow

    tmp_path = tmp_path_factory.mktemp("round")
    path = tmp_path / "run.yaml"
    path.write_text(SMALL.format(root=ROOT, tmp=tmp_path))
    config = load_config(path)
    base_before = {
        k.replace(".base_layer", ""): v.clone() for k, v in smol_policy.base.state_dict().items() if "lora_" not in k
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("autoevolve.loop.make_policy", lambda config: smol_policy)  # share the loaded model
        report = round_flow(config)
    return config, report, base_before


@pytest.mark.integration
def test_round_end_to_end(round_run, smol_policy) -> None:
    config, report, base_before = round_run
    tmp_path = Path(config.store).parent

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
    assert on_disk["gate"]["guard"]["n"] == 4 and "; guard (life tiers 2, 4 tasks): " in adapter.reason


@pytest.mark.integration
def test_a_planted_bad_adapter_is_rejected(round_run, smol_policy) -> None:
    """Continue the round's adapter on shuffled labels: gold train conversations, each with another task's actions."""
    config, report, _ = round_run
    env = make_env("life", **config.env.options())
    original = config.original_hcp()
    with Store(config.store) as store:
        [good] = store.adapters("L1-life")
        bench = Workbench(smol_policy, env, store, run_id="it-round", round=1, seed=0, progress=None)
        tasks = env.tasks("train")[:16]
        gold = [
            Trajectory(run_id="gold", task_id=t.id, split="train", hcp_id="gold", messages=env.reference(t))
            for t in tasks
        ]
        examples = render_examples(gold, {t.id: t for t in tasks}, original)
        actions = [e[2:] for e in examples[1:] + examples[:1]]  # each request gets the next task's calls and reply
        shuffled = [e[:2] + a for e, a in zip(examples, actions, strict=True)]
        settings = SFTSettings(epochs=3, batch_size=4, learning_rate=2e-3)
        bad = train_sft(shuffled, config.model.name, Path(config.run_dir) / "bad", settings, init_adapter=good.path)
        record = registry.register(
            store,
            name="L1-life",
            path=bad.path,
            base_model=good.base_model,
            parent_version=good.version,
            run_id="it-round",
            round=1,
            hcp_id=original.id,
            evolved_hcp_id=original.id,
            selection_id="shuffled",
        )
        smol_policy.add_adapter(record.ref, record.path)
        dev = env.tasks("dev")[: config.gate.dev_tasks]
        verdict = gate(bench, original, original, good.ref, record.ref, dev)
        decided = registry.decide(store, record, verdict)
        live = store.promoted_adapter("L1-life")
    cells = verdict.cells
    assert cells["base_original"].mean > 0  # the round's adapter solves some dev tasks: there is something to lose
    assert cells["adapter_original"].mean < cells["base_original"].mean and verdict.gain < 0
    assert verdict.decision == "reject" and "(needs a gain above the minimum)" in verdict.reason
    assert decided.status == "rejected" and decided.reason == verdict.reason and Path(decided.path).is_dir()
    assert live == (good if good.status == "promoted" else None)  # the live version is untouched
