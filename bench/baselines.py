"""Is the loop ahead of what a researcher would do without it? Its served expert beside the cheap baselines, at the
same labels and the same rollout budget, on the same test tasks under the original config.

- loop: the config's rounds, as ``autoevolve run`` runs them (through the library, on the bench's one policy).
- sft_refs: LoRA SFT on the labelled references (the config's labelled set; without ``labels:``, the references the
  loop's configs showed as demos).
- sft_then_rft: expert iteration, what a researcher runs with labels and a scorer: sft_refs's adapter under the
  original config samples the unlabelled train tasks the loop worked on (greedy, then at select.temperature on the
  ones still unsolved, pass after pass) until it has made as many rollouts as the loop; its full-reward wins and the
  references are trained on, from the base.
- icl_distill: no search: the base model under the original config showing the labelled references as demos (the
  config the loop's search starts from) samples the same tasks with the same budget, through the loop's own stage 2
  harvest (its wins shown as demos too when ``select.own_demos``); its wins and the references are trained on.
  loop - icl_distill is what stage 1's search adds.
- rft: the base model under the original config samples the loop's train tasks (no labels), the wins trained on.
- no_refs: the loop without labels (``labels.budget: 0``, or ``evolve.references: false``).
- sft_truth / sft_all_truth (asked for by name): LoRA SFT on the references of the train tasks the loop distilled /
  of every train task (BFCL, where every task has its ground truth).

With ``distill.epoch_grid`` in the config, every trained arm chooses its training length on the same dev tasks by
the same rule as the loop's stage 3 (the last ``distill.dev_tasks`` dev tasks, the adapter scored after each epoch of
the grid); without it, each arm trains for the loop's step count. Each arm has its own store and run folder under
trajectories/baselines/RUN_ID/seedS/ARM; a re-run reuses what is stored only if the code that made it is unchanged
(``_shared.fresh_home``). Per arm: labels seen, rollouts that made its training data, optimiser steps, examples,
the test score with its 95% interval, and the paired difference to the loop. A config of several rounds also
prints the loop round by round: the adapter serving after each round, the rollouts made up to it, and its test
score, per tier too (the other arms are trained once, at the last round's labels and rollouts).

Run: HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python bench/baselines.py [--seeds 0 1 2]
     .venv/bin/python bench/baselines.py --config configs/loop.yaml --arms loop sft_refs sft_then_rft icl_distill
     .venv/bin/python bench/baselines.py --config configs/bfcl.yaml --arms loop sft_truth sft_all_truth --loop-in-place
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
from _shared import code_id, fresh_home, paired_gain, write_json  # noqa: E402

ARMS = ("loop", "sft_refs", "sft_then_rft", "icl_distill", "rft", "no_refs", "sft_truth", "sft_all_truth")
DEFAULT_ARMS = ARMS[:6]
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
    path: str = ""  # the adapter it serves ('' for the base model)
    epochs: float | None = None  # the training length chosen on dev (with distill.epoch_grid)


def arm_config(config: Any, arm: str, in_place: bool = False) -> Any:
    """The run config of an arm: its own store and run folder (the loop's own with ``in_place``); no_refs without
    labels."""
    if in_place and arm == "loop":
        return config
    home = fresh_home(ROOT / "trajectories" / "baselines" / str(config.run_id) / f"seed{config.seed}" / arm)
    update: dict[str, Any] = {"store": home / "store.duckdb", "run_dir": home / "runs"}
    if arm == "no_refs" and config.labels is not None:
        update["labels"] = config.labels.model_copy(update={"budget": 0})
    elif arm == "no_refs":
        update["evolve"] = config.evolve.model_copy(update={"references": False})
    return config.model_copy(update=update)


def test_tasks(config: Any) -> list[Any]:
    """The test tasks every arm is scored on."""
    return config.env.make().tasks("test")[: config.gate.test_tasks]


def references_shown(store: Any, run_id: str, env: Any) -> list[str]:
    """Train task ids whose labelled solution one of the run's configs showed as a demo: stage 1's candidates and
    the configs stage 2 sampled under (a new tier's references as demos)."""
    from autoevolve.harness.hcp import HCPConfig

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


def labelled_ids(config: Any) -> list[str] | None:
    """The config's labelled train task ids (None without a labelled budget)."""
    from autoevolve.stages import labels

    if config.labels is None:
        return None
    return [t.id for t in labels.labelled_tasks(config.env.make(), config.labels.budget, config.seed)]


def run_rounds(config: Any, policy: Any) -> None:
    """The config's rounds through the library on the bench's policy (finished rounds are read back)."""
    from autoevolve import loop
    from autoevolve.stages.report import write_rounds

    reports = []
    for number in range(config.rounds):
        r = loop.open_round(config, policy, number)
        try:
            reports.append(loop.run_round(r))
        finally:
            r.bench.store.close()
    write_rounds(config, reports)


def run_loop(config: Any, arm: str, policy: Any, in_place: bool = False) -> tuple[Arm, dict[str, Any]]:
    """Run (or read back) the loop under an arm's config; its served expert's test rewards and what it spent."""
    from autoevolve.records import TaskPlan
    from autoevolve.store import Store

    cfg = arm_config(config, arm, in_place)
    if not in_place:
        run_rounds(cfg, policy)
    run_id, env = str(cfg.run_id), cfg.env.make()
    with Store(cfg.store, read_only=True) as store:
        trained = [a for a in store.adapters(cfg.expert) if a.run_id == run_id]
        served = next((a for a in trained if a.status == "promoted"), None)  # this run's, in a store shared or not
        results = [json.loads((Path(a.path) / "train_result.json").read_text()) for a in trained]
        planned = [store.stage_result(run_id, r, "plan") for r in range(cfg.rounds)]
        if None in planned:
            sys.exit(f"run {run_id} in {cfg.store} has not planned all its {cfg.rounds} rounds: finish it first")
        plans = [TaskPlan.model_validate(p[0]) for p in planned if p is not None]
        n = max(cfg.evolve.train_tasks, cfg.select.train_tasks)
        kept = [
            t for a in trained if a.selection_id for sel in [store.selection(a.selection_id)] for i in sel.items
            for t in store.trajectories(run_id, hcp_id=i.hcp_id, adapter=i.adapter, task_ids=[i.task_id])
            if t.sample == i.sample
        ]  # fmt: skip
        made = [t.round for s in DATA_STAGES for t in store.trajectories(run_id, stage=s)]
        facts = {
            "shortcuts": f"{shortcuts(kept, env)} of {len(kept)} kept wins skip a call their reference makes",
            "train_tasks": sorted({i for p in plans for i in p.train[:n]}),
            "references": labelled_ids(cfg) if cfg.labels is not None else references_shown(store, run_id, env),
            "rollouts": sum(len(store.trajectories(run_id, stage=s)) for s in DATA_STAGES),
            "steps": sum(r["steps"] for r in results),
            "distilled": [i.task_id for a in trained if a.selection_id for i in store.selection(a.selection_id).items],
        }
    rewards = score(policy, cfg, served.ref, served.path) if served else score(policy, cfg)
    if cfg.rounds > 1:
        facts["rounds"] = []
        for r, serving in enumerate(serving_by_round(trained, cfg.rounds)):
            if serving == served:
                scored = rewards
            else:
                scored = score(policy, cfg, serving.ref, serving.path) if serving else score(policy, cfg)
            facts["rounds"].append({
                "round": r, "serves": serving.ref if serving else "the base model",
                "rollouts": sum(q <= r for q in made), "rewards": scored,
            })  # fmt: skip
    note = f"serves {served.ref if served else 'the base model'}; {len(trained)} adapter(s) trained"
    note += f"; {facts['shortcuts']}"
    arm_row = Arm(
        name=arm,
        labels=len(facts["references"]),
        rollouts=facts["rollouts"],
        steps=facts["steps"],
        examples=sum(r["examples"] for r in results),
        train_s=sum(r["seconds"] for r in results),
        rewards=rewards,
        note=note,
        path=served.path if served else "",
        epochs=results[-1].get("epochs") if results else None,
    )
    return arm_row, facts


def serving_by_round(trained: list[Any], rounds: int) -> list[Any]:
    """The adapter serving after each round: the run's latest promoted one (live, or retired since) up to it."""
    out = []
    for r in range(rounds):
        live = [a for a in trained if a.round <= r and a.status in ("promoted", "retired")]
        out.append(max(live, key=lambda a: a.version) if live else None)
    return out


def round_lines(config: Any, rounds: list[dict[str, Any]]) -> list[str]:
    """The loop round by round: what serves after it, the rollouts made so far, its test score (per tier too)."""
    from autoevolve.stats import bootstrap_ci

    tiers = [t.tier for t in test_tasks(config)]
    kinds = sorted(set(tiers))
    head = f"{'round':>5} {'serves':<20} {'rollouts':>8} {'test [95% CI]':>22} " + " ".join(
        f"{f'tier {k}':>7}" for k in kinds
    )
    lines = ["the loop after each round", head]
    for row in rounds:
        lo, hi = bootstrap_ci(row["rewards"])
        per = [_mean([x for x, t in zip(row["rewards"], tiers, strict=True) if t == k]) for k in kinds]
        test = f"{_mean(row['rewards']):.3f} [{lo:.3f}, {hi:.3f}]"
        lines.append(
            f"{row['round']:>5} {row['serves']:<20} {row['rollouts']:>8} {test:>22} "
            + " ".join(f"{v:>7.3f}" for v in per)
        )
    return lines


def shortcuts(wins: list[Any], env: Any) -> int:
    """How many full-reward wins skip a tool the task's reference calls (a booking made without the search whose
    result it depends on): wins the scorer passes that would teach a shortcut."""
    by_id = {t.id: t for t in env.tasks("train")}

    def called(messages: list[Any]) -> set[str]:
        return {c.name for m in messages for c in m.tool_calls}

    return sum(not called(env.reference(by_id[w.task_id]) or []) <= called(w.messages) for w in wins)


def judge(policy: Any, config: Any, arm: str, store: Any) -> Any:
    """The loop's rule for choosing a training length: the last ``distill.dev_tasks`` dev tasks under the original
    config, the rollouts stored in the arm's store."""
    from autoevolve.harness.workbench import Workbench
    from autoevolve.stages.gate import length_judge

    bench = Workbench(policy, config.env.make(), store, str(config.run_id), seed=config.seed)
    tasks = config.env.make().tasks("dev")[-config.distill.dev_tasks :]
    return length_judge(bench, config.original_hcp(), tasks, arm)


def train(policy: Any, config: Any, arm: str, examples: list[list[dict]], steps: int) -> Any:
    """LoRA SFT from the base with the config's distill settings: the length chosen on dev with
    ``distill.epoch_grid``, else ``steps`` optimiser steps (the loop's). Read back if this arm trained before."""
    from autoevolve.records import TrainResult
    from autoevolve.stages.distill.dataset import native_tools
    from autoevolve.stages.distill.sft import train_sft
    from autoevolve.store import Store

    out = Path(config.run_dir) / "adapter"
    done = out / "train_result.json"
    if done.exists():
        return TrainResult.model_validate_json(done.read_text())
    d, tools = config.distill, native_tools(config.original_hcp())
    if d.epoch_grid:
        with Store(config.store) as store:
            scored = judge(policy, config, arm, store)
            result = train_sft(examples, config.model.name, out, d, tools=tools, judge=scored)
    else:
        per_epoch = math.ceil(len(examples) / (d.batch_size * d.grad_accum))
        epochs = (steps - 0.5) / per_epoch if steps else d.epochs  # the Trainer takes ceil(epochs x per_epoch) steps
        result = train_sft(examples, config.model.name, out, d.model_copy(update={"epochs": epochs}), tools=tools)
    done.write_text(result.model_dump_json(indent=2))
    return result


def score(policy: Any, config: Any, adapter: str = "", path: str | None = None) -> list[float]:
    """Test rewards under the original config of an adapter (loaded from ``path``; '' is the base model), stored
    in the arm's store."""
    from autoevolve.harness.workbench import Workbench
    from autoevolve.store import Store

    if path is not None:
        policy.add_adapter(adapter, path)
    env = config.env.make()
    with Store(config.store) as store:
        bench = Workbench(policy, env, store, str(config.run_id), seed=config.seed)
        rewards = [t.reward for t in bench.rollouts(config.original_hcp(), test_tasks(config), adapter, stage="report")]
    if path is not None:
        policy.remove_adapter(adapter)
    return rewards


def examples_of(config: Any, task_ids: list[str]) -> list[list[dict]]:
    """The references of these train tasks under the original config."""
    env, original = config.env.make(), config.original_hcp()
    tasks = {t.id: t for t in env.tasks("train")}
    return [original.render(tasks[i], env.reference(tasks[i]))[0] for i in task_ids]


def trained_arm(
    policy: Any, cfg: Any, arm: str, examples: list[list[dict]], facts: dict[str, Any], labels: int, rollouts: int,
    note: str,
) -> Arm:  # fmt: skip
    """Train an arm on its examples and score it on test (the base model when it has none)."""
    if not examples:
        return Arm(arm, labels, rollouts, 0, 0, 0.0, score(policy, cfg), f"{note}; nothing to train on: the base")
    result = train(policy, cfg, arm, examples, facts["steps"])
    rewards = score(policy, cfg, arm, result.path)
    return Arm(arm, labels, rollouts, result.steps, result.examples, result.seconds, rewards, note, result.path,
               result.epochs)  # fmt: skip


def sft_refs(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """LoRA SFT on the labelled references under the original config."""
    cfg, ids = arm_config(config, "sft_refs"), facts["references"]
    return trained_arm(policy, cfg, "sft_refs", examples_of(cfg, ids), facts, len(ids), 0, f"{len(ids)} references")


def sft_truth(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """LoRA SFT on the ground-truth solutions of the train tasks the loop distilled."""
    cfg, ids = arm_config(config, "sft_truth"), facts["distilled"]
    note = f"{len(ids)} ground truths of the tasks it distilled"
    return trained_arm(policy, cfg, "sft_truth", examples_of(cfg, ids), facts, len(ids), 0, note)


def sft_all_truth(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """LoRA SFT on the ground truth of every train task."""
    cfg = arm_config(config, "sft_all_truth")
    env = cfg.env.make()
    ids = [t.id for t in env.tasks("train") if env.reference(t)]
    note = f"ground truths of all {len(ids)} train tasks"
    return trained_arm(policy, cfg, "sft_all_truth", examples_of(cfg, ids), facts, len(ids), 0, note)


def harvest(
    policy: Any, cfg: Any, hcp: Any, adapter: str, task_ids: list[str], budget: int, own_demos: bool = False
) -> tuple[list[Any], int, str]:
    """Rollouts of ``hcp`` (+ ``adapter``) on the tasks until ``budget`` are made: a first pass as the config
    decodes, then stage 2's harvest passes (``select.harvest``) at select.temperature on the tasks not yet won,
    showing the wins so far as demos when ``own_demos``. Returns one full-reward, error-free win per task won (the
    first), the rollouts made, and a note."""
    from autoevolve.harness.workbench import Workbench
    from autoevolve.stages.select import harvest as passes
    from autoevolve.store import Store

    by_id = {t.id: t for t in cfg.env.make().tasks("train")}
    tasks = [by_id[i] for i in task_ids][:budget]
    with Store(cfg.store) as store:
        bench = Workbench(policy, cfg.env.make(), store, str(cfg.run_id), seed=cfg.seed)
        made = bench.rollouts(hcp, tasks, adapter, stage="select")
        wins = [t for t in made if t.reward >= 1.0 and not t.error]
        todo = [t for t in tasks if t.id not in {w.task_id for w in wins}]
        configs = {tier: hcp.sampled(cfg.select.temperature) for tier in {t.tier for t in tasks}}
        made += passes(bench, configs, todo, budget - len(made), adapter, 1, 1.0, list(wins) if own_demos else None)
    first = {}
    for t in made:
        if t.reward >= 1.0 and not t.error:
            first.setdefault(t.task_id, t)
    wins = [first[i] for i in task_ids if i in first]
    demos = ", showing its wins as demos" if own_demos else ""
    note = f"{len(made)} rollouts over {len(task_ids)} tasks{demos}: {len(wins)} won"
    return wins, len(made), note


def distilled_arm(
    policy: Any, config: Any, arm: str, facts: dict[str, Any], hcp: Any, adapter: str = "", own_demos: bool = False
) -> Arm:
    """An arm that harvests the loop's train tasks with ``hcp`` (+ ``adapter``) on the loop's rollout budget and
    trains on its wins and the labelled references, from the base."""
    from autoevolve.stages.distill.dataset import render_examples

    cfg, refs = arm_config(config, arm), facts["references"]
    tasks = [i for i in facts["train_tasks"] if i not in set(refs)]
    wins, made, note = harvest(policy, cfg, hcp, adapter, tasks, facts["rollouts"], own_demos)
    by_id = {t.id: t for t in cfg.env.make().tasks("train")}
    examples = render_examples(wins, by_id, cfg.original_hcp()) + examples_of(cfg, refs)
    note += f" ({shortcuts(wins, cfg.env.make())} skip a call their reference makes); + {len(refs)} references"
    return trained_arm(policy, cfg, arm, examples, facts, len(refs), made, note)


def sft_then_rft(policy: Any, config: Any, facts: dict[str, Any], first: Arm) -> Arm:
    """Expert iteration: sft_refs's adapter samples the unlabelled tasks under the original config."""
    if not first.path:
        return Arm("sft_then_rft", first.labels, 0, 0, 0, 0.0, first.rewards, "sft_refs trained nothing: its score")
    policy.add_adapter("sft_refs", first.path)
    try:
        return distilled_arm(policy, config, "sft_then_rft", facts, config.original_hcp(), "sft_refs")
    finally:
        policy.remove_adapter("sft_refs")


def icl_distill(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """No search: the base model under the original config with the labelled references as demos."""
    from autoevolve.stages import labels

    env, e = config.env.make(), config.evolve
    by_id = {t.id: t for t in env.tasks("train")}
    refs = labels.references(env, [by_id[i] for i in facts["references"]])
    if len(refs) < 2:
        return Arm("icl_distill", len(refs), 0, 0, 0, 0.0, score(policy, arm_config(config, "icl_distill")),
                   "fewer than two references: the base")  # fmt: skip
    shown = labels.demos_config(config.original_hcp(), refs, min(e.demo_k), e.demo_styles[0])
    return distilled_arm(policy, config, "icl_distill", facts, shown, own_demos=config.select.own_demos)


def rft(policy: Any, config: Any, facts: dict[str, Any]) -> Arm:
    """The base model under the original config samples the loop's train tasks (no labels); the wins trained on."""
    no_labels = {**facts, "references": []}
    arm = distilled_arm(policy, config, "rft", no_labels, config.original_hcp().sampled(config.select.temperature))
    return arm


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def table(arms: list[Arm]) -> tuple[list[str], list[dict[str, Any]]]:
    """One line per arm, and the same as JSON rows."""
    from autoevolve.stats import bootstrap_ci

    loop = arms[0].rewards
    head = (
        f"{'arm':<13} {'labels':>6} {'rollouts':>8} {'steps':>5} {'epochs':>6} {'examples':>8} {'train s':>7} "
        f"{'test [95% CI]':>22} {'loop - arm [95% CI]':>26}  note"
    )
    lines, rows = [head], []
    for a in arms:
        lo, hi = bootstrap_ci(a.rewards)
        diff, (dlo, dhi) = paired_gain(loop, a.rewards)
        shown = "-" if a.name == "loop" else f"{diff:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"
        epochs = "-" if a.epochs is None else f"{a.epochs:g}"
        lines.append(
            f"{a.name:<13} {a.labels:>6} {a.rollouts:>8} {a.steps:>5} {epochs:>6} {a.examples:>8} {a.train_s:>7.0f} "
            f"{f'{_mean(a.rewards):.3f} [{lo:.3f}, {hi:.3f}]':>22} {shown:>26}  {a.note}"
        )
        row = asdict(a) | {"score": _mean(a.rewards), "ci": [lo, hi], "code": code_id()}
        rows.append(row | ({} if a.name == "loop" else {"loop_minus_arm": diff, "loop_minus_arm_ci": [dlo, dhi]}))
    return lines, rows


def tier_lines(config: Any, arms: list[Arm]) -> list[str]:
    """Each arm's test score per tier (when the test tasks span several)."""
    tiers = [t.tier for t in test_tasks(config)]
    if len(set(tiers)) < 2:
        return []
    head = f"{'arm':<13} " + " ".join(f"{f'tier {k}':>7}" for k in sorted(set(tiers)))
    lines = [head]
    for a in arms:
        per = [_mean([r for r, t in zip(a.rewards, tiers, strict=True) if t == k]) for k in sorted(set(tiers))]
        lines.append(f"{a.name:<13} " + " ".join(f"{v:>7.3f}" for v in per))
    return lines


def checks(arms: list[Arm]) -> list[str]:
    """The loop must be ahead of each baseline that has labels with the paired interval above zero."""
    loop, out = arms[0], []
    for a in arms[1:]:
        diff, (lo, hi) = paired_gain(loop.rewards, a.rewards)
        if a.name in ("no_refs", "rft"):
            out.append(f"loop vs {a.name} (what the labels bring): {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]")
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

    policy = policy or make_policy(config)
    loop, facts = run_loop(config, "loop", policy, in_place)
    arms, done = [loop], {"loop": loop}
    for name in [a for a in names if a != "loop"]:
        print(f"== seed {config.seed}: {name}", flush=True)
        if name == "no_refs":
            arm = run_loop(config, "no_refs", policy)[0]
        elif name == "sft_then_rft":
            first = done.get("sft_refs") or sft_refs(policy, config, facts)
            arm = sft_then_rft(policy, config, facts, first)
        else:
            run = {"sft_refs": sft_refs, "icl_distill": icl_distill, "rft": rft, "sft_truth": sft_truth}
            arm = (run | {"sft_all_truth": sft_all_truth})[name](policy, config, facts)
        arms.append(arm)
        done[name] = arm
    return arms, facts, policy


def across_seeds(runs: list[list[Arm]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Per arm over the seeds: each seed's score, and the loop's paired lead with its hierarchical 95% interval
    (seeds resampled, then tasks within each)."""
    from autoevolve.stats import hierarchical_ci

    lines = [f"{'arm':<13} {'per seed':>30} {'median':>7} {'loop - arm over seeds [95% CI]':>32}"]
    rows = []
    for i, name in enumerate(a.name for a in runs[0]):
        scores = [_mean(arms[i].rewards) for arms in runs]
        diffs = [[x - y for x, y in zip(arms[0].rewards, arms[i].rewards, strict=True)] for arms in runs]
        lead, (lo, hi) = _mean([_mean(d) for d in diffs]), hierarchical_ci(diffs)
        shown = "-" if i == 0 else f"{lead:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        seeds = " ".join(f"{v:.3f}" for v in scores)
        labelled = name not in ("loop", "no_refs", "rft")
        verdict = f"  ahead, interval above 0: {'PASS' if lo > 0 else 'FAIL'}" if labelled else ""
        lines.append(f"{name:<13} {seeds:>30} {sorted(scores)[len(scores) // 2]:>7.3f} {shown:>32}{verdict}")
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
        cfg = config.model_copy(update={"seed": seed})
        arms, facts, policy = run_seed(cfg, args.arms, policy, args.loop_in_place)
        lines, rows = table(arms)
        head = f"{config.run_id}, seed {seed}: {len(arms[0].rewards)} test tasks, original config"
        by_round = round_lines(cfg, facts["rounds"]) + [""] if "rounds" in facts else []
        print("\n".join([head, *lines, "", *tier_lines(cfg, arms), "", *by_round, *checks(arms), ""]))
        runs.append(arms)
        body["seeds"].append({
            "seed": seed, "arms": rows, "references": facts["references"], "checks": checks(arms),
            "rounds": [r | {"score": _mean(r["rewards"])} for r in facts.get("rounds", [])],
        })  # fmt: skip
    if len(runs) > 1:
        lines, rows = across_seeds(runs)
        print("\n".join([f"over {len(runs)} seeds", *lines]))
        body["across_seeds"] = rows
    print(f"all arms in {(time.perf_counter() - started) / 60:.1f} min")
    write_json(args.json, body)


if __name__ == "__main__":
    main()
