"""Stage 3, context distillation: train a LoRA so the original short config behaves like the evolved one."""

from autoevolve.distill.dataset import build_dataset, native_tools, render_examples, tokenize_with_assistant_mask
from autoevolve.distill.sft import SFTSettings, TrainResult, train_sft

__all__ = [
    "SFTSettings",
    "TrainResult",
    "build_dataset",
    "native_tools",
    "render_examples",
    "tokenize_with_assistant_mask",
    "train_sft",
]
