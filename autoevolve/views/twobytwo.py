"""The round's 2x2 in one place: its cells' names, their labels, and the table as text.

A round compares two adapters under two configs: the adapter live at the round's start, A_r (``live``; the bare
base model in round 0), and the one the round trained, A_{r+1} (``new``), each under the original and the best
evolved config. A cell is named ``<adapter>_<config>``. Every table of it (the terminal, ``autoevolve inspect``,
the Prefect markdown, the notebook, the loop bench) takes its order, labels and numbers from here (the cells' names
are the evaluation record's, ``autoevolve.records.CELLS``). No engine behind
it: report and inspection code import it without the rollout workbench.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autoevolve.records import ADAPTERS, CELLS, CONFIGS, Cell, EvalReport
from autoevolve.views.table import text_table

ADAPTER_LABELS = {"live": "live adapter A_r", "new": "new adapter A_r+1"}
CONFIG_LABELS = {"original": "original config", "evolved": "evolved config"}
SHORT_LABELS = dict(zip(CELLS, ("A_r+orig", "A_r+evol", "A_r+1+orig", "A_r+1+evol"), strict=True))  # narrow columns
BARE = "base model"  # what the live adapter's name shows when A_r is the bare base model


def label(name: str) -> str:
    """A cell's label, e.g. 'live adapter A_r + original config'."""
    adapter, config = name.split("_", 1)
    return f"{ADAPTER_LABELS[adapter]} + {CONFIG_LABELS[config]}"


def score(value: float | None) -> str:
    """A mean reward as the tables print it; '-' for none."""
    return "-" if value is None else f"{value:.3f}"


def interval(ci: Sequence[float], signed: bool = False) -> str:
    """A 95% interval as '[lo, hi]' (``signed``: with signs, for gains)."""
    sign = "+" if signed else ""
    return f"[{ci[0]:{sign}.3f}, {ci[1]:{sign}.3f}]"


def rows(
    means: Mapping[str, float], cis: Mapping[str, Sequence[float]], adapters: Mapping[str, str | None]
) -> list[list[str]]:
    """The 2x2 as strings, header first: per adapter its label, its name (``adapters``: 'live'/'new' -> ref, ''
    for the bare base model), and 'mean [lo, hi]' under each config ('-' for a cell the report lacks)."""
    out = [["", "adapter", *CONFIG_LABELS.values()]]
    for a in ADAPTERS:
        shown = [f"{score(means[n])} {interval(cis[n])}" if n in means else "-" for n in (f"{a}_{c}" for c in CONFIGS)]
        out.append([ADAPTER_LABELS[a], adapters.get(a) or (BARE if a == "live" else "-"), *shown])
    return out


def gain_line(report: EvalReport) -> str:
    """The new adapter's paired gain under the original config, its interval and p-value, and retention."""
    p = "" if report.p_value is None else f", p = {report.p_value:.4f}"
    kept = "-" if report.retention is None else f"{report.retention:.2f}"
    return f"gain {report.gain:+.3f} {interval(report.gain_ci, signed=True)}{p}, retention {kept}"


def format_table(report: EvalReport) -> str:
    """The 2x2 as aligned text: each cell's mean [95% CI], each config's mean prompt tokens, the gain line."""
    c = report.cells
    means = {n: cell.mean for n, cell in c.items()}
    cis = {n: cell.ci for n, cell in c.items()}
    grid = rows(means, cis, {a: _ref(c.get(f"{a}_original")) for a in ADAPTERS})
    tokens = [f"{c[n].prompt_tokens:.0f}" if n in c else "-" for n in (f"live_{cfg}" for cfg in CONFIGS)]
    grid.append(["prompt tokens", "", *tokens])
    n = c["live_original"].n if "live_original" in c else next(iter(c.values())).n if c else 0
    head = f"{report.split} split, {n} tasks, mean reward [95% CI]"
    return "\n".join([head, text_table(grid[0], grid[1:], right=range(2, len(grid[0]))), gain_line(report)])


def _ref(cell: Cell | None) -> str | None:
    """The adapter a cell ran ('' for the bare base model); None without the cell."""
    return None if cell is None else cell.adapter
