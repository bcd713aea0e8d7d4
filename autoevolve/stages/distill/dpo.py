"""Preference distillation: TRL DPO with a PEFT LoRA on (chosen, rejected) pairs rendered under the original config.

Chosen is an evolved-config rollout that succeeded, rejected the original config's failed rollout on the same
task (the selection's kept and beaten rollouts). Both are re-rendered under the ORIGINAL config, so the shared prompt
is what the served expert sees and only the completions differ. The reference model is the base with the adapter
switched off (TRL's default for a PEFT model).

A completion of several turns holds the environment's tool results too. Only the assistant's own tokens count in
the log-ratios: the rows are tokenised here with the mask SFT uses (``autoevolve.stages.distill.dataset``), and TRL's
preference collator is given that mask (``assistant_only_collator``), so the adapter is never pushed towards or
away from text the environment wrote.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import Task, TrainResult, Trajectory
from autoevolve.stages.distill.dataset import assistant_mask, prompt_ids, render_examples
from autoevolve.stages.distill.fit import Judge, fit, trainer_args
from autoevolve.stages.distill.training import DPOSettings, TrainSettings


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
    settings: TrainSettings,
    init_adapter: str | None = None,
    dpo: DPOSettings | None = None,
    judge: Judge | None = None,
) -> TrainResult:
    """Train a LoRA adapter with DPO (continuing from ``init_adapter`` if given) and save it to ``out_dir``; ``dpo``
    holds DPO's own settings (defaults if None)."""
    from datasets import Dataset
    from trl import DPOTrainer

    if not rows:
        raise ValueError("no preference pairs to train on (every kept rollout's baseline succeeded or broke)")

    class Trainer(DPOTrainer):
        def _prepare_dataset(self, dataset: Any, *args: Any) -> Any:
            return dataset  # tokenised by preference_dataset, with the assistant masks TRL would not make

    def build(model: Any, tokenizer: Any, output_dir: str, cuda: bool) -> tuple[Any, int]:
        args = _config(settings, dpo or DPOSettings(), output_dir, cuda)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        collator = assistant_only_collator(pad, args.max_length, args.truncation_mode)
        data = Dataset.from_dict(preference_dataset(rows, tokenizer))
        trainer = Trainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, data_collator=collator
        )
        return trainer, len(rows)

    return fit(model_name, out_dir, settings, init_adapter, build, judge)


def preference_dataset(
    rows: list[dict[str, list[dict]]], tokenizer: Any, tools: list[dict] | None = None
) -> dict[str, list[list[int]]]:
    """Columns for TRL's DPO: ``prompt_ids`` (through the generation prompt), ``chosen_ids``/``rejected_ids`` (the
    rest of each conversation) and ``chosen_mask``/``rejected_mask`` (1 on the completion's assistant tokens)."""
    out: dict[str, list[list[int]]] = defaultdict(list)
    for row in rows:
        prompt = prompt_ids(tokenizer, row["prompt"], tools)
        out["prompt_ids"].append(prompt)
        for side in ("chosen", "rejected"):
            ids, mask = assistant_mask(row["prompt"] + row[side], tokenizer, tools)
            if ids[: len(prompt)] != prompt:
                raise ValueError("the chat template renders the prompt differently inside the whole conversation")
            out[f"{side}_ids"].append(ids[len(prompt) :])
            out[f"{side}_mask"].append(mask[len(prompt) :])
    return dict(out)


def assistant_only_collator(
    pad_token_id: int, max_length: int | None = None, truncation_mode: str = "keep_start"
) -> Any:
    """TRL's preference collator with its completion mask cut to the assistant's tokens (the rows' ``*_mask``)."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class AssistantOnly(DataCollatorForPreference):
        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            out = super().torch_call(examples)
            keep = torch.zeros_like(out["completion_mask"])
            rows = [(e, "chosen") for e in examples] + [(e, "rejected") for e in examples]  # the parent's order
            for i, (example, side) in enumerate(rows):
                mask = [0] * len(example["prompt_ids"]) + list(example[f"{side}_mask"])
                if self.max_length is not None:  # truncated as the parent truncates the ids
                    end = self.truncation_mode == "keep_end"
                    mask = mask[-self.max_length :] if end else mask[: self.max_length]
                keep[i, : len(mask)] = torch.tensor(mask, dtype=keep.dtype)
            out["completion_mask"] = out["completion_mask"] * keep
            return out

    return AssistantOnly(pad_token_id=pad_token_id, max_length=max_length, truncation_mode=truncation_mode)


def _config(settings: TrainSettings, dpo: DPOSettings, output_dir: str, cuda: bool) -> Any:
    """TRL DPOConfig: the arguments every trainer shares, plus beta; the mask columns reach the collator."""
    from trl import DPOConfig

    return DPOConfig(**trainer_args(settings, output_dir, cuda), beta=dpo.beta, remove_unused_columns=False)
