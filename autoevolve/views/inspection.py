"""Reading a run as tables: the search's progress, one row per round, the test 2x2, what the evolved config won,
the training curve of each adapter the run trained.

Each function takes an open ``Store`` and returns a pandas DataFrame (or text), for the notebook in
``notebooks/inspect_trajectories.ipynb`` and for ``autoevolve inspect RUN``. Open the store with
``Store.snapshot(path)``: a private copy, so a round writing the file at the same time is never blocked.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pandas as pd

from autoevolve.records import ADAPTERS, CELLS, CONFIGS, Candidate, EvalReport, Message, Selection, Trajectory
from autoevolve.stages.distill.fit import TRAINING_LOG
from autoevolve.stats import mean
from autoevolve.store import Store
from autoevolve.views.lineage import LineageError, config_diff
from autoevolve.views.table import text_table
from autoevolve.views.twobytwo import BARE, format_table

NAN = math.nan


def _known(store: Store, run_id: str) -> None:
    """Raise LineageError naming the store's runs when ``run_id`` is not one of them."""
    runs = store.runs()
    if run_id not in runs:
        raise LineageError(f"no run {run_id!r} in {store.path} (runs: {', '.join(runs) or 'none'})")


def _minibatch(scores: dict[str, float]) -> float:
    """Mean of a minibatch's per-task scores; NaN when there is none (the seed, a crash)."""
    return mean(list(scores.values())) if scores else NAN


def search_progress(store: Store, run_id: str) -> pd.DataFrame:
    """One row per stage-1 candidate in ledger order: minibatch scores, dev mean if kept, best dev so far."""
    rows: list[dict] = []
    attempts: dict[int, int] = defaultdict(int)
    best: dict[int, float] = {}
    for step, c in enumerate(store.candidates(run_id)):
        dev = c.mean_reward if c.status == "keep" else NAN
        if c.status == "keep":
            best[c.round] = max(best.get(c.round, -math.inf), dev)
        rows.append(
            {
                "step": step,
                "round": c.round,
                "attempt": attempts[c.round],  # 0 is the round's seed (the original config)
                "hcp_id": c.hcp_id,
                "mutator": c.mutator,
                "status": c.status,
                "minibatch": _minibatch(c.minibatch),
                "parent_minibatch": _minibatch(c.parent_minibatch),
                "dev": dev,
                "best_dev": best.get(c.round, NAN),  # each round searches afresh around its own adapter
                "rollouts": c.rollouts_used,
            }
        )
        attempts[c.round] += 1
    columns = ["step", "round", "attempt", "hcp_id", "mutator", "status", "minibatch", "parent_minibatch", "dev"]
    return pd.DataFrame(rows, columns=[*columns, "best_dev", "rollouts"])


def _round_selection(store: Store, run_id: str, round: int) -> Selection | None:
    """The round's selection (the latest, should the round have been re-run with other settings)."""
    found = [s for s in store.selections(run_id) if s.round == round]
    return found[-1] if found else None


def _report(store: Store, run_id: str, round: int, split: str) -> EvalReport | None:
    """The stored evaluation of one round and split, if any."""
    return next((r for r in store.evaluations(run_id) if r.round == round and r.split == split), None)


def evaluation(store: Store, run_id: str, round: int, split: str = "test") -> EvalReport:
    """The stored evaluation of one round and split (``views.twobytwo.format_table`` prints it as the 2x2)."""
    report = _report(store, run_id, round, split)
    if report is None:
        raise LineageError(f"no {split} evaluation for run {run_id!r} round {round} in {store.path}")
    return report


def round_summary(store: Store, run_id: str) -> pd.DataFrame:
    """Per round: new rollouts, candidates tried and kept, dev scores, items selected, gate decision, test cells."""
    ledger: dict[int, list[Candidate]] = defaultdict(list)
    for c in store.candidates(run_id):
        ledger[c.round].append(c)
    selections = {s.round: s for s in store.selections(run_id)}  # the latest per round wins
    reports = {(r.round, r.split): r for r in store.evaluations(run_id)}
    rounds = sorted(set(ledger) | set(selections) | {r for r, _ in reports})
    rows = []
    for r in rounds:
        cands, dev, test = ledger[r], reports.get((r, "dev")), reports.get((r, "test"))
        children = [c for c in cands if c.mutator != "seed"]
        seed = next((c.mean_reward for c in cands if c.mutator == "seed"), NAN)
        kept = [c.mean_reward for c in cands if c.status == "keep"]
        row = {
            "round": r,
            # A rollout belongs to the round that first made it; later rounds reuse it without a new row.
            "rollouts": store.count_trajectories(run_id, r),
            "candidates": len(children),
            "kept": sum(c.status == "keep" for c in children),
            "dev_original": seed,
            "dev_best": max(kept) if kept else NAN,
            "selected": len(selections[r].items) if r in selections else 0,
            "decision": dev.decision if dev else "-",
            "dev_gain": dev.gain if dev else NAN,
        }
        row |= {name: test.cells[name].mean if test else NAN for name in CELLS}
        row["test_gain"] = test.gain if test else NAN
        row["retention"] = test.retention if test and test.retention is not None else NAN
        rows.append(row)
    head = ["round", "rollouts", "candidates", "kept", "dev_original", "dev_best", "selected", "decision", "dev_gain"]
    return pd.DataFrame(rows, columns=[*head, *CELLS, "test_gain", "retention"])


def two_by_two(store: Store, run_id: str, round: int, split: str = "test") -> pd.DataFrame:
    """The round's 2x2 as numbers: rows live (A_r) / new (A_r+1), columns (original/evolved config) x (mean, ci_low,
    ci_high, n, prompt_tokens).

    ``attrs`` holds the adapters' names, the gain with its interval, retention and the decision.
    """
    report = evaluation(store, run_id, round, split)
    stats = ["mean", "ci_low", "ci_high", "n", "prompt_tokens"]
    data: dict[tuple[str, str], list[float | int]] = {}
    for config in CONFIGS:
        cells = [report.cells[f"{model}_{config}"] for model in ADAPTERS]
        for stat in stats:
            data[(config, stat)] = [
                c.ci[0] if stat == "ci_low" else c.ci[1] if stat == "ci_high" else getattr(c, stat) for c in cells
            ]
    frame = pd.DataFrame(data, index=pd.Index(list(ADAPTERS), name="model"))
    frame.columns = pd.MultiIndex.from_tuples(frame.columns, names=["config", "stat"])
    frame.attrs = {
        "split": split,
        "adapters": {m: report.cells[f"{m}_original"].adapter or BARE for m in ADAPTERS},
        "gain": report.gain,
        "gain_ci": report.gain_ci,
        "p_value": report.p_value,
        "retention": report.retention,
        "decision": report.decision,
        "reason": report.reason,
    }
    return frame


def reply(messages: list[Message]) -> str:
    """What the assistant did: each tool call as ``name(arguments)``, in order, then its last text."""
    said = [m for m in messages if m.role == "assistant"]
    calls = [f"{c.name}({c.function.get('arguments', '')})" for m in said for c in m.tool_calls]
    text = next((m.content.strip() for m in reversed(said) if m.content.strip()), "")
    return " -> ".join([*calls, text] if text else calls)


def wins(store: Store, run_id: str, round: int) -> pd.DataFrame:
    """Per item the round selected: the evolved config's reply next to the original's on the same task."""
    selection = _round_selection(store, run_id, round)
    items = selection.items if selection else []
    wanted: dict[str, set[str]] = defaultdict(set)  # hcp_id -> task ids: one query per config, not per item
    for i in items:
        wanted[i.hcp_id].add(i.task_id)
        wanted[i.baseline_hcp_id].add(i.task_id)
    adapter = selection.adapter if selection else ""
    found: dict[tuple[str, str, int], Trajectory] = {}
    for hcp_id, tasks in wanted.items():
        for t in store.trajectories(run_id, hcp_id=hcp_id, adapter=adapter, task_ids=sorted(tasks)):
            found[(t.hcp_id, t.task_id, t.sample)] = t
    rows = []
    for i in items:
        won = found.get((i.hcp_id, i.task_id, i.sample))
        lost = found.get((i.baseline_hcp_id, i.task_id, i.baseline_sample))
        rows.append(
            {
                "task_id": i.task_id,
                "evolved_hcp_id": i.hcp_id,
                "evolved_reply": reply(won.messages) if won else "",
                "evolved_reward": i.reward,
                "original_reply": reply(lost.messages) if lost else "",
                "original_reward": i.baseline_reward,
            }
        )
    columns = ["task_id", "evolved_hcp_id", "evolved_reply", "evolved_reward", "original_reply", "original_reward"]
    return pd.DataFrame(rows, columns=columns)


CURVE_COLUMNS = ["round", "adapter", "step", "epoch", "loss", "learning_rate", "grad_norm", "reward"]


def training_curves(store: Store, run_id: str) -> pd.DataFrame:
    """Per adapter the run trained, one row per logged training step, read from ``training_log.jsonl`` in its
    folder (reward: the RL trainers' mean reward of the step's replies); a folder without the log is skipped."""
    _known(store, run_id)
    rows = []
    for a in store.adapters():
        log = Path(a.path) / TRAINING_LOG
        if a.run_id != run_id or not log.is_file():
            continue
        for line in log.read_text().splitlines():
            row = json.loads(line)
            if "loss" in row or "reward" in row:  # a step's row, not the closing summary
                rows.append({"round": a.round, "adapter": a.ref} | {k: row.get(k, NAN) for k in CURVE_COLUMNS[2:]})
    return pd.DataFrame(rows, columns=CURVE_COLUMNS)


def best_diff(store: Store, run_id: str, round: int) -> str:
    """Per-component diff of the round's original config against the evolved config it selected with (or its best)."""
    selection = _round_selection(store, run_id, round)
    if selection is not None:
        return config_diff(store, run_id, selection.baseline_hcp_id, selection.evolved_hcp_id)
    cands = store.candidates(run_id, round)
    if not cands:
        raise LineageError(f"no candidates for run {run_id!r} round {round} in {store.path}")
    seed = next(c.hcp_id for c in cands if c.mutator == "seed")
    best = max((c for c in cands if c.status == "keep"), key=lambda c: c.mean_reward).hcp_id
    return config_diff(store, run_id, seed, best)


def _text(frame: pd.DataFrame) -> str:
    """A frame as an aligned text table (``views.table``): floats to three places, NaN as '-', numbers right."""

    def shown(value: object) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.3f}"
        return str(value)

    numeric = {i for i, kind in enumerate(frame.dtypes) if kind.kind in "iuf"}
    rows = [[shown(v) for v in row] for row in frame.itertuples(index=False)]
    return text_table([str(c) for c in frame.columns], rows, right=numeric)


def format_inspect(store: Store, run_id: str) -> str:
    """A run at a glance: counts, the rounds table, and the last round's test 2x2 with intervals and prompt tokens."""
    _known(store, run_id)
    progress, rounds = search_progress(store, run_id), round_summary(store, run_id)
    status = progress["status"].value_counts()
    lines = [
        f"run {run_id}: {len(rounds)} round(s), {store.count_trajectories(run_id)} rollouts, "
        f"{len(progress)} candidates ({status.get('keep', 0)} keep, {status.get('discard', 0)} discard, "
        f"{status.get('crash', 0)} crash), {int(rounds['selected'].sum()) if len(rounds) else 0} selected items",
    ]
    if len(rounds):
        lines += ["", _text(rounds.drop(columns=["retention"]))]
    tested = [r for r in rounds["round"] if _report(store, run_id, int(r), "test")] if len(rounds) else []
    if not tested:
        return "\n".join([*lines, "", "no test evaluation yet"])
    return "\n".join([*lines, "", f"round {tested[-1]}, {format_table(evaluation(store, run_id, int(tested[-1])))}"])


def served_rollouts(store: Store, run_id: str) -> list[Trajectory]:
    """The last tested round's test rollouts of the expert it served (the new adapter if promoted, else the live one)
    under the original config, in task order."""
    tested = [e for e in store.evaluations(run_id) if e.split == "test"]
    if not tested:
        return []
    cells = tested[-1].cells
    promoted = any(a.status == "promoted" and a.ref == cells["new_original"].adapter for a in store.adapters())
    cell = cells["new_original" if promoted else "live_original"]
    found = store.trajectories(run_id, hcp_id=cell.hcp_id, adapter=cell.adapter, split="test")
    return [t for t in found if t.sample == 0]
