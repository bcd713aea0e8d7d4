"""DPO distillation: pairs rendered under the original config, a LoRA that learns to prefer the chosen side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import Message, Trajectory
from autoevolve.stages.distill.dpo import assistant_only_collator, preference_dataset, preference_examples, train_dpo
from autoevolve.stages.distill.training import DPOSettings, TrainSettings
from tests.stages.distill.test_distill import _adapter, one_thread, tiny  # noqa: F401 - fixtures

FAST = TrainSettings(epochs=3, batch_size=2, learning_rate=5e-2, lora_r=4, lora_alpha=8, max_length=384)


def _pairs(n: int) -> tuple[list[tuple[Trajectory, Trajectory]], dict, HCPConfig]:
    """Gold train conversations (chosen) against a refusal on the same task (rejected)."""
    env = LifeEnv(tiers=(1,))
    tasks = env.tasks("train")[:n]
    original = HCPConfig.from_yaml("prompts/life.yaml")
    pairs = []
    for t in tasks:
        chosen = Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="h1", messages=env.reference(t), reward=1)
        refusal = [Message(role="user", content=t.request), Message(role="assistant", content="I cannot help.")]
        pairs.append(
            (chosen, Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="h0", messages=refusal, reward=0))
        )
    return pairs, {t.id: t for t in tasks}, original


def test_pairs_share_the_original_prompt_and_differ_in_completions() -> None:
    pairs, tasks, original = _pairs(3)
    broken = (pairs[0][0], pairs[0][1].model_copy(update={"messages": pairs[0][1].messages[:1]}))
    rows = preference_examples([*pairs, broken], tasks, original)
    assert len(rows) == 3  # the rejected side with no reply is skipped
    row = rows[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][0]["content"].startswith("You are a personal assistant")  # the original config's prompt
    assert row["chosen"][0]["content"].startswith('{"name": "book_table"')  # the original's JSON call syntax
    assert [m["role"] for m in row["chosen"]] == ["assistant", "tool", "assistant"]
    assert row["rejected"] == [{"role": "assistant", "content": "I cannot help."}]


def test_only_the_assistants_tokens_count_in_the_preference(tiny: str) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    pairs, tasks, original = _pairs(2)
    rows = preference_examples(pairs, tasks, original)
    data = preference_dataset(rows, tokenizer)
    chosen, mask = data["chosen_ids"][0], data["chosen_mask"][0]
    tool_result = rows[0]["chosen"][1]["content"]  # assistant, tool, assistant: the middle one is the environment's
    assert rows[0]["chosen"][1]["role"] == "tool" and tool_result in tokenizer.decode(chosen)
    shown = tokenizer.decode([t for t, m in zip(chosen, mask, strict=True) if m])
    hidden = tokenizer.decode([t for t, m in zip(chosen, mask, strict=True) if not m])
    assert rows[0]["chosen"][0]["content"] in shown and rows[0]["chosen"][2]["content"] in shown
    assert tool_result in hidden and tool_result not in shown
    rejected, rejected_mask = data["rejected_ids"][0], data["rejected_mask"][0]
    assert tokenizer.decode([t for t, m in zip(rejected, rejected_mask, strict=True) if m]).startswith("I cannot help.")
    assert not tokenizer.decode([t for t, m in zip(rejected, rejected_mask, strict=True) if not m]).strip()
    examples = [{k: v[i] for k, v in data.items()} for i in range(2)]
    batch = assistant_only_collator(tokenizer.eos_token_id, max_length=384)(examples)
    counted = batch["completion_mask"].sum(dim=1).tolist()
    masks = data["chosen_mask"] + data["rejected_mask"]
    full = [[0] * len(p) + m for p, m in zip(data["prompt_ids"] * 2, masks, strict=True)]
    assert counted == [sum(m[:384]) for m in full]  # cut where the ids are cut
    assert counted[0] < len(chosen)  # TRL's own collator would count the tool result too


@pytest.mark.slow  # TRL DPO on CPU: half a minute even on the tiny model
def test_train_dpo_moves_the_adapter_towards_the_chosen_side(tiny: str, tmp_path: Path) -> None:  # noqa: F811
    pairs, tasks, original = _pairs(4)
    rows = preference_examples(pairs, tasks, original)
    result = train_dpo(rows, tiny, tmp_path / "dpo", FAST, dpo=DPOSettings(beta=0.1))
    assert result.steps == 6 and result.examples == 4
    assert result.first_loss == pytest.approx(0.6931, abs=1e-3)  # log 2: policy and reference start equal
    assert result.last_loss < result.first_loss
    b = [t for name, t in _adapter(result.path).items() if "lora_B" in name]
    assert b and all(t.abs().sum() > 0 for t in b)
    assert json.loads((Path(result.path) / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny
    with pytest.raises(ValueError, match="no preference pairs"):
        train_dpo([], tiny, tmp_path / "none", FAST)
