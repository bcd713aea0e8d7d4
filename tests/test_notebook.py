"""notebooks/inspect_trajectories.ipynb top to bottom on a two-round store: every cell runs, its three plots land."""

from __future__ import annotations

from pathlib import Path

import nbformat

from autoevolve.store import Store
from tests.notebook import errors, run_notebook
from tests.test_export import ADAPTER, RUN, build_run
from tests.views.test_inspect import add_trained_adapters

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_trajectories.ipynb"


def _text(cell: nbformat.NotebookNode) -> str:
    """Everything a cell printed or displayed as text."""
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_notebook_runs_and_saves_its_plots(tmp_path: Path) -> None:
    build_run(tmp_path / "s.duckdb")
    with Store(tmp_path / "s.duckdb") as store:
        add_trained_adapters(store, tmp_path / "adapters")
    run_dir = tmp_path / "runs" / RUN
    env = {"AUTOEVOLVE_STORE": str(tmp_path / "s.duckdb"), "AUTOEVOLVE_RUN": RUN, "AUTOEVOLVE_RUN_DIR": str(run_dir)}
    done = run_notebook(NOTEBOOK, env)
    assert errors(done) == []
    for name in ("search.png", "rounds.png", "training.png"):
        png = (run_dir / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name  # a drawn figure, not an empty canvas
    code = [c for c in done.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code)  # every cell ran
    out = "\n".join(_text(c) for c in code)
    assert "run demo: 2 round(s), 16 rollouts, 7 candidates" in out
    assert "+tool_format: json" in out  # the last round's diff
    table = _text(code[-1]).splitlines()  # the 2x2 of the last tested round, as every report prints it
    assert table[0] == "round 1, test split, 8 tasks, mean reward [95% CI]"
    assert table[2].split()[:4] == ["live", "adapter", "A_r", ADAPTER] and table[3].split()[3] == "L1-life@v2"
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 3
