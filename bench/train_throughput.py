"""SFT throughput on the quickstart's distillation data: the former trainer against the current one, one process.

"Before" is TRL's SFTTrainer in fp32, as the project trained until now: every position of every row computed and
scored. "Compact" runs a batch's shared prompt prefix once and scores only labelled positions
(``autoevolve.stages.distill.compact``). The data has the shape of the quickstart's selection (the kept rollouts of
``select.train_tasks`` train tasks, each re-rendered under the original config): the reference conversations of
the same train tasks. Each mode trains the same LoRA with the quickstart's distill settings; the table shows tokens/s
in the training loop (padding excluded) and the loss, so a faster mode is only a win at an equal loss.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/train_throughput.py [--examples 33] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _shared import write_json

from autoevolve.config import load_config
from autoevolve.records import Trajectory
from autoevolve.stages.distill import TrainSettings, render_examples, sft, train_sft
from autoevolve.stages.distill.compact import compact_sft_trainer
from autoevolve.stages.plan import train_tasks

ROOT = Path(__file__).resolve().parents[1]
MODES = {  # precision, and whether the compact trainer (else TRL's own SFTTrainer)
    "fp32, TRL SFTTrainer (before)": ("float32", False),
    "fp32, compact": ("float32", True),
    "bf16 mixed, TRL SFTTrainer": ("bfloat16", False),
    "bf16 mixed, compact (auto here)": ("bfloat16", True),
}


def stock_trainer() -> type:
    """TRL's SFTTrainer as the project used it before (it takes, and ignores, the compact trainer's argument)."""
    from trl import SFTTrainer

    class Stock(SFTTrainer):
        def __init__(self, *args: Any, share_prefix: bool = True, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    return Stock


def examples(n: int) -> tuple[list[list[dict]], Any]:
    """Reference conversations of n of the quickstart's selection tasks under its original config, and the config."""
    config = load_config(ROOT / "configs" / "quickstart.yaml")
    env = config.env.make()
    tasks = train_tasks(env, config.select.train_tasks, config.seed)[:n]
    trajs = [
        Trajectory(run_id="bench", task_id=t.id, split="train", hcp_id="ref", messages=env.reference(t), reward=1.0)
        for t in tasks
    ]
    return render_examples(trajs, {t.id: t for t in tasks}, config.original_hcp()), config


def main() -> None:
    """Train once per mode (repeats: medians) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=33, help="examples (the quickstart kept 33)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="*", default=list(MODES), help="which rows to run")
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    data, config = examples(args.examples)
    base = TrainSettings(**config.distill.model_dump(include=set(TrainSettings.model_fields)))
    rows = []
    for label in args.modes:
        precision, compact = MODES[label]
        sft.compact_sft_trainer = compact_sft_trainer if compact else stock_trainer
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                settings = base.model_copy(update={"precision": precision})
                runs.append(train_sft(data, config.model.name, Path(tmp) / "adapter", settings))
        first = runs[0]
        rows.append({
            "mode": label,
            "tokens_per_s": statistics.median(r.tokens / r.train_seconds for r in runs),
            "tokens": first.tokens,
            "steps": first.steps,
            "seconds": statistics.median(r.train_seconds for r in runs),
            "train_loss": first.train_loss,
            "last_loss": first.last_loss,
        })  # fmt: skip
    _print(rows, args, base)
    if args.json:
        write_json(args.json, {"rows": rows})


def _print(rows: list[dict[str, Any]], args: argparse.Namespace, base: TrainSettings) -> None:
    """The table, and the check of the last row against the first: >= 2x the tokens/s at an equal loss."""
    before = rows[0]
    print(f"\nLoRA SFT, {args.examples} examples x {base.epochs:g} epochs, batch {base.batch_size}, "
          f"median of {args.repeats}")  # fmt: skip
    print(f"{'mode':<36}{'tokens/s':>10}{'ratio':>8}{'steps':>7}{'train s':>9}{'mean loss':>11}{'last loss':>11}")
    for row in rows:
        ratio = row["tokens_per_s"] / before["tokens_per_s"]
        print(f"{row['mode']:<36}{row['tokens_per_s']:>10.1f}{ratio:>8.2f}{row['steps']:>7}{row['seconds']:>9.1f}"
              f"{row['train_loss']:>11.4f}{row['last_loss']:>11.4f}")  # fmt: skip
    best = rows[-1]
    ratio = best["tokens_per_s"] / before["tokens_per_s"]
    equal = abs(best["train_loss"] - before["train_loss"]) <= 0.1 * before["train_loss"] + 0.01
    print(f"{'PASS' if ratio >= 2.0 and equal else 'FAIL'}: {best['mode']} trains {ratio:.2f}x the tokens/s of "
          f"{before['mode']} (target >= 2x) at a mean loss of {best['train_loss']:.4f} vs {before['train_loss']:.4f} "
          "(equal: within 10% + 0.01)")  # fmt: skip


if __name__ == "__main__":
    main()
