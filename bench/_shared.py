"""What every bench shares: its table written as JSON beside the printed one, with the commit and command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit id, with '+dirty' when files differ from it ('unknown' outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(  # a bench's own results (bench/results/) do not make the code it ran dirty
            ["git", "status", "--porcelain", "-uno", "--", ".", ":!bench/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_json(path: Path, table: dict[str, Any]) -> None:
    """Write a bench's results with the commit id and the command line that produced them."""
    body = {"commit": commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]), **table}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {path}")


def paired_gain(after: list[float], before: list[float], seed: int = 0) -> tuple[float, tuple[float, float]]:
    """Mean of after - before over the same tasks, and its 95% bootstrap interval (the gate's own)."""
    from autoevolve.stats import bootstrap_ci

    diffs = [a - b for a, b in zip(after, before, strict=True)]
    return sum(diffs) / len(diffs), bootstrap_ci(diffs, seed)
