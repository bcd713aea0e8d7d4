"""Stage 1 beside GEPA and DSPy over seeds: the same split, model, labelled references and rollout budget for each.

Every system searches around prompts/life.yaml on life tier 1 with one SmolLM2-135M LocalPolicy, which is also the
optimiser model of every system that asks one (reflection, instruction proposals). Per seed the train tasks are
another subset; dev and test stay fixed. The harness is the same for all: a candidate's system prompt and demo pool
go into the HCP config, and each task is shown its 2 nearest demos (request and first call), as ours does. A
candidate whose system prompt drops one of the original's placeholders is refused before any rollout, for every
system. The budget unit is a rollout, each (config, task) a search asks for counted once, as our search counts it
(so a re-run that finds them stored counts the same); once a system has spent its budget, further rollouts it asks
for score 0 without running, so no system overshoots.

Systems (the `inputs` line of each row in the JSON says what it had):
- ours: stage 1 with demos, tool_format, reflective, scaffold and merge; references top up the demo pool. It stops
  on the budget or after 8 children in a row without a better dev score (--patience).
- ours-no-demos: the ablation, reflective, tool_format, scaffold and merge; no references.
- gepa: GEPA's optimize over two components, the system prompt and the demo pool (a YAML list of train task ids),
  seeded with 16 references as demos; references in every feedback record; our placeholder rule in its reflection
  template; evaluation cache and merge on; the same patience as ours (iterations in a row without a better dev
  score).
- dspy-bootstrap: DSPy's BootstrapFewShotWithRandomSearch; references as labelled demos, bootstrapped demos from
  the model's own full-reward rollouts.
- dspy-mipro: DSPy's MIPROv2 (instructions proposed by the same model, demos as above), full dev set per trial.
  DSPy's proposers read their answers through a ChatAdapter whose one-field replies are taken whole when the model
  leaves out DSPy's field markers (it always does); without that MIPROv2 stops at its first proposal.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/optimisers.py [--seeds 0 1 2] [--budget 160]   (make bench-optimisers)
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from _dspy_life import run_dspy
from _gepa_life import run_gepa
from _search_harness import DEMO_POOL, Metered
from _shared import ROOT, code_id, fresh_home, paired_gain, write_json

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Task
from autoevolve.stages.evolve import evolve, make_mutators
from autoevolve.stages.plan import train_tasks
from autoevolve.stages.settings import BudgetSettings, EvolveSettings, ReflectionSettings
from autoevolve.stats import bootstrap_ci, mean
from autoevolve.store import Store

SYSTEMS = ("ours", "ours-no-demos", "gepa", "dspy-bootstrap", "dspy-mipro")
INPUTS = {
    "ours": "references (topping up the demo pool), rewards, feedback; edits every HCP component",
    "ours-no-demos": "rewards, feedback, no references; edits prompt, tool rendering, scaffold, sampling",
    "gepa": "references (seed demo pool and in each feedback record), rewards, feedback, placeholder rule; "
    "edits the system prompt and the demo pool",
    "dspy-bootstrap": "references (labelled demos), rewards as its metric; picks the demo pool",
    "dspy-mipro": "references (labelled demos), rewards as its metric; proposes the instruction, picks demos",
}


@dataclass
class Row:
    """One system's numbers on one seed."""

    seed: int
    system: str
    best_dev: float
    test: float
    test_ci: tuple[float, float]
    rollouts: int
    seconds: float
    best_id: str
    changed: list[str]  # components of the best config that differ from the original
    test_rewards: list[float]
    code: str = "unknown"  # the code id that made the row (_shared.code_id); rows of other code are not reused


def run_ours(
    bench: Workbench, original: HCPConfig, split: dict[str, list[Task]], args, demos: bool
) -> tuple[HCPConfig, int]:
    """Our stage 1 with the quickstart's settings; the budget is what stops it."""
    mutators = ["demos", "tool_format", "reflective", "scaffold", "merge"]
    settings = EvolveSettings(
        train_tasks=len(split["train"]),
        minibatch=args.minibatch,
        dev_tasks=len(split["dev"]),
        candidates=10_000,
        mutators=mutators if demos else mutators[1:],
        references=demos,
        demo_pool=DEMO_POOL,
        demo_k=[2],
        demo_styles=["first_call"],
        max_prompt_tokens=700,
        budget=BudgetSettings(rollouts=args.budget, patience=args.patience),
        reflection=ReflectionSettings(temperature=0.7, max_new_tokens=args.reflect_tokens),
    )
    ops = make_mutators(settings, reflector=bench.policy)
    found = evolve(bench, original, settings, train=split["train"], dev=split["dev"], mutators=ops)
    return found.best, found.budget["rollouts"]


def search(system: str, bench: Workbench, original: HCPConfig, env: LifeEnv, split, args) -> tuple[HCPConfig, int]:
    """One system's best config and the rollouts its search was charged."""
    if system in ("ours", "ours-no-demos"):
        return run_ours(bench, original, split, args, demos=system == "ours")
    meter = Metered(bench, args.budget)
    if system == "gepa":
        best = run_gepa(meter, original, env, split, args)
    else:
        best = run_dspy(meter, original, env, split, args, system)
    return best, meter.spent


def dev_score(store: Store, run_id: str, hcp: HCPConfig, dev: list[Task]) -> float:
    """Mean dev reward of a config from the rollouts its search stored (0 for a task it never ran)."""
    got = {
        t.task_id: t.reward for t in store.trajectories(run_id, hcp_id=hcp.id, adapter="", task_ids=[t.id for t in dev])
    }
    return mean([got.get(t.id, 0.0) for t in dev])


def compare(args: argparse.Namespace) -> list[Row]:
    """Every system on every seed, in one process and one store; test scores under one shared run."""
    env = LifeEnv(tiers=(1,), n_train=256, n_dev=64, n_test=96)  # the quickstart's split sizes
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    dev, test = env.tasks("dev")[: args.dev], env.tasks("test")[: args.test]
    policy = LocalPolicy(batch_size=64)
    before = original.model_dump()
    rows = finished_rows(args)
    for r in rows:
        print(table_line(r), "(from the last run)", flush=True)
    with Store(args.store) as store:
        tester = Workbench(policy, env, store, "test", seed=0, progress=None)
        for seed in args.seeds:
            args.seed_now = seed
            split = {"train": train_tasks(env, args.train, seed), "dev": dev}
            for system in args.systems:
                if any((r.seed, r.system) == (seed, system) for r in rows):
                    continue
                run_id = f"s{seed}-{system}"
                bench = Workbench(policy, env, store, run_id, seed=seed, progress=None)
                started = time.perf_counter()
                best, spent = search(system, bench, original, env, split, args)
                seconds = time.perf_counter() - started
                rewards = [t.reward for t in tester.rollouts(best, test, stage="report")]
                changed = [k for k, v in best.model_dump().items() if v != before[k]]
                rows.append(
                    Row(seed, system, dev_score(store, run_id, best, dev), mean(rewards), bootstrap_ci(rewards), spent,
                        seconds, best.id, changed, rewards, code_id())
                )  # fmt: skip
                print(table_line(rows[-1]), flush=True)
                save(args, rows, complete=False)  # a stopped run keeps every row it finished
    return rows


SAME = ("budget", "patience", "train", "dev", "test", "minibatch", "reflect_tokens")  # flags a finished row must share


def finished_rows(args: argparse.Namespace) -> list[Row]:
    """Rows the JSON at ``args.out`` already holds for these flags, made by today's code (a stopped run goes on
    where it stopped; a row of other code is measured again)."""
    if not args.out.exists():
        return []
    last = json.loads(args.out.read_text())
    if any(last["args"].get(k) != str(getattr(args, k)) for k in SAME):
        return []
    rows = [Row(**{**r, "test_ci": tuple(r["test_ci"])}) for r in last["rows"]]
    return [r for r in rows if r.seed in args.seeds and r.system in args.systems and r.code == code_id()]


def table_line(r: Row) -> str:
    """One row of the per-seed table."""
    ci = f"[{r.test_ci[0]:.2f}, {r.test_ci[1]:.2f}]"
    return (
        f"| {r.seed} | {r.system} | {r.best_dev:.3f} | {r.test:.3f} {ci} | {r.rollouts} | {r.seconds:.0f} "
        f"| {', '.join(r.changed) or '-'} |"
    )


def over_seeds(rows: list[Row], systems: list[str]) -> list[dict[str, Any]]:
    """Per system: mean test over seeds, its spread, and the paired difference to ours over every (seed, task)."""
    out = []
    for system in systems:
        mine = [r for r in rows if r.system == system]
        ours = {r.seed: r.test_rewards for r in rows if r.system == "ours"}
        paired = [r for r in mine if r.seed in ours]
        pairs = [(a, b) for r in paired for a, b in zip(ours[r.seed], r.test_rewards, strict=True)]
        lead = paired_gain([a for a, _ in pairs], [b for _, b in pairs]) if pairs else (None, None)
        tests = [r.test for r in mine]
        out.append(
            {
                "system": system,
                "inputs": INPUTS[system],
                "test_mean": mean(tests),
                "test_min": min(tests),
                "test_max": max(tests),
                "rollouts_mean": mean([float(r.rollouts) for r in mine]),
                "ours_minus_this": lead[0],
                "ours_minus_this_ci": lead[1],
            }
        )
    return out


def main() -> None:
    """Parse the flags, compare, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="Each seed: another train subset.")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--budget", type=int, default=160, help="Rollouts each search may generate.")
    parser.add_argument(
        "--patience",
        type=int,
        default=8,
        help="Ours stops after this many children in a row without a better dev "
        "score (a repeated or broken proposal counts): without it, a search that can only repeat itself never ends.",
    )
    parser.add_argument("--train", type=int, default=24, help="Train tasks (minibatches and demos come from them).")
    parser.add_argument("--dev", type=int, default=16, help="Dev tasks candidates are scored on.")
    parser.add_argument("--test", type=int, default=48, help="Test tasks the best configs are scored on.")
    parser.add_argument("--minibatch", type=int, default=4, help="Train tasks per proposal (ours, GEPA).")
    parser.add_argument("--reflect-tokens", type=int, default=256, help="Max new tokens of an optimiser reply.")

    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/optimisers.json")
    args = parser.parse_args()
    args.store = fresh_home(ROOT / "trajectories" / "optimisers") / "store.duckdb"  # reused while the code is unchanged
    logging.getLogger("dspy").setLevel(logging.WARNING)
    print("| seed | system | best dev | test [95% CI] | rollouts | wall s | changed components |")
    print("| ---: | --- | ---: | --- | ---: | ---: | --- |")
    rows = compare(args)
    summary = over_seeds(rows, args.systems)
    print(f"\nOver seeds {args.seeds} ({args.test} test tasks each; budget {args.budget} rollouts):\n")
    print("| system | test mean (min-max) | rollouts | ours - this [95% CI] | inputs |")
    print("| --- | --- | ---: | --- | --- |")
    for s in summary:
        lead = (
            "-"
            if s["system"] == "ours" or s["ours_minus_this"] is None
            else (f"{s['ours_minus_this']:+.3f} [{s['ours_minus_this_ci'][0]:+.3f}, {s['ours_minus_this_ci'][1]:+.3f}]")
        )
        print(
            f"| {s['system']} | {s['test_mean']:.3f} ({s['test_min']:.3f}-{s['test_max']:.3f}) "
            f"| {s['rollouts_mean']:.0f} | {lead} | {s['inputs']} |"
        )
    save(args, rows, complete=True)


def save(args: argparse.Namespace, rows: list[Row], complete: bool) -> None:
    """The JSON: versions, flags, the summary over seeds and every row; ``complete`` false while seeds remain."""
    versions = {p: version(p) for p in ("gepa", "dspy")}
    flags = {k: str(v) for k, v in vars(args).items() if k != "seed_now"}
    summary = over_seeds(rows, [s for s in args.systems if any(r.system == s for r in rows)])
    report = {"versions": versions, "args": flags, "complete": complete, "summary": summary}
    write_json(args.out, report | {"rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
