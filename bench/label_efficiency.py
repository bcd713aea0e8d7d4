"""Label efficiency: the loop beside the cheap recipes at 4, 8, 16 and 48 labelled tasks, over seeds.

Per seed and budget N (the seed draws the N labelled tasks and the unlabelled pool; the test tasks stay), the run
config (default: the quickstart) runs with ``labels.budget: N``, ``seed`` and the bench's own stage settings
(``CELL_SETTINGS``: the harvest and training-length grid every cell has used, larger than the quickstart's since its
demo was cut to fit 10 minutes), and beside it ``bench/baselines.py``'s arms on the same labels, rollout budget and
test tasks: sft_refs, sft_then_rft (expert iteration) and icl_distill (no search). Per budget and arm: the mean
test score over seeds with its hierarchical 95% interval (seeds resampled, then test tasks within each); the loop's
paired lead over sft_refs, over icl_distill and over the better of sft_refs and sft_then_rft, with its interval and
the paired sign-flip p (per test task, averaged over seeds), Holm-adjusted across the budgets. The checks: at N = 8
and 16 the loop leads the better baseline by >= +0.05 with the interval's lower end above 0, and sft_refs by >= +0.15;
at N = 48 its lower end >= -0.03 against the better baseline; at every budget the lower end of loop - icl_distill
>= -0.03 (the loop is never worse than the simpler recipe it contains).

Each (seed, budget) cell is kept in trajectories/label_efficiency/cells.json with the code id that made it and is
reused only while the code is unchanged; the table, the plot (PNG) and the JSON are written from the cells.

Run: HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python bench/label_efficiency.py [--seeds 0 1 2 3 4]
     (--budgets 4 8 16 48; --report prints and writes from the stored cells without running)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import code_id, commit, write_json  # noqa: E402
from baselines import run_seed  # noqa: E402

ARMS = ("loop", "sft_refs", "sft_then_rft", "icl_distill")
BUDGETS = (4, 8, 16, 48)
CELL_SETTINGS = {  # stage 2 harvests 160 unlabelled train tasks; stage 3 (and every arm) picks epochs from this grid
    "select": {"train_tasks": 160, "rollouts": 320},
    "distill": {"epoch_grid": [1, 2, 4, 8, 16]},
}
HOME = ROOT / "trajectories" / "label_efficiency"
CELLS = HOME / "cells.json"
RESULTS = ROOT / "bench" / "results"


def cell_config(config: Any, seed: int, budget: int) -> Any:
    """The run config of one cell: its labelled budget, seed, ``CELL_SETTINGS`` and run id (its stores lie under
    the baselines')."""
    update: dict[str, Any] = {"seed": seed, "run_id": f"{config.run_id}-n{budget}"}
    update["labels"] = config.labels.model_copy(update={"budget": budget})
    for stage, settings in CELL_SETTINGS.items():
        update[stage] = getattr(config, stage).model_copy(update=settings)
    return config.model_copy(update=update)


def load_cells() -> dict[str, Any]:
    """The stored cells made by today's code (others are dropped: they are recomputed)."""
    if not CELLS.exists():
        return {}
    now = code_id()
    return {k: v for k, v in json.loads(CELLS.read_text()).items() if v["code"] == now}


def run_cell(config: Any, seed: int, budget: int, policy: Any) -> tuple[dict[str, Any], Any]:
    """Every arm of one (seed, budget) cell; the cell as stored, and the policy."""
    started = time.perf_counter()
    arms, facts, policy = run_seed(cell_config(config, seed, budget), list(ARMS), policy)
    cell = {
        "seed": seed,
        "labels": budget,
        "settings": CELL_SETTINGS,
        "code": code_id(),
        "commit": commit(),
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "references": facts["references"],
        "arms": {a.name: asdict(a) for a in arms},
    }
    return cell, policy


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One budget over its seeds: each arm's score and interval, the loop's paired leads."""
    from autoevolve.stats import hierarchical_ci, sign_flip_p

    rewards = {a: [c["arms"][a]["rewards"] for c in cells] for a in ARMS}
    arms = {
        a: {"score": _mean([_mean(r) for r in rows]), "ci": list(hierarchical_ci(rows)),
            "per_seed": [round(_mean(r), 4) for r in rows]}
        for a, rows in rewards.items()
    }  # fmt: skip
    best = max(("sft_refs", "sft_then_rft"), key=lambda a: arms[a]["score"])

    def lead(other: str) -> tuple[float, list[float], float]:
        pairs = zip(rewards["loop"], rewards[other], strict=True)
        diffs = [[x - y for x, y in zip(a, b, strict=True)] for a, b in pairs]
        per_task = [_mean([d[t] for d in diffs]) for t in range(len(diffs[0]))]  # the test tasks are the same
        return _mean([_mean(d) for d in diffs]), list(hierarchical_ci(diffs)), sign_flip_p(per_task)

    out = {"labels": cells[0]["labels"], "seeds": [c["seed"] for c in cells], "arms": arms, "best_baseline": best}
    for name, other in (("best", best), ("sft_refs", "sft_refs"), ("icl_distill", "icl_distill")):
        diff, ci, p = lead(other)
        out |= {f"loop_minus_{name}": diff, f"loop_minus_{name}_ci": ci, f"loop_minus_{name}_p": p}
    return out


def checks(budgets: list[dict[str, Any]]) -> list[str]:
    """The mission's checks, each with its numbers and PASS or FAIL."""
    lines = []
    for b in budgets:
        n, ci = b["labels"], b["loop_minus_best_ci"]
        head = f"N={n}: loop - {b['best_baseline']} {b['loop_minus_best']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"
        if n in (8, 16):
            ok = b["loop_minus_best"] >= 0.05 and ci[0] > 0
            lines.append(f"{head} (>= +0.05, lower end > 0): {'PASS' if ok else 'FAIL'}")
            diff = b["loop_minus_sft_refs"]
            lines.append(f"N={n}: loop - sft_refs {diff:+.3f} (>= +0.15): {'PASS' if diff >= 0.15 else 'FAIL'}")
        elif n == 48:
            lines.append(f"{head} (lower end >= -0.03): {'PASS' if ci[0] >= -0.03 else 'FAIL'}")
        else:
            lines.append(f"{head} (printed)")
        ci = b["loop_minus_icl_distill_ci"]
        verdict = "PASS" if ci[0] >= -0.03 else "FAIL"
        diff = b["loop_minus_icl_distill"]
        shown = f"{diff:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"
        lines.append(f"N={n}: loop - icl_distill {shown} (lower end >= -0.03): {verdict}")
    return lines


def table(budgets: list[dict[str, Any]]) -> list[str]:
    """One row per budget: each arm's score [interval], the loop's leads with Holm-adjusted p."""
    head = f"{'N':>3} {'seeds':>5} " + " ".join(f"{a:>21}" for a in ARMS) + f" {'loop - best [95% CI], p (Holm)':>40}"
    lines = [head]
    for b in budgets:
        cells = " ".join(f"{_score(v):>21}" for v in b["arms"].values())
        ci = b["loop_minus_best_ci"]
        lead = f"{b['loop_minus_best']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}], {b['loop_minus_best_p_holm']:.4f}"
        lines.append(f"{b['labels']:>3} {len(b['seeds']):>5} {cells} {lead:>40}")
    return lines


def _score(arm: dict[str, Any]) -> str:
    """'0.812 [0.74, 0.88]'."""
    return f"{arm['score']:.3f} [{arm['ci'][0]:.2f}, {arm['ci'][1]:.2f}]"


def plot(budgets: list[dict[str, Any]], path: Path, title: str) -> None:
    """Test score against labelled tasks for every arm, with intervals (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    xs = [b["labels"] for b in budgets]
    for i, arm in enumerate(ARMS):
        ys = [b["arms"][arm]["score"] for b in budgets]
        lo = [y - b["arms"][arm]["ci"][0] for y, b in zip(ys, budgets, strict=True)]
        hi = [b["arms"][arm]["ci"][1] - y for y, b in zip(ys, budgets, strict=True)]
        shifted = [x * (1 + 0.03 * (i - 1.5)) for x in xs]  # side by side at each budget
        ax.errorbar(shifted, ys, yerr=[lo, hi], marker="o", capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    seeds = [len(b["seeds"]) for b in budgets]
    ax.set_xticks(xs, [f"{x}\n({n} seed{'' if n == 1 else 's'})" for x, n in zip(xs, seeds, strict=True)])
    ax.set_xlabel("labelled train tasks (N)")
    ax.set_ylabel("test score, original config")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{title}: mean over seeds, 95% hierarchical CI (seeds, then tasks)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    from autoevolve.config import load_config
    from autoevolve.stats import holm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    parser.add_argument("--report", action="store_true", help="only print and write from the stored cells")
    parser.add_argument("--json", type=Path, default=RESULTS / "label_efficiency.json")
    args = parser.parse_args()
    config = load_config(args.config)
    if config.labels is None:
        sys.exit(f"{args.config}: a labelled budget is needed (labels: {{budget: N}})")
    cells, policy, started = load_cells(), None, time.perf_counter()
    for seed in args.seeds:
        for budget in args.budgets:
            key = f"{config.run_id}/{seed}/{budget}"  # a cell of this config
            if key in cells or args.report:
                continue
            print(f"== seed {seed}, {budget} labelled tasks", flush=True)
            cells[key], policy = run_cell(config, seed, budget, policy)
            HOME.mkdir(parents=True, exist_ok=True)
            CELLS.write_text(json.dumps(cells, indent=1) + "\n")  # a kill loses at most the cell in progress
    wanted = [
        c for k, c in cells.items()
        if k.startswith(f"{config.run_id}/") and c["seed"] in args.seeds and c["labels"] in args.budgets
    ]  # fmt: skip
    if not wanted:
        sys.exit(f"no cell made by today's code (code id {code_id()}) in {CELLS}: run without --report")
    by_budget = sorted({c["labels"] for c in wanted})
    budgets = [summary(sorted((c for c in wanted if c["labels"] == n), key=lambda c: c["seed"])) for n in by_budget]
    for b, p in zip(budgets, holm([b["loop_minus_best_p"] for b in budgets]), strict=True):
        b["loop_minus_best_p_holm"] = p
    lines = table(budgets)
    print("\n".join([f"{config.run_id}: test score under the original config [hierarchical 95% CI]", *lines, "",
                     *checks(budgets)]))  # fmt: skip
    print(f"{(time.perf_counter() - started) / 60:.1f} min")
    title = f"{config.env.name} tiers {', '.join(map(str, config.env.tiers))}, {config.model.name}"
    plot(budgets, args.json.with_suffix(".png"), title)
    write_json(args.json, {"config": str(args.config), "budgets": budgets, "checks": checks(budgets), "cells": wanted})


if __name__ == "__main__":
    main()
