"""Reading a run back: its stage-1 ledger, the diff between two of its configs, and its selections."""

from __future__ import annotations

from autoevolve.harness.hcp import HCPConfig, diff
from autoevolve.records import Candidate, Selection
from autoevolve.stats import mean
from autoevolve.store import Store
from autoevolve.views.table import text_table


class LineageError(ValueError):
    """A run or config reference that the store cannot answer; the message says what exists."""


def run_candidates(store: Store, run_id: str, round: int | None = None) -> list[Candidate]:
    """The ledger of a run, or LineageError naming the runs the store has."""
    rows = store.candidates(run_id, round)
    if not rows:
        known = ", ".join(store.runs()) or "none"
        where = f" round {round}" if round is not None else ""
        raise LineageError(f"no candidates for run {run_id!r}{where} in {store.path} (runs: {known})")
    return rows


def format_selections(selections: list[Selection], items: bool = False) -> str:
    """One line a selection (kept items, tasks, preference pairs, mean gain), or one line a kept item."""
    if items:
        head = ["selection", "task_id", "hcp_id", "sample", "reward", "baseline_hcp_id", "baseline_sample", "baseline"]
        rows = [
            [s.id, i.task_id, i.hcp_id, str(i.sample), f"{i.reward:.3f}", i.baseline_hcp_id, str(i.baseline_sample),
             f"{i.baseline_reward:.3f}"]
            for s in selections
            for i in s.items
        ]  # fmt: skip
        return text_table(head, rows)
    head = ["round", "selection", "baseline", "evolved", "adapter", "items", "tasks", "pairs", "mean_gain"]
    rows = []
    for s in selections:
        pairs = sum(i.pairs_with_baseline for i in s.items)
        gain = sum(i.reward - i.baseline_reward for i in s.items) / len(s.items) if s.items else 0.0
        tasks = len({i.task_id for i in s.items})
        rows.append(
            [str(s.round), s.id, s.baseline_hcp_id, s.evolved_hcp_id, s.adapter or "-", str(len(s.items)), str(tasks),
             str(pairs), f"{gain:.3f}"]
        )  # fmt: skip
    return text_table(head, rows)


def run_selections(store: Store, run_id: str) -> list[Selection]:
    """The selections of a run, or LineageError naming the runs the store has."""
    found = store.selections(run_id)
    if not found:
        raise LineageError(
            f"no selections for run {run_id!r} in {store.path} (runs: {', '.join(store.runs()) or 'none'})"
        )
    return found


def format_candidates(rows: list[Candidate]) -> str:
    """One line a candidate: lineage, what changed, status, dev mean, minibatch mean (child/parent), budget, note."""
    head = ["round", "hcp_id", "parents", "mutator", "components", "status", "dev", "minibatch", "rollouts", "note"]
    lines = []
    for c in rows:
        child, parent = mean(list(c.minibatch.values())), mean(list(c.parent_minibatch.values()))
        lines.append(
            [
                str(c.round),
                c.hcp_id,
                ",".join(c.parents) or "-",
                c.mutator,
                ",".join(c.components) or "-",
                c.status,
                f"{c.mean_reward:.3f}" if c.status == "keep" else "-",
                f"{child:.3f}/{parent:.3f}" if c.minibatch else "-",
                str(c.rollouts_used),
                c.note,
            ]
        )
    return text_table(head, lines)


def resolve(rows: list[Candidate], ref: str) -> str:
    """An HCP id from a reference: 'seed', 'best', a full id or a unique prefix of one of the run's configs."""
    scored = [c for c in rows if not c.hcp_id.startswith("crash-")]
    if ref == "seed":
        return next(c.hcp_id for c in rows if c.mutator == "seed")
    if ref == "best":
        return max((c for c in scored if c.status == "keep"), key=lambda c: c.mean_reward).hcp_id
    hits = sorted({c.hcp_id for c in scored if c.hcp_id.startswith(ref)})
    if len(hits) != 1:
        what = "no config" if not hits else f"{len(hits)} configs ({', '.join(hits)})"
        raise LineageError(f"{ref!r} matches {what} of the run; use 'seed', 'best' or an id from `candidates`")
    return hits[0]


def config_diff(store: Store, run_id: str, a: str, b: str) -> str:
    """The per-component diff between two of a run's configs, by reference."""
    rows = run_candidates(store, run_id)
    first, second = (HCPConfig.model_validate(store.get_hcp(resolve(rows, ref))) for ref in (a, b))
    return diff(first, second) or f"{first.id} and {second.id} are the same config"
