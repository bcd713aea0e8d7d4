"""Where a round's time goes: per stage, seconds, model calls, prompt tokens computed and reused, tokens generated,
decode steps, prefill and decode seconds, training tokens/s, and model loads.

It runs one round of a run config (the quickstart by default) from a fresh store, stage by stage through the
library (the same stage functions the Prefect flow calls), and prints one row per stage, then the check of the
quickstart's budget: a round's stages in at most 360 s with the test gain (new adapter vs base model, original
config) at least 0.50 and retention at least 1.0.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/round_profile.py [CONFIG] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from _shared import write_json

from autoevolve import loop, model
from autoevolve.config import load_config
from autoevolve.records import CELLS
from autoevolve.stages import pipeline
from autoevolve.stages.distill import fit
from autoevolve.stages.pipeline import STAGES
from autoevolve.views.twobytwo import SHORT_LABELS, score

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 360.0


class LoadCounter:
    """Counts and times model loads (the policy's and every trainer's fresh copy)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._load = 0, 0.0, model.load

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._load(*args, **kwargs)
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - started


def main() -> None:
    """Run the round stage by stage and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    loads = LoadCounter()
    model.load = fit.load = loads  # the policy's load and every trainer's
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(args.config).model_copy(update={"store": f"{tmp}/store.duckdb", "run_dir": f"{tmp}/runs"})
        r = loop.open_round(config)
        stats = getattr(r.bench.policy, "decoder", None)
        rows = [_row("open", 0.0, {}, {}, loads, None)]
        for stage in STAGES:
            if stage == "warm" and not r.warm_start_due:
                continue
            if stage not in ("plan", "evolve", "select") and not pipeline.result(r, "select").items:
                break
            before, loaded = _stats(stats), (loads.count, loads.seconds)
            pipeline.run_stage(r, stage)
            train = pipeline.result(r, "distill").train if stage == "distill" else None
            rows.append(_row(stage, r.seconds[stage], before, _stats(stats), loads, train, loaded))
        report = loop.finish_round(r)
        r.bench.store.close()
    _print(rows, report)
    if args.json:
        write_json(args.json, {"rows": rows, "eval": report.get("eval"), "seconds": report["seconds"]})


def _stats(decoder: Any) -> dict[str, float]:
    """The decoder's counters now (empty for a policy without one)."""
    return dataclasses.asdict(decoder.stats) if decoder is not None else {}


def _row(stage: str, seconds: float, before: dict, after: dict, loads: LoadCounter, train: Any,
         loaded: tuple[int, float] = (0, 0.0)) -> dict[str, Any]:  # fmt: skip
    """One stage's row: its seconds and the counters it moved."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    return {
        "stage": stage,
        "seconds": seconds,
        "prompts": delta.get("rows", 0),
        "prefill_tokens": delta.get("prefill_tokens", 0),
        "reused_tokens": delta.get("reused_tokens", 0),
        "decode_tokens": delta.get("decode_tokens", 0),
        "decode_steps": delta.get("decode_steps", 0),
        "prefill_s": delta.get("prefill_s", 0.0),
        "decode_s": delta.get("decode_s", 0.0),
        "train_tokens_per_s": train.tokens / train.train_seconds if train and train.train_seconds else None,
        "train_s": train.train_seconds if train else None,
        "model_loads": loads.count - loaded[0],
        "load_s": loads.seconds - loaded[1],
    }


def _print(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    """The table, the totals and the budget check."""
    head = ("stage", "seconds", "prompts", "prefill tok", "reused tok", "decode tok", "steps", "prefill s", "decode s",
            "train tok/s", "loads")  # fmt: skip
    print("\n" + "".join(f"{h:>12}" for h in head))
    for row in rows:
        train = f"{row['train_tokens_per_s']:.0f}" if row["train_tokens_per_s"] else "-"
        cells = (row["stage"], f"{row['seconds']:.1f}", row["prompts"], row["prefill_tokens"], row["reused_tokens"],
                 row["decode_tokens"], row["decode_steps"], f"{row['prefill_s']:.1f}", f"{row['decode_s']:.1f}", train,
                 f"{row['model_loads']} ({row['load_s']:.1f}s)")  # fmt: skip
        print("".join(f"{c:>12}" for c in cells))
    total = sum(report["seconds"].values())
    evaluation = report.get("eval") or {}
    gain = evaluation.get("new_original", 0.0) - evaluation.get("live_original", 0.0)
    retention = (report.get("retention") or {}).get("test")
    shown = ", ".join(f"{SHORT_LABELS[k]} {score(evaluation.get(k, 0.0))}" for k in CELLS)
    print(f"\nstages: {total:.0f} s; test 2x2: {shown}")
    ok = total <= BUDGET_S and gain >= 0.5 and retention is not None and retention >= 1.0
    print(
        f"{'PASS' if ok else 'FAIL'}: {total:.0f} s of stages (target <= {BUDGET_S:.0f}), test gain {gain:+.3f} "
        f"(target >= 0.50), retention {retention if retention is None else round(retention, 2)} (target >= 1.0)"
    )


if __name__ == "__main__":
    main()
