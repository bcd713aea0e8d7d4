"""The training loop every trainer shares: a fresh base wrapped in the LoRA, the trainer's TRL run, the adapter saved.

A fresh base model is loaded for every run so training never touches the weights the policy serves. The adapter
is saved in PEFT safetensors format with ``base_model_name_or_path`` set to the base model id, which vLLM needs.
Each trainer (``sft``, ``dpo``, ``grpo``) only builds its TRL trainer; ``fit`` does the rest, on CPU (fp32) or one
CUDA device (bf16), same code. With ``epoch_grid`` the training length is chosen on dev: after each listed epoch the
adapter is saved and handed to the caller's judge (a dev score), training stops at the first epoch that does not
beat the best before it (while every epoch so far scores 0 there is no signal to stop on: a few examples need more
passes), and the best epoch's adapter is the one saved.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoevolve.model import base_model_id, load, native_bf16
from autoevolve.records import TrainResult
from autoevolve.stages.distill.training import TrainSettings
from autoevolve.views.narration import print_progress, say

STEPS = logging.getLogger("autoevolve.training")  # one JSON row per logged optimiser step
TRAINING_LOG = "training_log.jsonl"  # in every adapter folder: the trainer's log rows, one JSON object a line


Build = Callable[[Any, Any, str, bool], tuple[Any, int]]  # (model, tokenizer, output_dir, cuda) -> (trainer, examples)
Judge = Callable[[str, int], float]  # (adapter folder, epoch) -> its dev score


def fit(
    model_name: str,
    out_dir: str | Path,
    settings: TrainSettings,
    init_adapter: str | None,
    build: Build,
    judge: Judge | None = None,
) -> TrainResult:
    """What every trainer shares: seed, a fresh base wrapped in the LoRA (new, or A_r to continue), the TRL trainer
    ``build`` makes for it, training, and the adapter saved with its base model id (with ``settings.epoch_grid``,
    the one of the epoch ``judge`` scored best)."""
    import torch
    from datasets.utils import disable_progress_bars
    from transformers import PrinterCallback, set_seed

    disable_progress_bars()  # TRL's per-dataset map bars ("Building labels ..."): the run prints its own progress

    if settings.epoch_grid and judge is None:
        raise ValueError("epoch_grid chooses the training length on dev: it needs a judge that scores an adapter")
    start = time.perf_counter()
    set_seed(settings.seed)  # before the adapter is created: its A matrices are drawn at random
    # A fresh copy (the serving policy's weights are never trained); frozen base weights in bf16 under mixed
    # precision, as on a GPU worker; the LoRA weights stay fp32 (PEFT upcasts adapters of a bf16 base).
    model, tokenizer = load(model_name, "bfloat16" if mixed_bf16(settings) else "float32")
    model = with_adapter(model, settings, init_adapter)
    with tempfile.TemporaryDirectory(prefix="autoevolve-train-") as tmp:
        # What an integration writes locally (TensorBoard's event files) is kept beside the adapter.
        output_dir = str(Path(out_dir) / "logs") if settings.report_to else tmp
        trainer, examples = build(model, tokenizer, output_dir, torch.cuda.is_available())
        trainer.remove_callback(PrinterCallback)  # a raw dict per step on the terminal: the rows go to the log file
        trainer.add_callback(progress_callback(_print_step))
        lengths = _on_dev(settings.epoch_grid, judge, Path(out_dir) / "epochs", base_model_id(model_name))
        if lengths is not None:
            trainer.add_callback(lengths)
        output = trainer.train()
    if lengths is None or not lengths.scores:  # no grid epoch reached (nothing to train on): the adapter as it is
        path = save_adapter(trainer.model, out_dir, base_model_id(model_name))
        lengths = None
    else:
        path = lengths.keep_best(Path(out_dir))
    rows = trainer.state.log_history  # one row per step (loss, learning rate, grad norm, reward), then a summary
    (path / TRAINING_LOG).write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    result = trained(trainer, output, path, start, examples)
    if lengths is not None:
        scores = {str(e): v for e, v in lengths.scores.items()}
        result = result.model_copy(update={"dev_by_epoch": scores, "epochs": float(lengths.best)})
    return result


def _on_dev(grid: list[int] | None, judge: Judge | None, folder: Path, base: str) -> Any:
    """The callback that judges the adapter after each epoch of the grid and stops when it no longer improves."""
    if not grid or judge is None:
        return None
    from transformers import TrainerCallback

    class LengthOnDev(TrainerCallback):
        """Saves and judges the adapter at the grid's epochs; stops at the first that does not beat the best (once
        one scores above 0)."""

        def __init__(self) -> None:
            self.scores: dict[int, float] = {}
            self.best = 0

        def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            """Judge a grid epoch's adapter; stop unless it is the best so far and below a full score."""
            epoch = round(state.epoch)
            if epoch not in grid:
                return
            path = save_adapter(model, folder / f"epoch-{epoch}", base)
            self.scores[epoch] = score = judge(str(path), epoch)
            if not self.best or score > self.scores[self.best]:
                self.best = epoch
            say(f"  train: epoch {epoch} scores {score:.3f} on dev (best: epoch {self.best})")
            stalled = self.best != epoch and self.scores[self.best] > 0  # nothing scoring yet: no signal to stop on
            if stalled or score >= 1.0:
                control.should_training_stop = True

        def keep_best(self, out_dir: Path) -> Path:
            """The best epoch's adapter moved to ``out_dir``; the other epochs' removed."""
            out_dir.mkdir(parents=True, exist_ok=True)
            for file in (folder / f"epoch-{self.best}").iterdir():
                shutil.copy2(file, out_dir / file.name)
            shutil.rmtree(folder)
            return out_dir

    return LengthOnDev()


def with_adapter(model: Any, settings: TrainSettings, init_adapter: str | None) -> Any:
    """Wrap the base in a new LoRA adapter, or in a saved one to continue training it."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if init_adapter is not None:
        return PeftModel.from_pretrained(model, init_adapter, is_trainable=True)
    config = LoraConfig(
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def mixed_bf16(settings: TrainSettings) -> bool:
    """Whether a run trains in bf16 mixed precision (``settings.precision``; auto: where bf16 is native)."""
    return settings.precision == "bfloat16" or (settings.precision == "auto" and native_bf16())


def trainer_args(settings: TrainSettings, output_dir: str, cuda: bool) -> dict[str, Any]:
    """Arguments every trainer shares: no checkpoints, a log row per step (to ``report_to`` too), seeded,
    device-aware."""
    return {
        "output_dir": output_dir,
        "num_train_epochs": settings.max_epochs,
        "learning_rate": settings.learning_rate,
        "per_device_train_batch_size": settings.batch_size,
        "gradient_accumulation_steps": settings.grad_accum,
        "max_length": settings.max_length,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "use_cpu": not cuda,
        "bf16": mixed_bf16(settings),
        "fp16": False,
        "save_strategy": "no",
        "logging_strategy": "steps",
        "logging_steps": 1,
        "report_to": list(settings.report_to),
        "seed": settings.seed,
        "data_seed": settings.seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def trained(trainer: Any, output: Any, path: Path, started: float, examples: int) -> TrainResult:
    """The TrainResult of a finished TRL run."""
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    counts = [row["num_tokens"] for row in trainer.state.log_history if "num_tokens" in row]  # logged by SFT
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]  # logged by RL trainers
    return TrainResult(
        path=str(path),
        steps=output.global_step,
        train_loss=float(output.training_loss),
        first_loss=float(losses[0]) if losses else float("nan"),
        last_loss=float(losses[-1]) if losses else float("nan"),
        seconds=time.perf_counter() - started,
        examples=examples,
        tokens=int(counts[-1]) if counts else 0,
        train_seconds=float(output.metrics.get("train_runtime", 0.0)),
        first_reward=rewards[0] if rewards else None,
        last_reward=rewards[-1] if rewards else None,
    )


def save_adapter(model: Any, out_dir: str | Path, base: str) -> Path:
    """Save the adapter (safetensors) and pin ``base_model_name_or_path`` to the base model id."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    for config in model.peft_config.values():
        config.base_model_name_or_path = base
    model.save_pretrained(str(path), safe_serialization=True)
    # PEFT may re-derive the field from the model on save; rewrite it so vLLM finds the right base whatever it did.
    config_file = path / "adapter_config.json"
    body = json.loads(config_file.read_text())
    if body.get("base_model_name_or_path") != base:
        body["base_model_name_or_path"] = base
        config_file.write_text(json.dumps(body, indent=2, sort_keys=True))
    return path


def _print_step(row: dict) -> None:
    """Training progress on stderr: a bar of steps and the last loss, one line updated in place; the whole row to
    the ``autoevolve.training`` logger (the run's log file; the terminal too with ``autoevolve -v``)."""
    STEPS.info(json.dumps(row, sort_keys=True))
    if "loss" in row:
        print_progress("train", row["step"], row["max_steps"], note=f" (loss {row['loss']:.3f})")


def progress_callback(progress: Callable[[dict], None]) -> Any:
    """A TrainerCallback forwarding each log row (loss, learning rate, step) to ``progress``."""
    from transformers import TrainerCallback

    class ProgressCallback(TrainerCallback):
        """Calls ``progress`` on every log."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            """Report one log row with its step."""
            if logs:
                progress({"step": state.global_step, "max_steps": state.max_steps, **logs})

    return ProgressCallback()
