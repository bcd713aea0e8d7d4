"""LoRA SFT on distillation examples with TRL: loss on assistant tokens only, a batch's shared prompt run once.

The training loop itself (the fresh base, the LoRA, saving) is ``autoevolve.stages.distill.fit``'s, shared by every
trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoevolve.records import TrainResult
from autoevolve.stages.distill.compact import compact_sft_trainer
from autoevolve.stages.distill.dataset import build_dataset
from autoevolve.stages.distill.fit import Judge, fit, progress_callback, trainer_args
from autoevolve.stages.distill.training import SFTSettings, TrainSettings


def train_sft(
    examples: list[list[dict]],
    model_name: str,
    out_dir: str | Path,
    settings: TrainSettings,
    init_adapter: str | None = None,
    progress: Callable[[dict], None] | None = None,
    tools: list[dict] | None = None,
    sft: SFTSettings | None = None,
    judge: Judge | None = None,
) -> TrainResult:
    """Train a LoRA adapter on chat examples (loss on assistant tokens only) and save it to ``out_dir``.

    With ``init_adapter`` training continues from that adapter and its own rank, alpha and targets (the LoRA fields
    of ``settings`` are ignored). ``tools`` is the native tool list for the chat template (see ``native_tools``);
    ``sft`` holds SFT's own settings (defaults if None); ``judge`` scores an adapter folder on dev, which
    ``settings.epoch_grid`` needs to choose the training length.
    """
    own = sft or SFTSettings()

    def build(model: Any, tokenizer: Any, output_dir: str, cuda: bool) -> tuple[Any, int]:
        tokenizer.padding_side = "right"  # TRL pads itself on the right; keep the tokenizer consistent with it
        dataset = build_dataset(examples, tokenizer, tools=tools, max_length=settings.max_length)
        trainer = compact_sft_trainer()(
            share_prefix=own.share_prefix,
            model=model,
            args=_config(settings, output_dir, cuda),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[progress_callback(progress)] if progress else None,
        )
        return trainer, len(dataset)

    return fit(model_name, out_dir, settings, init_adapter, build, judge)


def _config(settings: TrainSettings, output_dir: str, cuda: bool) -> Any:
    """TRL SFTConfig: the shared training arguments, plus SFT's own."""
    from trl import SFTConfig

    # A 135M model's activations fit easily; recomputing them would only cost time.
    return SFTConfig(**trainer_args(settings, output_dir, cuda), weight_decay=0.0, activation_checkpointing=False)
