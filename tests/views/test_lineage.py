"""`autoevolve candidates` and `autoevolve diff`, run as a user runs them, on a store a real search wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autoevolve.store import Store
from tests.stages.evolve.test_evolve import DemoLearner, _search, _settings


@pytest.fixture(scope="module")
def searched(tmp_path_factory, env, original) -> tuple[Path, list]:
    """A store holding one search: seed, a kept demo config, a discarded tool-format child, a crash."""
    folder = tmp_path_factory.mktemp("lineage")
    _, ledger, _ = _search(env, original, folder, DemoLearner(env), _settings(mutators=["demos", "tool_format"]))
    with Store(folder / "s.duckdb") as store:
        store.put_run("r", {"seed": 0})
    return folder / "s.duckdb", ledger


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoevolve.cli", *args], capture_output=True, text=True)


def test_candidates_lists_every_ledger_row(searched) -> None:
    path, ledger = searched
    done = _cli("candidates", "r", "--store", str(path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:6] == ["round", "hcp_id", "parents", "mutator", "components", "status"]
    assert len(lines) == 1 + len(ledger)
    for line, row in zip(lines[1:], ledger, strict=True):
        assert row.hcp_id in line and row.status in line and row.mutator in line
    kept = next(line for line, row in zip(lines[1:], ledger, strict=True) if row.mutator == "demos")
    assert "1.000" in kept and "1.000/0.000" in kept


def test_diff_shows_the_changed_component(searched) -> None:
    path, ledger = searched
    done = _cli("diff", "r", "seed", "best", "--store", str(path))
    assert done.returncode == 0, done.stderr
    assert f"{ledger[0].hcp_id}/demos" in done.stdout and "+  items:" in done.stdout
    same = _cli("diff", "r", "seed", ledger[0].hcp_id[:6], "--store", str(path))
    assert same.stdout.strip() == f"{ledger[0].hcp_id} and {ledger[0].hcp_id} are the same config"


def test_unknown_run_or_config_exits_2_with_one_line(searched, tmp_path) -> None:
    path, _ = searched
    done = _cli("candidates", "nope", "--store", str(path))
    assert done.returncode == 2 and "no candidates for run 'nope'" in done.stderr and "(runs: r)" in done.stderr
    done = _cli("diff", "r", "seed", "zzz", "--store", str(path))
    assert done.returncode == 2 and "'zzz' matches no config of the run" in done.stderr
    done = _cli("candidates", "r", "--store", str(tmp_path / "missing.duckdb"))
    assert done.returncode == 2 and "no store at" in done.stderr and len(done.stderr.splitlines()) == 1


def test_a_store_held_by_a_running_round_is_read_from_its_snapshot(searched) -> None:
    path, ledger = searched
    with Store(path):  # this process writes, as a running round would, and has published a snapshot
        done = _cli("candidates", "r", "--store", str(path))
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == len(ledger) + 1 and ledger[-1].hcp_id in done.stdout


def test_selections_lists_items_and_preference_pairs(env, original, tmp_path) -> None:
    from autoevolve.harness.workbench import Workbench
    from autoevolve.stages.select import select
    from autoevolve.stages.settings import SelectSettings

    path = tmp_path / "s.duckdb"
    train = [t for t in env.tasks("train") if t.goal["kind"] == "table"][:3]
    evolved = original.model_copy(update={"demos": _demos(env)})
    with Store(path) as store:
        store.put_run("r", {})
        bench = Workbench(DemoLearner(env), env, store, run_id="r", progress=None)
        selection = select(bench, original, [evolved], train, SelectSettings(min_reward=1.0))
    done = _cli("selections", "r", "--store", str(path))
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()
    assert header.split() == [
        "round",
        "selection",
        "baseline",
        "evolved",
        "adapter",
        "items",
        "tasks",
        "pairs",
        "mean_gain",
    ]
    assert row.split()[1] == selection.id and row.split()[5:] == ["3", "3", "3", "1.000"]
    items = _cli("selections", "r", "--items", "--store", str(path)).stdout.splitlines()
    assert len(items) == 1 + 3 and all(train[i].id in items[1 + i] for i in range(3))
    missing = _cli("selections", "other", "--store", str(path))
    assert missing.returncode == 2 and "no selections for run 'other'" in missing.stderr


def _demos(env):
    """Two labelled demos: enough for DemoLearner to book."""
    from autoevolve.harness.hcp import Demo, Demos

    refs = [t for t in env.tasks("train") if t.goal["kind"] == "table"][5:7]
    return Demos(items=[Demo(task_id=t.id, messages=env.reference(t)) for t in refs])
