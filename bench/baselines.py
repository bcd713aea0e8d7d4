"""Is the loop ahead of what a researcher would do without it? Its served expert beside the cheap baselines, at the
same labels and training budget, on the same test tasks under the original config.

- loop: the config's rounds as ``autoevolve run`` runs them.
- sft_refs: LoRA SFT on the labelled reference solutions the loop's configs showed as demos (the same tasks),
  for as many optimiser steps as the loop's distillation took.
- rft: rejection-sampling fine-tuning without prompt evolution: k samples per train task the loop worked on, under
  the original config with the base model at select.temperature (as many rollouts as the loop's plan, evolve and
  select stages made), the full-reward ones kept, LoRA SFT for the loop's step count.
- no_refs: the loop with ``evolve.references: false``: demos only from the model's own successes (rewards, no labels).
- sft_truth (asked for by name): LoRA SFT on the ground-truth solutions of the train tasks the loop distilled (as
  many as it kept, each task's reference instead of the model's own winning rollout), the loop's step count.

Each arm has its own store and run folder under trajectories/baselines/RUN_ID/seedS/ARM; a re-run reuses what is
stored (every rollout, every trained adapter). Per arm: the labels it saw, the rollouts that made its training data,
optimiser steps, examples, the test score with its 95% interval, and the paired difference to the loop with its
interval; PASS when the loop is ahead of sft_refs and of rft with the paired interval above zero. ``--seeds 0 1 2``
runs every arm per seed (the seed draws the train tasks; the test tasks stay the same), then the loop's lead over
each arm averaged over the seeds task by task, with its interval and the same check.

Run: HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python bench/baselines.py [--seeds 0 1 2]
     (make bench-baselines runs three seeds)
     .venv/bin/python bench/baselines.py --config configs/bfcl.yaml --arms loop sft_truth --loop-in-place
     (the loop arm reads back the finished ``autoevolve run`` of the config instead of running its own)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import paired_gain, write_json  # noqa: E402

ARMS = ("loop", "sft_refs", "rft", "no_refs", "sft_truth")
DEFAULT_ARMS = ARMS[:4]
DATA_STAGES = ("plan", "evolve", "select")  # the rollouts that choose and make training data (not gate, report)


@dataclass
class Arm:
    """What one arm saw, spent and scored."""

    name: str
    labels: int  # labelled reference solutions it saw
    rollouts: int  # rollouts that made its training data
    steps: int  # optimiser steps
    examples: int  # conversations trained on
    train_s: float
    rewards: list[float]  # per test task, served expert + original config
    note: str


def arm_config(config: Any, arm: str, in_place: bool = False) -> Any:
    """The run config of an arm: its own store and run folder (the loop's own with ``in_place``); no_refs without
    labelled references."""
    if in_place and arm == "loop":
        return config
    home = ROOT / "trajectories" / "baselines" / str(config.run_id) / f"seed{config.seed}" / arm
    update: dict[str, Any] = {"store": home / "store.duckdb", "run_dir": home / "runs"}
    if arm == "no_refs":
        update["evolve"] = config.evolve.model_copy(update={"references": False})
    return config.model_copy(update=update)


def test_tasks(config: Any) -> list[Any]:

    return config.env.make().tasks("test")[: config.gate.test_tasks]


def references_shown(store: Any, run_id: str, env: Any) -> list[str]:
    """Train task ids whose labelled solution one of the run's configs showed as a demo: stage 1's candidates and
    the configs stage 2 sampled under (a new tier's references as demos)."""
    from autoevolve.hcp import HCPConfig

    tasks = {t.id: t for t in env.tasks("train")}
    shown: set[str] = set()
    used = {t.hcp_id for s in DATA_STAGES for t in store.trajectories(run_id, stage=s)}
    for hcp_id in {c.hcp_id for c in store.candidates(run_id) if c.status != "crash"} | used:
        try:
            hcp = HCPConfig.model_validate(store.get_hcp(hcp_id))
        except KeyError:  # a child discarded before any rollout was never stored
            continue
        for demo in hcp.demos.items:
            reference = env.reference(tasks[demo.task_id]) if demo.task_id in tasks else None
            if reference is not None and [m.model_dump() for m in reference] == [m.model_dump() for m in demo.messages]:
                shown.add(demo.task_id)
    return sorted(shown)


def run_loop(config: Any, arm: str, policy: Any, in_place: bool = False) -> tuple[Arm, dict[str, Any]]:
    """Run (or read back) the loop under an arm's config; its served expert's test rewards (read back from its
    report stage; scored here when no round reached one) and what it spent."""
    from autoevolve.records import TaskPlan
    from autoevolve.store import Store
    from autoevolve_flows.loop_flow import loop_flow

    cfg = arm_config(config, arm, in_place)
    loop_flow(cfg)
    run_id, env = str(cfg.run_id), cfg.env.make()
    with Store(cfg.store, read_only=True) as store:
        served = store.promoted_adapter(cfg.expert)
        trained = [a for a in store.adapters(cfg.expert) if a.run_id == run_id]
        results = [json.loads((Path(a.path) / "train_result.json").read_text()) for a in trained]
        plans = [TaskPlan.model_validate(store.stage_result(run_id, r, "plan")[0]) for r in range(cfg.rounds)]
        n = max(cfg.evolve.train_tasks, cfg.select.train_tasks)
        facts = {
            "train_tasks": sorted({i for p in plans for i in p.train[:n]}),
            "references": references_shown(store, run_id, env),
            "rollouts": sum(len(store.trajectories(run_id, stage=s)) for s in DATA_STAGES),
            "steps": sum(r["steps"] for r in results),
            "distilled": [i.task_id for a in trained if a.selection_id for i in store.selection(a.selection_id).items],
        }
    rewards = score(policy, cfg, served.ref, served.path) if served else score(policy, cfg)
    note = f"serves {served.ref if served else 'the base model'}; {len(trained)} adapter(s) trained"
    return Arm(
        name=arm,
        labels=len(facts["references"]),
        rollouts=facts["rollouts"],
        steps=facts["steps"],
        examples=sum(r["examples"] for r in results),
        train_s=sum(r["seconds"] for r in results),
        rewards=rewards,
        note=note,
    ), facts


def train_matched(examples: list[list[dict]], config: Any, out: Path, steps: int) -> Any:
    """LoRA SFT from the base with the loop's distill settings, for ``steps`` optimiser steps (read back if done)."""
    from autoevolve.distill import TrainResult
    from autoevolve.distill.dataset import native_tools
    from autoevolve.distill.sft import train_sft

    done = out / "train_result.json"
    if done.exists():
        return TrainResult.model_validate_json(done.read_text())
    d = config.distill
    per_epoch = math.ceil(len(examples) / (d.batch_size * d.grad_accum))
    epochs = (steps - 0.5) / per_epoch if steps else d.epochs  # the Trainer takes ceil(epochs x per_epoch) steps
    settings = d.model_copy(update={"epochs": epochs})
    result = train_sft(examples, config.model.name, out, settings, tools=native_tools(config.original_hcp()))
    done.write_text(result.model_dump_json(indent=2))
    return result


def score(policy: Any, config: Any, adapter: str = "", path: str | None = None) -> list[float]:
    """Test rewards under the original config of an adapter (loaded from ``path``; '' is the base model), stored
    in the arm's store."""
    from autoevolve.store import Store
    from autoevolve.workbench import Workbench

    if path is not None:
        policy.add_adapter(adapter, path)
    env = config.env.make()
    with Store(config.store) as store:
        bench = Workbench(policy, env, store, str(config.run_id), seed=config.seed)
        return [t.reward for t in bench.rollouts(config.original_hcp(), test_tasks(config), adapter, stage="report")]


def sft_refs(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """LoRA SFT on the references the loop showed, under the original config, the loop's step count."""
    return sft_on(policy, config, "sft_refs", facts, facts["references"], "references of the loop's demos")


def sft_truth(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """LoRA SFT on the ground-truth solutions of the train tasks the loop distilled, the loop's step count."""
    return sft_on(policy, config, "sft_truth", facts, facts["distilled"], "ground truths of the tasks it distilled")


def sft_on(policy: Any, config: Any, arm: str, facts: dict[str, Any], task_ids: list[str], what: str) -> Arm:
    """An arm that trains LoRA SFT on the references of the given train tasks, under the original config, for the
    loop's step count (the base model when there are none)."""
    cfg = arm_config(config, arm)
    env, original = cfg.env.make(), cfg.original_hcp()
    tasks = {t.id: t for t in env.tasks("train")}
    examples = [original.render(tasks[i], env.reference(tasks[i]))[0] for i in task_ids]
    if not examples:
        return Arm(arm, 0, 0, 0, 0, 0.0, score(policy, cfg), f"no {what}: the base model")
    result = train_matched(examples, cfg, Path(cfg.run_dir) / "adapter", facts["steps"])
    rewards = score(policy, cfg, arm, result.path)
    note = f"{len(examples)} {what}"
    return Arm(arm, len(examples), 0, result.steps, result.examples, result.seconds, rewards, note)


def rft(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """k samples per train task under the original config (base model), the full-reward ones kept, LoRA SFT."""
    from autoevolve.distill.dataset import render_examples
    from autoevolve.store import Store
    from autoevolve.workbench import Workbench

    cfg = arm_config(config, "rft")
    env, original = cfg.env.make(), cfg.original_hcp()
    by_id = {t.id: t for t in env.tasks("train")}
    tasks = [by_id[i] for i in facts["train_tasks"]]
    k = max(1, facts["rollouts"] // len(tasks))
    sampled = original.sampled(cfg.select.temperature)
    with Store(cfg.store) as store:
        bench = Workbench(policy, env, store, str(cfg.run_id), seed=cfg.seed)
        drawn = bench.rollouts(sampled, tasks, stage="select", samples=k)
    wins, seen = [], set()
    for t in drawn:
        key = json.dumps([m.model_dump(mode="json") for m in t.messages], sort_keys=True)
        if t.reward >= 1.0 and not t.error and key not in seen:
            seen.add(key)
            wins.append(t)
    solved = len({t.task_id for t in wins})
    note = f"{k} samples x {len(tasks)} tasks at T={cfg.select.temperature}: {len(wins)} wins on {solved} tasks"
    if not wins:
        return Arm("rft", 0, len(drawn), 0, 0, 0.0, score(policy, cfg), note + "; nothing to train: the base")
    result = train_matched(render_examples(wins, by_id, original), cfg, Path(cfg.run_dir) / "adapter", facts["steps"])
    rewards = score(policy, cfg, "rft", result.path)
    return Arm("rft", 0, len(drawn), result.steps, result.examples, result.seconds, rewards, note)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def table(arms: list[Arm]) -> tuple[list[str], list[dict[str, Any]]]:
    """One line per arm, and the same as JSON rows."""
    from autoevolve.stats import bootstrap_ci

    loop = arms[0].rewards
    head = (
        f"{'arm':<9} {'labels':>6} {'rollouts':>8} {'steps':>5} {'examples':>8} {'train s':>7} "
        f"{'test [95% CI]':>22} {'loop - arm [95% CI]':>26}  note"
    )
    lines, rows = [head], []
    for a in arms:
        lo, hi = bootstrap_ci(a.rewards)
        diff, (dlo, dhi) = paired_gain(loop, a.rewards)
        shown = "-" if a.name == "loop" else f"{diff:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"
        lines.append(
            f"{a.name:<9} {a.labels:>6} {a.rollouts:>8} {a.steps:>5} {a.examples:>8} {a.train_s:>7.0f} "
            f"{f'{_mean(a.rewards):.3f} [{lo:.3f}, {hi:.3f}]':>22} {shown:>26}  {a.note}"
        )
        row = asdict(a) | {"score": _mean(a.rewards), "ci": [lo, hi]}
        rows.append(row | ({} if a.name == "loop" else {"loop_minus_arm": diff, "loop_minus_arm_ci": [dlo, dhi]}))
    return lines, rows


def checks(arms: list[Arm]) -> list[str]:
    """The loop must be ahead of each cheap baseline with the paired interval above zero."""
    loop, out = arms[0], []
    for a in arms[1:]:
        diff, (lo, hi) = paired_gain(loop.rewards, a.rewards)
        if a.name == "no_refs":
            out.append(f"loop vs no_refs (what the labels bring): {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]")
            continue
        verdict = "PASS" if lo > 0 else "FAIL"
        out.append(
            f"loop {_mean(loop.rewards):.3f} vs {a.name} {_mean(a.rewards):.3f}: {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]  "
            f"ahead with the interval above 0: {verdict}"
        )
    return out


def run_seed(
    config: Any, names: list[str], policy: Any, in_place: bool = False
) -> tuple[list[Arm], dict[str, Any], Any]:
    """Every arm for one seed (the loop first): the arms, the loop's facts, and the policy (loaded once)."""
    from autoevolve.loop import make_policy

    loop, facts = run_loop(config, "loop", policy := policy or make_policy(config), in_place)
    arms = [loop]
    for name in [a for a in names if a != "loop"]:
        print(f"== seed {config.seed}: {name}", flush=True)
        if name == "no_refs":
            arms.append(run_loop(config, "no_refs", policy)[0])
            continue
        arms.append({"sft_refs": sft_refs, "rft": rft, "sft_truth": sft_truth}[name](policy, config, facts))
    return arms, facts, policy


def across_seeds(runs: list[list[Arm]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Per arm over the seeds: each seed's score, and the loop's paired lead averaged over seeds per test task (the
    tasks are the same every seed) with its 95% interval."""
    from autoevolve.stats import bootstrap_ci

    lines = [f"{'arm':<9} {'per seed':>24} {'median':>7} {'loop - arm over seeds [95% CI]':>32}"]
    rows = []
    for i, name in enumerate(a.name for a in runs[0]):
        scores = [_mean(arms[i].rewards) for arms in runs]
        per_task = [
            _mean([arms[0].rewards[t] - arms[i].rewards[t] for arms in runs]) for t in range(len(runs[0][0].rewards))
        ]
        lead, (lo, hi) = _mean(per_task), bootstrap_ci(per_task)
        shown = "-" if i == 0 else f"{lead:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        seeds = " ".join(f"{v:.3f}" for v in scores)
        verdict = "" if name in ("loop", "no_refs") else f"  ahead, interval above 0: {'PASS' if lo > 0 else 'FAIL'}"
        lines.append(f"{name:<9} {seeds:>24} {sorted(scores)[len(scores) // 2]:>7.3f} {shown:>32}{verdict}")
        rows.append({"arm": name, "scores": scores, "loop_minus_arm": lead, "ci": [lo, hi]})
    return lines, rows


def main() -> None:
    from autoevolve.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS), help="loop always runs first")
    parser.add_argument("--seeds", nargs="+", type=int, help="run seeds (train subsets); default: the config's")
    parser.add_argument("--json", type=Path, default=ROOT / "trajectories" / "baselines" / "baselines.json")
    parser.add_argument(
        "--loop-in-place", action="store_true", help="read the loop arm from the config's own store (one seed)"
    )
    args = parser.parse_args()
    config = load_config(args.config)
    started, policy, runs, body = time.perf_counter(), None, [], {"config": str(args.config), "seeds": []}
    for seed in args.seeds or [config.seed]:
        arms, facts, policy = run_seed(config.model_copy(update={"seed": seed}), args.arms, policy, args.loop_in_place)
        lines, rows = table(arms)
        head = f"{config.run_id}, seed {seed}: {len(arms[0].rewards)} test tasks, original config"
        print("\n".join([head, *lines, "", *checks(arms), ""]))
        runs.append(arms)
        body["seeds"].append({"seed": seed, "arms": rows, "references": facts["references"], "checks": checks(arms)})
    if len(runs) > 1:
        lines, rows = across_seeds(runs)
        print("\n".join([f"over {len(runs)} seeds", *lines]))
        body["across_seeds"] = rows
    print(f"all arms in {(time.perf_counter() - started) / 60:.1f} min")
    write_json(args.json, body)


if __name__ == "__main__":
    main()
