"""Stage 3, context distillation: train a LoRA so the original short config behaves like the evolved one.

Importing this package loads no torch, TRL or rollout engine (run configs read ``autoevolve.stages.distill.training``);
the trainers import those when they run.
"""

from autoevolve.records import TrainResult
from autoevolve.stages.distill.dataset import build_dataset, native_tools, render_examples, tokenize_with_assistant_mask
from autoevolve.stages.distill.sft import train_sft
from autoevolve.stages.distill.training import DPOSettings, GRPOSettings, SFTSettings, TrainSettings

__all__ = [
    "DPOSettings",
    "GRPOSettings",
    "SFTSettings",
    "TrainResult",
    "TrainSettings",
    "build_dataset",
    "native_tools",
    "render_examples",
    "tokenize_with_assistant_mask",
    "train_sft",
]
