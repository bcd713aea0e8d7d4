"""GRPO: one-reply episodes graded by the environment, prompts under the original config, a CPU smoke run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import score_reply
from autoevolve.records import Message, Task
from autoevolve.stages.distill.grpo import EnvReward, _config, grpo_prompts, train_grpo
from autoevolve.stages.distill.training import GRPOSettings, TrainSettings
from tests.stages.distill.test_distill import _adapter, one_thread, tiny  # noqa: F401 - fixtures

ORIGINAL = HCPConfig.from_yaml("prompts/life.yaml")


def _first_call(env: LifeEnv, task: Task) -> str:
    """The gold first tool call of a train task in the original config's JSON call syntax."""
    call = env.reference(task)[1].tool_calls[0]
    return json.dumps({"name": call.name, "arguments": call.arguments})


def test_one_reply_is_scored_by_the_environment() -> None:
    env = LifeEnv(tiers=(1,))
    table, ride = env.tasks("train")[:2]
    assert (table.goal["kind"], ride.goal["kind"]) == ("table", "ride")
    # The right booking earns every condition but the final reply, which one reply cannot also give.
    assert score_reply(env, ORIGINAL, table, _first_call(env, table)) == pytest.approx(4 / 5)
    assert score_reply(env, ORIGINAL, ride, _first_call(env, ride)) == pytest.approx(5 / 6)
    assert score_reply(env, ORIGINAL, table, _first_call(env, ride)) == 0.0  # a ride when a table was asked for
    assert score_reply(env, ORIGINAL, table, "I cannot help.") == 0.0
    assert score_reply(env, ORIGINAL, table, '{"name": "book_table", "arguments": {') == 0.0  # cut-off call
    reward = EnvReward(env, ORIGINAL, {table.id: table})
    assert reward(["p", "p"], [_first_call(env, table), "no"], task_id=[table.id] * 2) == pytest.approx([0.8, 0.0])


def test_prompts_are_the_original_configs_first_call(tokenizer) -> None:  # noqa: ANN001
    env = LifeEnv(tiers=(1,))
    tasks = env.tasks("train")[:2]
    rows = grpo_prompts(tasks, ORIGINAL, tokenizer)
    assert [r["task_id"] for r in rows] == [t.id for t in tasks]
    messages, _ = ORIGINAL.render(tasks[0], [Message(role="user", content=tasks[0].request)])
    assert rows[0]["prompt"].startswith("<|im_start|>system\n" + messages[0]["content"])
    assert rows[0]["prompt"].endswith(tasks[0].request + "<|im_end|>\n<|im_start|>assistant\n")


class _Episode:
    """Rewards letters: a random model's replies differ in how many they have, so a group's rewards differ."""

    finished = False
    scored: list[float] = []  # every reward given, in order (the test compares the trainer's log with them)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        raise KeyError(name)

    def score(self, messages: list[Message]) -> tuple[float, str]:
        text = messages[-1].content
        _Episode.scored.append(sum(c.isalpha() for c in text) / max(1, len(text)))
        return _Episode.scored[-1], ""


class _LengthEnv:
    """A one-reply environment whose score a random tiny model can move (life scores it 0 everywhere)."""

    name = "length"

    def start(self, task: Task) -> _Episode:
        return _Episode()


def test_grpos_own_settings_set_the_group_and_its_sampling(tmp_path: Path) -> None:
    own = GRPOSettings(generations=2, completion_tokens=12, temperature=0.5, kl=0.04)
    config = _config(TrainSettings(batch_size=2, precision="float32"), own, str(tmp_path), False)
    assert (config.num_generations, config.max_completion_length, config.temperature, config.beta) == (2, 12, 0.5, 0.04)
    assert config.per_device_train_batch_size == 2 and config.num_train_epochs == 2


def test_grpo_smoke_run_on_cpu_moves_the_adapter(tiny: str, tmp_path: Path) -> None:  # noqa: F811
    tasks = LifeEnv(tiers=(1,)).tasks("train")[:2]
    settings = TrainSettings(epochs=1, batch_size=2, learning_rate=5e-2, lora_r=4, lora_alpha=8)
    own = GRPOSettings(generations=2, completion_tokens=12)
    _Episode.scored.clear()
    result = train_grpo(tasks, _LengthEnv(), ORIGINAL, tiny, tmp_path / "grpo", settings, grpo=own)
    assert result.steps == 2 and result.examples == 2  # 2 prompts x 2 replies, 2 replies per step
    assert len(_Episode.scored) == 4 and len(set(_Episode.scored)) > 1  # every reply scored by the environment
    first, last = sum(_Episode.scored[:2]) / 2, sum(_Episode.scored[2:]) / 2  # each step's group
    assert (result.first_reward, result.last_reward) == (pytest.approx(first), pytest.approx(last))
    b = [t for name, t in _adapter(result.path).items() if "lora_B" in name]
    assert b and any(t.abs().sum() > 0 for t in b)  # B starts at zero: only a gradient from the reward moves it
    assert json.loads((Path(result.path) / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny
    with pytest.raises(ValueError, match="no tasks"):
        train_grpo([], _LengthEnv(), ORIGINAL, tiny, tmp_path / "none", settings)
