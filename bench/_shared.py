"""What every bench shares: its table written as JSON beside the printed one, with the commit and command line."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def commit() -> str:
    """The checkout's commit id, with '+dirty.<hash of the diff>' when files differ from it ('unknown' outside
    git)."""
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
    if not dirty.stdout.strip():
        return head.stdout.strip()
    changes = subprocess.run(["git", "diff", "HEAD", "--", ".", ":!bench/results"], cwd=ROOT, capture_output=True)
    return f"{head.stdout.strip()}+dirty.{hashlib.sha256(changes.stdout).hexdigest()[:8]}"  # which uncommitted diff


CODE = ("autoevolve", "bench", "prompts", "configs", "pyproject.toml", "constraints.txt")  # what makes a result


@functools.cache
def code_id() -> str:
    """A short hash of the code a result depends on, as it was when the bench started (files under ``CODE``, tracked
    or new, bench results aside): the same id means the same code, whatever else was committed since. Taken once
    per process, so an edit while a long bench runs cannot relabel what the code at its start made."""
    spec = ["--", *CODE, ":!bench/results"]
    try:
        listed = subprocess.run(["git", "ls-files", "-s", *spec], cwd=ROOT, capture_output=True, text=True, check=True)
        changed = subprocess.run(["git", "diff", "HEAD", *spec], cwd=ROOT, capture_output=True, text=True, check=True)
        new = subprocess.run(
            ["git", "ls-files", "-o", "--exclude-standard", *spec], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    digest = hashlib.sha256((listed.stdout + changed.stdout).encode())
    for name in new.stdout.split():  # a new module the code imports is part of it before it is committed
        digest.update(name.encode() + (ROOT / name).read_bytes())
    return digest.hexdigest()[:12]


def fresh_home(path: Path) -> Path:
    """A bench's folder of stored rollouts and adapters, emptied first if other code made them: stored work is
    reused only when the code that made it is unchanged (``code_id``)."""
    if ROOT / "trajectories" not in path.resolve().parents:
        raise ValueError(f"{path}: a bench's stored work lives under {ROOT / 'trajectories'}")
    marker = path / "code_id"
    if path.exists() and (not marker.exists() or marker.read_text().strip() != code_id()):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    marker.write_text(code_id() + "\n")
    return path


def write_json(path: Path, table: dict[str, Any]) -> None:
    """Write a bench's results with the commit id, the code id and the command line that produced them."""
    command = " ".join([Path(sys.executable).name, *sys.argv])
    body = {"commit": commit(), "code": code_id(), "command": command, **table}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {path}")


def paired_gain(after: list[float], before: list[float], seed: int = 0) -> tuple[float, tuple[float, float]]:
    """Mean of after - before over the same tasks, and its 95% bootstrap interval (the gate's own)."""
    from autoevolve.stats import bootstrap_ci

    diffs = [a - b for a, b in zip(after, before, strict=True)]
    return sum(diffs) / len(diffs), bootstrap_ci(diffs, seed)


# Both read when a bench starts (they are cached): an edit or a commit while it runs cannot relabel what the code at
# its start made.
commit()
code_id()
