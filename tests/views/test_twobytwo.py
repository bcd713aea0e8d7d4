"""The 2x2's names and its one text table, and reports written with the older cell names read under today's."""

from __future__ import annotations

import json

from autoevolve.records import CELLS, GRAMMAR, OLD_CELL_NAMES, Cell, EvalReport
from autoevolve.stages.report import format_rounds, round_row
from autoevolve.views.markdown import round_markdown
from autoevolve.views.twobytwo import format_table, label, rows


def _cell(adapter: str, mean: float, tokens: float) -> Cell:
    return Cell(adapter=adapter, hcp_id="h", mean=mean, n=8, ci=(mean - 0.125, mean + 0.125), prompt_tokens=tokens)


def test_cells_are_named_for_the_adapter_live_at_the_start_and_the_new_one() -> None:
    assert CELLS == ("live_original", "live_evolved", "new_original", "new_evolved")
    assert label("new_original") == "new adapter A_r+1 + original config"
    assert set(OLD_CELL_NAMES.values()) == {*CELLS, GRAMMAR}  # every older name reads as one of today's


def test_the_table_says_when_the_live_adapter_is_the_bare_base_model() -> None:
    cells = {"live_original": _cell("", 0.25, 254), "live_evolved": _cell("", 0.625, 423)}
    cells |= {"new_original": _cell("L1@v1", 0.75, 254), "new_evolved": _cell("L1@v1", 0.5, 423)}
    report = EvalReport(
        run_id="r", round=0, split="test", cells=cells, decision="report", reason="", gain=0.5, gain_ci=(0.25, 0.75)
    )
    assert format_table(report).splitlines() == [
        "test split, 8 tasks, mean reward [95% CI]",
        "                   adapter          original config        evolved config",
        "live adapter A_r   base model  0.250 [0.125, 0.375]  0.625 [0.500, 0.750]",
        "new adapter A_r+1  L1@v1       0.750 [0.625, 0.875]  0.500 [0.375, 0.625]",
        "prompt tokens                                   254                   423",
        "gain +0.500 [+0.250, +0.750], retention -",
    ]
    grid = rows({"live_original": 0.25}, {"live_original": [0.125, 0.375]}, {"live": "L1@v1", "new": "L1@v2"})
    assert grid[1:] == [
        ["live adapter A_r", "L1@v1", "0.250 [0.125, 0.375]", "-"],
        ["new adapter A_r+1", "L1@v2", "-", "-"],
    ]  # a cell the report lacks shows as '-'


def test_a_report_stored_with_the_older_cell_names_loads_and_displays() -> None:
    old = {"base_original": 0.25, "base_evolved": 0.625, "adapter_original": 0.75, "adapter_evolved": 0.5}
    body = {
        "run_id": "r",
        "round": 0,
        "split": "test",
        "cells": {k: _cell("L1@v1" if k.startswith("adapter") else "", v, 254).model_dump() for k, v in old.items()},
        "decision": "report",
        "reason": "",
        "gain": 0.5,
        "tiers": {"1": old | {"n_tasks": 8}},
    }
    report = EvalReport.model_validate_json(json.dumps(body))  # as the store reads a row
    assert list(report.cells) == list(CELLS) and report.cells["new_original"].mean == 0.75
    assert report.tiers == {"1": {"live_original": 0.25, "live_evolved": 0.625, "new_original": 0.75,
                                  "new_evolved": 0.5, "n_tasks": 8}}  # fmt: skip
    assert "new adapter A_r+1  L1@v1       0.750 [0.625, 0.875]" in format_table(report)
    assert EvalReport.model_validate_json(report.model_dump_json()) == report  # written back under today's names


def test_an_older_report_json_reads_in_rounds_json_and_the_markdown() -> None:
    old = {"base_original": 0.25, "base_evolved": 0.625, "adapter_original": 0.75, "adapter_evolved": 0.5}
    report = {
        "run_id": "r",
        "round": 0,
        "live_adapter": None,
        "adapter": "L1@v1",
        "promoted": True,
        "rollouts": 40,
        "selected": 3,
        "hcp": {"original": "a", "evolved": "b"},
        "candidates": [],
        "evolve": {"dev_original": 0.0, "dev_best": 0.5},
        "eval": old | {"n_tasks": 8, "split": "test"},
        "eval_ci": {k: [v - 0.125, v + 0.125] for k, v in old.items()},
        "eval_tiers": {"1": old | {"n_tasks": 8}},
        "gain": {"test": 0.5, "test_ci": [0.25, 0.75], "dev": 0.5, "dev_ci": [0.25, 0.75]},
        "retention": {"test": None, "dev": None},
        "prompt_tokens": {"original": 254.0, "evolved": 423.0},
        "grammar": {"base_grammar": 0.875, "ci": [0.75, 1.0], "retention": 0.8},
        "gate": {"split": "dev", "decision": "promote", "reason": "gain", "cells": old, "n_tasks": 8},
    }
    row = round_row(report)
    assert row["eval"]["new_original"] == 0.75 and row["tiers"]["1"]["live_evolved"] == 0.625
    assert format_rounds([report]).splitlines()[1].split()[:4] == ["0", "L1@v1", "promote", "0.750"]
    lines = round_markdown(report, "").splitlines()
    assert "| live adapter A_r | base model | 0.250 [0.125, 0.375] | 0.625 [0.500, 0.750] |" in lines
    assert "| new adapter A_r+1 | L1@v1 | 0.750 [0.625, 0.875] | 0.500 [0.375, 0.625] |" in lines
    assert any(line.startswith("- the tool-call grammar alone (A_r, original config): test 0.875") for line in lines)
