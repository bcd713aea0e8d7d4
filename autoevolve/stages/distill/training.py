"""Training settings: what every trainer shares (the LoRA, the optimiser, the data), and each trainer's own.

One config per trainer, as TRL keeps them: a run config's ``distill`` section holds the shared settings and the
selected trainer's own section (``distill: {trainer: grpo, grpo: {generations: 4}}``). This module imports only
pydantic, so reading a config never loads torch, TRL or the rollout engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Settings(BaseModel):
    """Settings whose unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class TrainSettings(_Settings):
    """What every trainer shares: the LoRA's shape, the optimiser, the batches, precision, seed and logging."""

    epochs: float = Field(default=2, gt=0, description="Passes over the examples (fractions allowed).")
    epoch_grid: list[int] | None = Field(
        default=None,
        description="Choose the training length on dev: train up to the largest of these epochs, score the adapter "
        "on dev tasks after each, stop at the first that does not beat the best before it (once one scores above 0) "
        "or once one scores 1.0, and keep the best, the earliest of equals; ``epochs`` is then not used. None: train "
        "``epochs``.",
    )
    learning_rate: float = Field(
        default=1e-3, gt=0, description="Peak AdamW learning rate, decayed linearly to 0; LoRA on 135M takes ~1e-3."
    )
    batch_size: int = Field(default=8, ge=1, description="Examples per device step.")
    grad_accum: int = Field(default=1, ge=1, description="Device steps accumulated into one optimiser step.")
    lora_r: int = Field(default=16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(default=32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS), description="Linear layers that get LoRA (never lm_head)."
    )
    max_length: int = Field(
        default=1024,
        ge=16,
        description="Tokens kept per SFT example or DPO conversation (its start is kept); GRPO bounds its replies "
        "with grpo.completion_tokens instead.",
    )
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Matrix products in bf16 with fp32 master weights (mixed precision), or all in fp32. auto: bf16 "
        "on a CUDA device or a CPU with native bf16 (AVX512-BF16, AMX), fp32 elsewhere.",
    )
    seed: int = Field(default=0, description="Seed for adapter init, data order and dropout.")
    report_to: list[str] = Field(
        default_factory=list,
        description="Also stream the per-step training log to these transformers integrations (tensorboard, "
        "trackio, mlflow, wandb, ...), each set up as it documents; files they write locally (TensorBoard's event "
        "files) go to the adapter folder's logs/. The log is always saved there as training_log.jsonl.",
    )

    @field_validator("epoch_grid")
    @classmethod
    def _increasing(cls, grid: list[int] | None) -> list[int] | None:
        """Epochs to choose from, each a whole pass, in increasing order."""
        if grid is not None and (not grid or min(grid) < 1 or grid != sorted(set(grid))):
            raise ValueError(f"list whole epochs >= 1 in increasing order, e.g. [1, 2, 4, 8] (got {grid})")
        return grid

    @property
    def max_epochs(self) -> float:
        """Passes the trainer is set up for: the grid's largest, else ``epochs``."""
        return max(self.epoch_grid) if self.epoch_grid else self.epochs

    @field_validator("report_to")
    @classmethod
    def _installed_integrations(cls, names: list[str]) -> list[str]:
        """Refuse a name transformers does not know, or whose package is missing, before any rollout is spent."""
        from transformers.integrations.integration_utils import (
            INTEGRATION_TO_CALLBACK,
            get_available_reporting_integrations,
        )

        for name in names:
            if name not in INTEGRATION_TO_CALLBACK:
                known = ", ".join(sorted(INTEGRATION_TO_CALLBACK))
                raise ValueError(f"{name!r} is not a transformers integration (known: {known})")
            if name not in get_available_reporting_integrations():
                package = name.replace("_", "-")
                raise ValueError(f"{name!r} needs its package installed (pip install {package})")
        return names


class SFTSettings(_Settings):
    """SFT's own settings (``distill.sft``)."""

    share_prefix: bool = Field(
        default=True,
        description="Run a batch's common prompt prefix through the model once for all its rows (the loss and "
        "gradients are unchanged; only the compute shrinks).",
    )


class DPOSettings(_Settings):
    """DPO's own settings (``distill.dpo``)."""

    beta: float = Field(default=0.1, gt=0, description="How far the adapter may move from the reference.")


class GRPOSettings(_Settings):
    """GRPO's own settings (``distill.grpo``): the group and how its replies are sampled."""

    generations: int = Field(
        default=4, ge=2, description="Replies sampled per prompt; advantages are relative within the group."
    )
    completion_tokens: int = Field(default=96, gt=0, description="Most tokens a sampled reply may have.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of the replies.")
    kl: float = Field(default=0.0, ge=0, description="KL penalty towards the model before training (0: none).")


TRAINER_SETTINGS: dict[str, type[_Settings]] = {"sft": SFTSettings, "dpo": DPOSettings, "grpo": GRPOSettings}
