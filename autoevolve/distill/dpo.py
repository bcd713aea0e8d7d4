"""Preference distillation: TRL DPO with a PEFT LoRA on (chosen, rejected) pairs rendered under the original config.

Chosen is an evolved-config rollout that succeeded, rejected the original config's failed rollout on the same
task (``select.preference_pairs``). Both are re-rendered under the ORIGINAL config, so the shared prompt is what
the served expert sees and only the completions differ. The reference model is the base with the adapter
switched off (TRL's default for a PEFT model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from autoevolve.distill.dataset import render_examples
from autoevolve.distill.sft import SFTSettings, TrainResult, fit, trainer_args
from autoevolve.hcp import HCPConfig
from autoevolve.records import Task, Trajectory


class DPOSettings(SFTSettings):
    """Hyper-parameters of one LoRA DPO run (the SFT ones, plus the preference temperature)."""

    beta: float = Field(default=0.1, gt=0, description="DPO beta: how far the adapter may move from the reference.")


def preference_examples(
    pairs: list[tuple[Trajectory, Trajectory]], tasks: dict[str, Task], original: HCPConfig
) -> list[dict[str, list[dict]]]:
    """Conversational DPO rows {prompt, chosen, rejected}; pairs whose rejected side has no reply are skipped."""
    rows = []
    for chosen, rejected in pairs:
        if not any(m.role == "assistant" for m in rejected.messages):
            continue  # a backend error left nothing to prefer against
        good, bad = render_examples([chosen, rejected], tasks, original)
        cut = next(i for i, m in enumerate(good) if m["role"] == "assistant")
        if bad[:cut] != good[:cut]:
            raise ValueError(f"pair on task {chosen.task_id}: the two rollouts do not share a prompt")
        rows.append({"prompt": good[:cut], "chosen": good[cut:], "rejected": bad[cut:]})
    return rows


def train_dpo(
    rows: list[dict[str, list[dict]]],
    model_name: str,
    out_dir: str | Path,
    settings: DPOSettings,
    init_adapter: str | None = None,
) -> TrainResult:
    """Train a LoRA adapter with DPO (continuing from ``init_adapter`` if given) and save it to ``out_dir``."""
    from datasets import Dataset
    from trl import DPOTrainer

    if not rows:
        raise ValueError("no preference pairs to train on (every kept rollout's baseline succeeded or broke)")

    def build(model: Any, tokenizer: Any, output_dir: str, cuda: bool) -> tuple[Any, int]:
        args = _config(settings, output_dir, cuda)
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
        return trainer, len(rows)

    return fit(model_name, out_dir, settings, init_adapter, build)


def _config(settings: DPOSettings, output_dir: str, cuda: bool) -> Any:
    """TRL DPOConfig: the arguments every trainer shares, plus beta."""
    from trl import DPOConfig

    return DPOConfig(**trainer_args(settings, output_dir, cuda), beta=settings.beta)
