"""`Store.export_run` and `autoevolve export`: hive-partitioned Parquet that DuckDB and pandas read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from pydantic import TypeAdapter

from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import (
    AdapterRecord,
    Candidate,
    Cell,
    EvalReport,
    Message,
    SelectedTrajectory,
    Selection,
    ToolCall,
    Trajectory,
)
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]
RUN = "demo"
ADAPTER = "L1-life@v1"  # round 1 searches around the adapter round 0 trained
# Rows per round of the store `build_run` writes (round 0, round 1).
ROWS = {
    "trajectories": (12, 4),
    "candidates": (4, 3),
    "selections": (1, 1),
    "selection_items": (3, 2),
    "evaluations": (2, 2),
    "adapters": (1, 1),
}


def configs() -> tuple[HCPConfig, HCPConfig, HCPConfig]:
    """The original life config, round 0's evolved one (an extra system line) and round 1's (JSON tool list too)."""
    original = HCPConfig.from_yaml(ROOT / "prompts" / "life.yaml")
    evolved = original.model_copy(update={"system_prompt": original.system_prompt + "\nCall a tool before answering."})
    evolved2 = evolved.model_copy(update={"tool_format": "json"})
    assert len({original.id, evolved.id, evolved2.id}) == 3
    return original, evolved, evolved2


def _traj(task_id: str, split: str, hcp: HCPConfig, round: int, adapter: str, won: bool) -> Trajectory:
    """A rollout that either calls the tool and answers (reward 1) or refuses (reward 0)."""
    call = ToolCall.make(f"c-{task_id}", "add_event", {"title": f"dentist {task_id}", "day": "2025-03-04"})
    messages = [Message(role="user", content=f"Book the dentist ({task_id}).")]
    if won:
        messages += [
            Message(role="assistant", tool_calls=[call]),
            Message(role="tool", content='{"ok": true}', tool_call_id=call.id),
            Message(role="assistant", content=f"Booked {task_id}."),
        ]
    else:
        messages.append(Message(role="assistant", content=f"I cannot book {task_id}."))
    return Trajectory(
        run_id=RUN,
        task_id=task_id,
        split=split,
        hcp_id=hcp.id,
        adapter=adapter,
        round=round,
        stage="evolve" if split == "dev" else "select",
        messages=messages,
        reward=1.0 if won else 0.0,
        prompt_tokens=len(hcp.system_prompt) // 4,
        completion_tokens=12,
    )


def _cells(original: HCPConfig, evolved: HCPConfig, live: str, means: tuple[float, ...], n: int) -> dict[str, Cell]:
    """A 2x2 with the given means (live_original, live_evolved, new_original, new_evolved)."""
    adapters = {"live": live, "new": f"L1-life@v{2 if live else 1}"}
    names = [(a, c) for a in ("live", "new") for c in ("original", "evolved")]
    return {
        f"{a}_{c}": Cell(
            adapter=adapters[a],
            hcp_id=(original if c == "original" else evolved).id,
            mean=m,
            n=n,
            ci=(max(0.0, m - 0.1), min(1.0, m + 0.1)),
            prompt_tokens=254.0 if c == "original" else 423.0,
        )
        for (a, c), m in zip(names, means, strict=True)
    }


def _report(split: str, round: int, cells: dict[str, Cell], decision: str) -> EvalReport:
    """An evaluation whose gain is new_original - live_original."""
    gain = cells["new_original"].mean - cells["live_original"].mean
    prompt = cells["live_evolved"].mean - cells["live_original"].mean
    return EvalReport(
        run_id=RUN,
        round=round,
        split=split,
        cells=cells,
        decision=decision,
        reason=f"dev gain {gain:+.3f}" if split == "dev" else "",
        gain=gain,
        gain_ci=(gain - 0.05, gain + 0.05),
        retention=gain / prompt if prompt > 0 else None,
    )


def build_run(path: Path) -> None:
    """A store holding two rounds of run 'demo' (rows per round in ROWS) and one trajectory of run 'other'."""
    original, evolved, evolved2 = configs()
    with Store(path) as store:
        store.put_run(RUN, {"seed": 0})
        store.put_run("other", {"seed": 1})
        for h in (original, evolved, evolved2):
            store.put_hcp(h.id, h.name, h.model_dump(mode="json"))
        trajs = [_traj("t9", "train", original, 0, "", False).model_copy(update={"run_id": "other"})]
        for hcp, won in ((original, False), (evolved, True)):  # round 0: the evolved config wins t0-t2, not t3
            trajs += [_traj(f"t{i}", "train", hcp, 0, "", won and i < 3) for i in range(4)]
            trajs += [_traj(f"d{i}", "dev", hcp, 0, "", won) for i in range(2)]
        for hcp, won in ((original, False), (evolved2, True)):  # round 1, around the adapter: t0 and t1
            trajs += [_traj(f"t{i}", "train", hcp, 1, ADAPTER, won) for i in range(2)]
        store.put_trajectories(trajs)
        ledger = [
            Candidate(run_id=RUN, round=0, hcp_id=original.id, status="keep", scores={"d0": 0.0, "d1": 0.0}),
            Candidate(
                run_id=RUN, round=0, hcp_id=evolved.id, parents=[original.id], mutator="demos",
                components=["system_prompt"], status="keep", minibatch={"t0": 1.0, "t1": 1.0},
                parent_minibatch={"t0": 0.0, "t1": 0.0}, scores={"d0": 1.0, "d1": 0.0}, mean_reward=0.5,
                rollouts_used=8,
            ),
            Candidate(
                run_id=RUN, round=0, hcp_id="h-discard", parents=[evolved.id], mutator="tool_format",
                status="discard", minibatch={"t2": 0.0, "t3": 0.0}, parent_minibatch={"t2": 1.0, "t3": 0.0},
                rollouts_used=12,
            ),
            Candidate(run_id=RUN, round=0, hcp_id="crash-reflective-3", mutator="reflective", status="crash"),
            Candidate(
                run_id=RUN, round=1, hcp_id=original.id, status="keep", scores={"d0": 0.5, "d1": 0.5}, mean_reward=0.5
            ),
            Candidate(
                run_id=RUN, round=1, hcp_id=evolved2.id, parents=[original.id], mutator="tool_format",
                components=["system_prompt", "tool_format"], status="keep", minibatch={"t0": 1.0},
                parent_minibatch={"t0": 0.0}, scores={"d0": 1.0, "d1": 0.5}, mean_reward=0.75, rollouts_used=6,
            ),
            Candidate(
                run_id=RUN, round=1, hcp_id="h-discard-2", parents=[evolved2.id], mutator="demos", status="discard",
                minibatch={"t1": 0.0}, parent_minibatch={"t1": 1.0}, rollouts_used=8,
            ),
        ]  # fmt: skip
        for c in ledger:
            store.put_candidate(c)
        for round, hcp, adapter, n in ((0, evolved, "", 3), (1, evolved2, ADAPTER, 2)):
            items = [
                SelectedTrajectory(
                    task_id=f"t{i}", hcp_id=hcp.id, adapter=adapter, sample=0, reward=1.0,
                    baseline_hcp_id=original.id, baseline_sample=0, baseline_reward=0.0,
                )
                for i in range(n)
            ]  # fmt: skip
            store.put_selection(
                Selection(
                    id=f"sel-{round}", run_id=RUN, round=round, baseline_hcp_id=original.id,
                    evolved_hcp_id=hcp.id, adapter=adapter, items=items,
                )
            )  # fmt: skip
        store.put_evaluation(_report("dev", 0, _cells(original, evolved, "", (0.0, 0.5, 0.625, 0.5), 8), "promote"))
        store.put_evaluation(_report("test", 0, _cells(original, evolved, "", (0.0, 0.5, 0.75, 0.625), 8), "report"))
        store.put_evaluation(
            _report("dev", 1, _cells(original, evolved2, ADAPTER, (0.625, 0.75, 0.625, 0.75), 8), "reject")
        )
        store.put_evaluation(
            _report("test", 1, _cells(original, evolved2, ADAPTER, (0.75, 0.875, 0.75, 0.875), 8), "report")
        )
        for version, round, hcp, status in ((1, 0, evolved, "candidate"), (2, 1, evolved2, "rejected")):
            store.put_adapter(
                AdapterRecord(
                    name="L1-life", version=version, base_model="m", path=f"/adapters/v{version}", run_id=RUN,
                    round=round, hcp_id=original.id, evolved_hcp_id=hcp.id, selection_id=f"sel-{round}",
                    status=status, eval={"gain": 0.625 if round == 0 else 0.0},
                )
            )  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The two-round store of ``build_run``."""
    path = tmp_path_factory.mktemp("export") / "s.duckdb"
    build_run(path)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoevolve.cli", *args], capture_output=True, text=True)


def test_export_writes_one_partitioned_folder_per_table(built: Path, tmp_path: Path) -> None:
    with Store(built, read_only=True) as store:
        counts = store.export_run(RUN, tmp_path / "out")
    assert counts == {table: sum(rows) for table, rows in ROWS.items()}
    for table in ROWS:
        folders = sorted(p.name for p in (tmp_path / "out" / table).iterdir())
        assert folders == ["round=0", "round=1"], table
        assert [p.name for p in (tmp_path / "out" / table / "round=1").iterdir()] == ["data_0.parquet"]


def test_duckdb_and_pandas_read_it_back_per_round(built: Path, tmp_path: Path) -> None:
    with Store(built, read_only=True) as store:
        store.export_run(RUN, tmp_path)
    con = duckdb.connect()
    for table, (first, second) in ROWS.items():
        glob = str(tmp_path / table / "**" / "*.parquet")
        rows = con.execute(
            "SELECT round, count(*) FROM read_parquet(?, hive_partitioning = true) GROUP BY round ORDER BY round",
            [glob],
        ).fetchall()
        assert rows == [(0, first), (1, second)], table
        frame = pd.read_parquet(tmp_path / table)
        assert frame["round"].astype(int).value_counts().sort_index().tolist() == [first, second], table
    trajs = pd.read_parquet(tmp_path / "trajectories")
    assert set(trajs["run_id"]) == {RUN}  # run 'other' stays out
    items = con.execute(
        "SELECT round, selection_id, position, task_id FROM read_parquet(?, hive_partitioning = true) "
        "ORDER BY round, position",
        [str(tmp_path / "selection_items" / "**" / "*.parquet")],
    ).fetchall()
    assert items[3:] == [(1, "sel-1", 0, "t0"), (1, "sel-1", 1, "t1")]  # the selection's round joined in


def test_messages_and_reports_round_trip(built: Path, tmp_path: Path) -> None:
    _, evolved, _ = configs()
    with Store(built, read_only=True) as store:
        store.export_run(RUN, tmp_path)
        [stored] = store.trajectories(RUN, hcp_id=evolved.id, task_ids=["t0"])
        reports = store.evaluations(RUN)
    trajs = pd.read_parquet(tmp_path / "trajectories")
    [text] = trajs[(trajs["hcp_id"] == evolved.id) & (trajs["task_id"] == "t0")]["messages"]
    assert TypeAdapter(list[Message]).validate_json(text) == stored.messages
    assert json.loads(text)[1]["tool_calls"][0]["function"]["name"] == "add_event"
    evals = pd.read_parquet(tmp_path / "evaluations").sort_values(["round", "split"])
    assert evals["decision"].tolist() == ["promote", "report", "reject", "report"]
    assert [EvalReport.model_validate_json(b) for b in evals["body"]] == reports


def test_re_export_overwrites_and_unknown_run_names_the_runs(built: Path, tmp_path: Path) -> None:
    with Store(built, read_only=True) as store:
        first = store.export_run(RUN, tmp_path)
        again = store.export_run(RUN, tmp_path)
        with pytest.raises(KeyError, match=r"no run 'nope' .*\(runs: demo, other\)"):
            store.export_run("nope", tmp_path / "x")
    assert first == again
    assert len(list((tmp_path / "trajectories").rglob("*.parquet"))) == 2  # overwritten, not duplicated
    assert not (tmp_path / "x").exists()


def test_cli_export_prints_rows_per_table(built: Path, tmp_path: Path) -> None:
    done = _cli("export", RUN, str(tmp_path / "out"), "--store", str(built))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == list(ROWS)
    assert lines[0].startswith("trajectories: 16 rows -> ") and lines[3].startswith("selection_items: 5 rows")
    assert (tmp_path / "out" / "candidates" / "round=1" / "data_0.parquet").stat().st_size > 0


def test_cli_export_unknown_run_or_store_exits_2(built: Path, tmp_path: Path) -> None:
    done = _cli("export", "nope", str(tmp_path / "out"), "--store", str(built))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"autoevolve: no run 'nope' in {built} (runs: demo, other)"]
    done = _cli("export", RUN, str(tmp_path / "out"), "--store", str(tmp_path / "missing.duckdb"))
    assert done.returncode == 2 and "no store at" in done.stderr and len(done.stderr.splitlines()) == 1
