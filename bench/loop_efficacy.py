"""Does the loop compound? Run configs/loop.yaml (three rounds) and print per round and per tier what it did.

Per round: the gate's decision; the test 2x2 (A_r / A_{r+1} x original / best evolved config); the served expert's
test score under the original config (A_{r+1} if promoted, else A_r) with the paired gain over the expert served
before the round and its 95% interval (the same test tasks, task by task, from the store); retention; prompt
tokens; the tiers in play; where the kept rollouts came from (search or best-of-k samples); rollouts and training
seconds. A round that trained nothing shows no score. Per tier: the served expert's test score after each round.

The checks are strict (each prints its numbers, then PASS or FAIL): every round promoted, and its served expert
above the previous one with the paired interval above zero (a flat round fails); after the last round tier 1
>= 0.85 and tier 2 >= 0.40 with the original short prompt, each with its measured ceiling (the best test score on
the tier of any adapter the run trained, promoted or not); no tier drops by more than 0.05 from a round to the next;
the run takes at most 60 minutes (not checked with --table).

Run: HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python bench/loop_efficacy.py
     (--table RUN_DIR prints the tables of a finished run without running; the store is read for the pairs)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import code_id, paired_gain, write_json  # noqa: E402

from autoevolve.records import CELLS, renamed_cells  # noqa: E402
from autoevolve.views.twobytwo import SHORT_LABELS, score  # noqa: E402

TIER_BARS = {"1": 0.85, "2": 0.40}  # the served expert after the last round, original config, test
MAX_TIER_DROP = 0.05
MAX_MINUTES = 60.0  # the whole run, from a fresh store, on 2 cores


Pair = tuple[list[float], list[float]]


def served_rewards(config: Any, rows: list[dict[str, Any]]) -> list[Pair | None]:
    """Per round: per-test-task rewards under the original config of the expert served before the round (A_r) and
    after it (A_{r+1} if promoted, else A_r), read from the store; None where the round trained nothing."""
    from autoevolve.store import Store

    ids = [t.id for t in config.env.make().tasks("test")[: config.gate.test_tasks]]
    original = config.original_hcp().id
    out: list[Pair | None] = []
    with Store(config.store, read_only=True) as store:

        def rewards(adapter: str) -> list[float]:
            found = store.trajectories(config.run_id, hcp_id=original, adapter=adapter, task_ids=ids)
            by_task = {t.task_id: t.reward for t in found if t.sample == 0}
            return [by_task[i] for i in ids]

        for row in rows:
            if row["eval"] is None:
                out.append(None)
                continue
            live = row["live_adapter"] or ""
            out.append((rewards(live), rewards(row["adapter"] if row["promoted"] else live)))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(rows: list[dict[str, Any]], served: list[Pair | None]) -> list[str]:
    """One line per round; the test 2x2's columns in ``autoevolve.views.twobytwo``'s order and labels."""
    two = " ".join(f"{SHORT_LABELS[c]:>10}" for c in CELLS)
    head = (
        f"{'round':>5} {'decision':>12} {'tiers':>6} {two} {'served':>7} {'gain over A_r [95% CI]':>26} "
        f"{'retention':>9} {'tokens o/e':>11} {'kept s/k':>9} {'rollouts':>8} {'train s':>7}"
    )
    lines = [head]
    for row, pair in zip(rows, served, strict=True):
        tiers = ",".join(str(t) for t in (row.get("plan") or {}).get("tiers", [])) or "-"
        origin = row.get("selection") or {}
        kept = f"{origin.get('from_search', '-')}/{origin.get('from_samples', '-')}"
        start = f"{row['round']:>5} {row['decision']:>12} {tiers:>6}"
        if pair is None:
            none = " ".join(f"{'-':>10}" for _ in CELLS)
            lines.append(
                f"{start} {none} {'-':>7} {'-':>26} {'-':>9} {'-':>11} {kept:>9} {row['rollouts']:>8} {'-':>7}"
            )
            continue
        e, tokens, kept_share = row["eval"], row["prompt_tokens"], row["retention"]["test"]
        g, (lo, hi) = paired_gain(pair[1], pair[0])
        toks = f"{tokens['original']:.0f}/{tokens['evolved']:.0f}"
        two = " ".join(f"{score(e[c]):>10}" for c in CELLS)
        lines.append(
            f"{start} {two} {_mean(pair[1]):>7.3f} "
            f"{f'{g:+.3f} [{lo:+.3f}, {hi:+.3f}]':>26} {'-' if kept_share is None else f'{kept_share:.2f}':>9} "
            f"{toks:>11} {kept:>9} {row['rollouts']:>8} "
            f"{row['train_seconds'] or 0:>7.0f}"
        )
    return lines


def tier_scores(config: Any, served: list[Pair | None]) -> dict[str, list[float | None]]:
    """Per test tier: the served expert's score before the first round, then after each round (None: no score)."""

    tasks = config.env.make().tasks("test")[: config.gate.test_tasks]
    first = next((p for p in served if p is not None), None)
    series = [first[0] if first else None] + [p[1] if p else None for p in served]
    out: dict[str, list[float | None]] = {}
    for tier in sorted({str(t.tier) for t in tasks}):
        at = [i for i, t in enumerate(tasks) if str(t.tier) == tier]
        out[tier] = [None if s is None else _mean([s[i] for i in at]) for s in series]
    return out


def tier_table(rows: list[dict[str, Any]], scores: dict[str, list[float | None]], counts: dict[str, int]) -> list[str]:
    """The served expert's test score per tier, before round 0 and after each round."""
    lines = [f"{'tier':>4} {'tasks':>5} {'start':>7} " + " ".join(f"{'after ' + str(r['round']):>8}" for r in rows)]
    for tier, series in scores.items():
        cells = " ".join(f"{'-' if s is None else f'{s:.3f}':>8}" for s in series)
        lines.append(f"{tier:>4} {counts[tier]:>5} {cells}")
    return lines


def checks(
    rows: list[dict[str, Any]],
    served: list[Pair | None],
    scores: dict[str, list[float | None]],
    minutes: float | None = None,
) -> list[str]:
    """The acceptance checks, each with its numbers and PASS or FAIL (the wall time only when it was measured)."""
    verdict = {True: "PASS", False: "FAIL"}
    out = []
    for row, pair in zip(rows, served, strict=True):
        if pair is None:
            out.append(f"round {row['round']}: {row['decision']}, nothing trained, no score  rises: FAIL")
            continue
        g, (lo, hi) = paired_gain(pair[1], pair[0])
        ok = row["promoted"] and lo > 0
        out.append(
            f"round {row['round']}: {row['decision']}, served {_mean(pair[0]):.3f} -> {_mean(pair[1]):.3f}, gain "
            f"{g:+.3f} [{lo:+.3f}, {hi:+.3f}]  promoted and interval above 0: {verdict[ok]}"
        )
    for tier, bar in TIER_BARS.items():
        final = scores.get(tier, [None])[-1]
        shown = "-" if final is None else f"{final:.3f}"
        passed = final is not None and final >= bar
        out.append(f"tier {tier} after the last round: {shown}  >= {bar:.2f}: {verdict[passed]}{ceiling(rows, tier)}")
    drops = [
        (a - b, tier)
        for tier, series in scores.items()
        for a, b in zip(series, series[1:], strict=False)
        if a is not None and b is not None
    ]
    if drops:
        drop, tier = max(drops)
        out.append(
            f"largest drop of a tier from a round to the next: tier {tier} {max(drop, 0.0):.3f}  <= "
            f"{MAX_TIER_DROP:.2f}: {verdict[drop <= MAX_TIER_DROP + 1e-9]}"
        )
    if minutes is not None:
        out.append(f"wall time of the run: {minutes:.1f} min  <= {MAX_MINUTES:.0f}: {verdict[minutes <= MAX_MINUTES]}")
    return out


def ceiling(rows: list[dict[str, Any]], tier: str) -> str:
    """The best test score on a tier of any adapter the run trained (original config), promoted or not: what the
    loop reached there at all."""
    scored = [(r["tiers"][tier]["new_original"], r) for r in rows if r["eval"] and tier in (r.get("tiers") or {})]
    if not scored:
        return ""
    best, row = max(scored, key=lambda s: s[0])
    return f" (measured ceiling: {best:.3f}, {row['adapter']} on test, {row['decision']})"


def _rounded(scores: dict[str, float] | None) -> dict[str, float] | None:
    return None if scores is None else {k: round(v, 3) for k, v in scores.items()}


def drivers(rows: list[dict[str, Any]]) -> list[str]:
    """What each round worked on and kept, from its report (the plan and the selection's origin)."""
    out = []
    for row in rows:
        plan, sel = row.get("plan") or {}, row.get("selection") or {}
        out.append(
            f"round {row['round']}: tiers {plan.get('tiers')}, dev of A_r {_rounded(plan.get('dev_scores'))}, frontier "
            f"{plan.get('frontier')}/{plan.get('pool')} pool tasks, drawn {plan.get('drawn_per_tier')}; best config "
            f"by {' -> '.join(sel.get('best_lineage') or ['(the original)'])}; kept {sel.get('items', 0)} "
            f"({sel.get('from_search', 0)} from the search, {sel.get('from_samples', 0)} best-of-k samples; per tier "
            f"{sel.get('per_tier')})"
        )
    return out


def run(config_path: Path) -> tuple[Path, float]:
    """Run every round of the config from a fresh store; returns the run folder and the minutes it took."""
    from autoevolve.config import load_config
    from autoevolve_flows.loop_flow import loop_flow

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
    minutes = (time.perf_counter() - started) / 60
    (run_dir / "code_id").write_text(code_id() + "\n")  # what --table reads back: the code that made the run
    print(f"{config.rounds} rounds in {minutes:.1f} min")
    return run_dir, minutes


def main() -> None:
    from autoevolve.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "loop.yaml")
    parser.add_argument("--table", type=Path, help="print the tables of a finished run folder; run nothing")
    parser.add_argument("--json", type=Path, help="where to write the tables (default: RUN_DIR/loop_efficacy.json)")
    parser.add_argument("--note", default="", help="how the run differs from the shipped config, kept in the JSON")
    args = parser.parse_args()
    run_dir, minutes = (args.table, None) if args.table else run(args.config)
    config = load_config(args.config)
    rows = renamed_cells(json.loads((run_dir / "rounds.json").read_text()))  # older runs: base_*, adapter_* cells
    served = served_rewards(config, rows)
    scores = tier_scores(config, served)
    counts = {tier: int(v["n_tasks"]) for tier, v in next((r["tiers"] for r in rows if r.get("tiers")), {}).items()}
    lines = table(rows, served) + [""] + tier_table(rows, scores, counts) + [""] + drivers(rows)
    verdicts = checks(rows, served, scores, minutes)
    print("\n".join(lines + [""] + verdicts))
    gains = [None if p is None else dict(zip(("gain", "ci"), paired_gain(p[1], p[0]), strict=True)) for p in served]
    made_by = (run_dir / "code_id").read_text().strip() if (run_dir / "code_id").exists() else "unknown"
    if made_by != code_id():
        print(f"the run was made by code {made_by}, and this table is read by code {code_id()}")
    body = {"config": str(args.config), "rounds": rows, "served_gain": gains, "tiers": scores, "checks": verdicts}
    body["run_code"] = made_by  # the code that made the rounds (the JSON's own 'code' read them)
    body["minutes"] = None if minutes is None else round(minutes, 1)
    if args.note:
        body["note"] = args.note
    write_json(args.json or run_dir / "loop_efficacy.json", body)


if __name__ == "__main__":
    main()
