"""Running a notebook top to bottom the way a researcher's Jupyter would, for the notebook tests."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

TIMEOUT_S = 300  # per cell; the slowest cell reads a real run's store and draws two plots


def run_notebook(path: Path, env: dict[str, str]) -> nbformat.NotebookNode:
    """Execute ``path`` in a fresh python3 kernel with ``env`` added to its environment; returns the executed notebook.

    The kernel is ipykernel's own ``python3``, which jupyter_client starts with this interpreter (the venv's), in
    the notebook's folder as Jupyter would. A cell that raises stops the run with nbclient's CellExecutionError.
    """
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=TIMEOUT_S, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute(env={**os.environ, **env})
    return notebook


def errors(notebook: nbformat.NotebookNode) -> list[str]:
    """The error outputs of an executed notebook, as 'ename: evalue'."""
    return [
        f"{out['ename']}: {out['evalue']}"
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
