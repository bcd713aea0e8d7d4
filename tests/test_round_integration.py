"""One real round on SmolLM2-135M with small budgets: the proof that data flows through all three stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from autoevolve.config import load_config
from autoevolve.envs import make_env
from autoevolve.fleet import registry
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Trajectory
from autoevolve.stages.distill import TrainSettings, render_examples, train_sft
from autoevolve.stages.gate import gate
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]

SMALL = """
run_id: it-round
seed: 0
hcp: {root}/prompts/life.yaml
store: {tmp}/store.duckdb
run_dir: {tmp}/runs
env: {{tiers: [1], n_train: 96, n_dev: 24, n_test: 16}}
labels: {{budget: 8}}
evolve: {{train_tasks: 12, dev_tasks: 16, candidates: 1, mutators: [demos], demo_pool: 12}}
select: {{train_tasks: 48, rollouts: 72, own_demos: true, unpaired_after: 8}}
distill: {{epoch_grid: [1, 2, 4], dev_tasks: 8, batch_size: 4}}
gate: {{dev_tasks: 16, test_tasks: 8, guard: {{env: {{tiers: [2], n_train: 8, n_dev: 4, n_test: 4}}, tasks: 4}}}}
"""
LEARNED = 0.5  # the new adapter's lead over the bare base on the 8 test tasks (the base solves none of them)


def _small(tmp_path: Path) -> Path:
    """The small run config, written in tmp_path."""
    path = tmp_path / "run.yaml"
    path.write_text(SMALL.format(root=ROOT, tmp=tmp_path))
    return path


@pytest.fixture(scope="module")
def round_run(tmp_path_factory, prefect_harness, smol_policy):  # noqa: ANN001, ANN201
    """One real round: its config, its report, and the serving weights before it."""
    from autoevolve_flows.round import round_flow

    tmp_path = tmp_path_factory.mktemp("round")
    config = load_config(_small(tmp_path))
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
    assert ledger[0].mutator == "seed" and ledger[1].mutator == "labels"  # the search starts from the labels
    assert ledger[1].parents == [ledger[0].hcp_id]
    assert all(set(c.parents) <= {p.hcp_id for p in ledger[:i]} for i, c in enumerate(ledger) if i)
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
    assert set(on_disk["eval"]) >= {"live_original", "live_evolved", "new_original", "new_evolved", "n_tasks"}
    assert on_disk["eval"]["n_tasks"] == 8 and set(on_disk["seconds"]) == {
        "plan",
        "evolve",
        "select",
        "distill",
        "gate",
        "decide",
        "report",
    }
    assert on_disk["gate"]["guard"]["n"] == 4 and "; guard (life tiers 2, 4 tasks): " in adapter.reason


@pytest.mark.integration
def test_the_round_learned_from_the_labels_and_the_harvest(round_run) -> None:
    config, report, _ = round_run
    assert report["labels"]["budget"] == 8 and report["promoted"]
    with Store(config.store, read_only=True) as store:
        selection = store.selection(store.adapters("L1-life")[0].selection_id)
        original = store.trajectories("it-round", hcp_id=config.original_hcp().id, adapter="")
    assert not {i.task_id for i in selection.items} & set(report["labels"]["tasks"])  # wins on unlabelled tasks
    # The original solved none of stage 1's 16 dev tasks: no win was paired with a rollout of its own on its task.
    dev = [t.reward for t in original if t.stage == "evolve"]
    assert len(dev) == 16 and max(dev) < 1.0 and not [t for t in original if t.split == "train"]
    unpaired = [
        i for i in selection.items if i.baseline_sample == -1 and i.baseline_reward == pytest.approx(sum(dev) / 16)
    ]
    assert len(unpaired) == len(selection.items) >= 1
    assert report["train"]["examples"] == report["selected"] + 8  # the wins and the 8 references
    assert set(report["train"]["dev_by_epoch"]) <= {"1", "2", "4"} and report["train"]["epochs"] in (1.0, 2.0, 4.0)
    gain = report["eval"]["new_original"] - report["eval"]["live_original"]
    assert gain >= LEARNED, f"the round did not learn: new adapter {gain:+.3f} over the base on test"


@pytest.mark.integration
def test_eval_reproduces_the_reports_new_original_cell(round_run, smol_policy, capsys) -> None:
    from autoevolve import cli

    config, report, _ = round_run
    path = Path(config.run_dir).parent / "run.yaml"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("autoevolve.loop.make_policy", lambda config: smol_policy)
        assert cli.main(["eval", str(path), "--adapter", report["adapter"], "--tasks", "8"]) == 0
    scored = json.loads((Path(config.run_dir) / "it-round" / "eval.json").read_text())
    assert scored["mean"] == pytest.approx(report["eval"]["new_original"], abs=1e-9)
    assert scored["adapter"] == report["adapter"] and scored["hcp"]["id"] == config.original_hcp().id
    with Store(config.store, read_only=True) as store:
        assert store.count_trajectories("it-round-eval") == 8  # rolled out again, under the eval's own run id
    assert f"mean reward {scored['mean']:.3f} [" in capsys.readouterr().out


@pytest.mark.integration
def test_failed_tasks_can_be_read_from_eval_and_inspect(round_run, smol_policy, capsys, tmp_path: Path) -> None:
    from autoevolve import cli

    config, report, _ = round_run
    path = Path(config.run_dir).parent / "run.yaml"
    out = tmp_path / "base.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("autoevolve.loop.make_policy", lambda config: smol_policy)
        args = ["eval", str(path), "--adapter", "base", "--tasks", "4", "--show", "2", "--out", str(out)]
        assert cli.main(args) == 0
    shown = capsys.readouterr().out
    scored = json.loads(out.read_text())
    assert [t["reward"] for t in scored["tasks"]] == list(scored["rewards"].values()) == [0.0] * 4  # the bare base
    assert all(t["feedback"].startswith("Expected ") and t["turns"] >= 1 for t in scored["tasks"])
    assert shown.count("  why: Expected ") == 2 and "(2 more failed)" in shown and "last messages:" in shown
    assert cli.main(["inspect", "it-round", "--store", str(config.store), "--failures", "8"]) == 0
    listed = capsys.readouterr().out
    served = report["eval"]["new_original"]
    assert ("no failed rollout to show" in listed) == (served == 1.0)


def _train(policy, store: Store, examples: list, out: Path, parent=None):  # noqa: ANN001, ANN202
    """LoRA-SFT SmolLM2 on examples (from ``parent`` if given), register it and load it into the policy."""
    settings = TrainSettings(epochs=2, batch_size=4, learning_rate=2e-3)
    result = train_sft(examples, policy.model_name, out, settings, init_adapter=parent.path if parent else None)
    record = registry.register(
        store,
        name="L1-life",
        path=result.path,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        parent_version=parent.version if parent else None,
        run_id="planted",
        round=0 if parent is None else 1,
        hcp_id="h",
        evolved_hcp_id="h",
        selection_id="gold" if parent is None else "shuffled",
    )
    policy.add_adapter(record.ref, record.path)
    return record


@pytest.mark.integration
@pytest.mark.slow  # trains two adapters on SmolLM2 and gates each: two minutes
def test_the_gate_promotes_a_good_adapter_and_rejects_a_planted_bad_one(tmp_path: Path, smol_policy) -> None:
    """Good: SFT on 24 gold train conversations. Bad: the good one trained on, with each request's actions shuffled."""
    env = make_env("life", tiers=(1,), n_train=96, n_dev=16, n_test=16)
    original = load_config(_small(tmp_path)).original_hcp()
    tasks = env.tasks("train")[:24]
    gold = [
        Trajectory(run_id="gold", task_id=t.id, split="train", hcp_id="gold", messages=env.reference(t), reward=1.0)
        for t in tasks
    ]
    examples = render_examples(gold, {t.id: t for t in tasks}, original)
    actions = [e[2:] for e in examples[1:] + examples[:1]]  # each request gets the next task's calls and reply
    shuffled = [e[:2] + a for e, a in zip(examples, actions, strict=True)]
    dev = env.tasks("dev")[:8]
    with Store(tmp_path / "planted.duckdb") as store:
        bench = Workbench(smol_policy, env, store, run_id="planted", progress=None)
        good = _train(smol_policy, store, examples, tmp_path / "good")
        first = gate(bench, original, original, "", good.ref, dev)
        good = registry.decide(store, good, first)
        bad = _train(smol_policy, store, shuffled, tmp_path / "bad", parent=good)
        second = gate(bench, original, original, good.ref, bad.ref, dev)
        bad = registry.decide(store, bad, second)
        live = store.promoted_adapter("L1-life")
    assert first.decision == "promote" and first.gain_ci[0] > 0 and good.status == "promoted"
    cells = second.cells  # base = the good adapter now
    assert cells["live_original"].mean == first.cells["new_original"].mean > 0
    assert cells["new_original"].mean < cells["live_original"].mean and second.gain < 0
    assert second.decision == "reject" and "(needs a gain above the minimum)" in second.reason
    assert bad.status == "rejected" and bad.reason == second.reason and Path(bad.path).is_dir()  # kept, with why
    assert live == good  # the live version is untouched


@pytest.mark.integration
def test_the_inspection_notebook_reads_the_real_round(round_run) -> None:
    from tests.notebook import errors, run_notebook

    config, _, _ = round_run
    run_dir = Path(config.run_dir) / str(config.run_id)
    env = {
        "AUTOEVOLVE_STORE": str(config.store),
        "AUTOEVOLVE_RUN": str(config.run_id),
        "AUTOEVOLVE_RUN_DIR": str(run_dir),
    }
    done = run_notebook(ROOT / "notebooks" / "inspect_trajectories.ipynb", env)
    assert errors(done) == []
    for name in ("search.png", "rounds.png", "training.png"):  # the round trained an adapter
        png = (run_dir / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
