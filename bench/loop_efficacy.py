"""Does the loop compound? Run configs/loop.yaml (three rounds) and print one row per round from its rounds.json.

Per round: the gate's decision, the test score of the new adapter with the original config, the test score of
the adapter that serves after the round (the new one if promoted, else the previous one), retention, the prompt
tokens of the original and the best evolved config, rollouts and training seconds. Below the table, the three
acceptance checks: the served adapter's test score never goes down, round 1 retention >= 1.0, and the served
prompt is at least 50% shorter than the best evolved one.

Run: HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python bench/loop_efficacy.py
     (30-50 minutes on 2 CPU cores; --table RUN_DIR prints the table of a finished run without running)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def served_score(row: dict[str, Any]) -> float:
    """Test score of the adapter serving after the round: the new one if promoted, else the one before it."""
    cells = row["eval"]
    return cells["adapter_original"] if row["promoted"] else cells["base_original"]


def table(rows: list[dict[str, Any]]) -> str:
    """The per-round table and the acceptance checks, as text."""
    head = (
        f"{'round':>5} {'decision':>17} {'new+orig':>9} {'served+orig':>12} {'retention':>10} "
        f"{'tokens orig':>12} {'tokens evolved':>15} {'shorter':>8} {'rollouts':>9} {'train s':>8}"
    )
    lines, served = [head], None
    for row in rows:
        if row["eval"] is None:  # no adapter trained: the one serving before still serves
            kept = "-" if served is None else f"{served:.3f}"
            lines.append(
                f"{row['round']:>5} {row['decision']:>17} {'-':>9} {kept:>12} {'-':>10} {'':>12} {'':>15}"
                f" {'':>8} {row['rollouts']:>9} {'-':>8}"
            )
            continue
        served = served_score(row)
        tokens = row["prompt_tokens"]
        shorter = 1 - tokens["original"] / tokens["evolved"]
        kept = row["retention"]["test"]
        lines.append(
            f"{row['round']:>5} {row['decision']:>17} {row['eval']['adapter_original']:>9.3f} "
            f"{served:>12.3f} {'-' if kept is None else f'{kept:.2f}':>10} {tokens['original']:>12.0f} "
            f"{tokens['evolved']:>15.0f} {shorter:>8.0%} {row['rollouts']:>9} {row['train_seconds'] or 0:>8.0f}"
        )
    return "\n".join(lines + [""] + checks(rows))


def checks(rows: list[dict[str, Any]]) -> list[str]:
    """The acceptance checks, each with its numbers and PASS or FAIL."""
    trained = [r for r in rows if r["eval"] is not None]
    if not trained:
        return ["no round trained an adapter: nothing to check"]
    start = trained[0]["eval"]["base_original"]
    served = [start] + [served_score(r) for r in trained]
    steady = all(b >= a for a, b in itertools.pairwise(served))
    first = trained[0]["retention"]["test"]
    tokens = trained[0]["prompt_tokens"]
    shorter = 1 - tokens["original"] / tokens["evolved"]
    verdict = {True: "PASS", False: "FAIL"}
    return [
        f"served adapter + original, test: {' -> '.join(f'{s:.3f}' for s in served)}  never down: {verdict[steady]}",
        f"first round's retention: {'-' if first is None else f'{first:.2f}'}  >= 1.0: "
        f"{verdict[first is not None and first >= 1.0]}",
        f"served prompt {tokens['original']:.0f} vs best evolved {tokens['evolved']:.0f} tokens: {shorter:.0%} "
        f"shorter  >= 50%: {verdict[shorter >= 0.5]}",
    ]


def run(config_path: Path) -> Path:
    """Run every round of the config from a fresh store; returns the run folder."""
    from autoevolve.config import load_config
    from flows.loop import loop_flow

    config = load_config(config_path)
    run_dir = Path(config.run_dir) / str(config.run_id)
    if run_dir.exists() or Path(config.store).exists():
        # A leftover store would resume (or just reprint) the run it holds instead of measuring a fresh one.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for old in (run_dir, Path(config.store)):
            if old.exists():
                old.rename(old.with_name(f"{old.name}.{stamp}"))
                print(f"moved the previous {old} aside to {old.name}.{stamp}")
    started = time.perf_counter()
    loop_flow(config)
    print(f"{config.rounds} rounds in {(time.perf_counter() - started) / 60:.1f} min")
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "loop.yaml")
    parser.add_argument("--table", type=Path, help="print the table of a finished run folder; run nothing")
    args = parser.parse_args()
    run_dir = args.table or run(args.config)
    rows = json.loads((run_dir / "rounds.json").read_text())
    print(table(rows))


if __name__ == "__main__":
    main()
