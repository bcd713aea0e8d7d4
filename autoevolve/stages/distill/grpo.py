"""On-policy RL of the expert's LoRA: TRL GRPO under the ORIGINAL config, rewarded by the environment itself.

Each prompt is a task's first model call as the original config renders it (system prompt, tools, the user's
request), in the chat template's text. The completion is one model reply; the reward is the environment's own
score of an episode made of that one reply: its tool call is run against a fresh episode (a reply that is not a
valid call is the final answer), then the fixed scorer grades it, partial credit included. Single-turn: on a task
that needs a tool result before answering, the best one reply can do is the right call, and the scorer says how
right it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoevolve.envs import Environment
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import score_reply
from autoevolve.model import chat_text
from autoevolve.records import Message, Task, TrainResult
from autoevolve.stages.distill.fit import Judge, fit, trainer_args
from autoevolve.stages.distill.training import GRPOSettings, TrainSettings


class EnvReward:
    """A TRL reward function: each completion graded by the environment as a one-reply episode of its task."""

    __name__ = "env_reward"  # TRL logs rewards under the function's name

    def __init__(self, env: Environment, original: HCPConfig, tasks: dict[str, Task]) -> None:
        self.env, self.original, self.tasks = env, original, tasks

    def __call__(self, prompts: list[str], completions: list[str], task_id: list[str], **_: Any) -> list[float]:
        """One reward in [0, 1] per completion."""
        return [
            score_reply(self.env, self.original, self.tasks[t], text)
            for t, text in zip(task_id, completions, strict=True)
        ]


def grpo_prompts(tasks: list[Task], original: HCPConfig, tokenizer: Any) -> list[dict[str, str]]:
    """Rows {prompt, task_id}: each task's first model call under the original config, as chat-template text."""
    rows = []
    for task in tasks:
        messages, tools = original.render(task, [Message(role="user", content=task.request)])
        text = chat_text(tokenizer, messages, tools, generation_prompt=True)
        rows.append({"prompt": text, "task_id": task.id})
    return rows


def train_grpo(
    tasks: list[Task],
    env: Environment,
    original: HCPConfig,
    model_name: str,
    out_dir: str | Path,
    settings: TrainSettings,
    init_adapter: str | None = None,
    grpo: GRPOSettings | None = None,
    judge: Judge | None = None,
) -> TrainResult:
    """Train a LoRA adapter with GRPO on ``tasks`` (continuing from ``init_adapter`` if given); save to ``out_dir``.
    ``grpo`` holds GRPO's own settings (defaults if None)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    if not tasks:
        raise ValueError("no tasks to train on")

    def build(model: Any, tokenizer: Any, output_dir: str, cuda: bool) -> tuple[Any, int]:
        tokenizer.padding_side = "left"  # prompts are generated from: pad before them
        rows = grpo_prompts(tasks, original, tokenizer)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=EnvReward(env, original, {t.id: t for t in tasks}),
            args=_config(settings, grpo or GRPOSettings(), output_dir, cuda),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        return trainer, len(rows)

    return fit(model_name, out_dir, settings, init_adapter, build, judge)


def _config(settings: TrainSettings, grpo: GRPOSettings, output_dir: str, cuda: bool) -> Any:
    """TRL GRPOConfig: the shared arguments (prompts are not truncated), plus the group and sampling settings."""
    from trl import GRPOConfig

    shared = trainer_args(settings, output_dir, cuda)
    del shared["max_length"]  # GRPO bounds the completion instead
    return GRPOConfig(
        **shared,
        num_generations=grpo.generations,
        max_completion_length=grpo.completion_tokens,
        temperature=grpo.temperature,
        beta=grpo.kl,
        activation_checkpointing=False,  # a small model's activations fit; recomputing them only costs time
    )
