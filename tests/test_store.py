"""Tests for the store: migrations, round trips, idempotent bulk ingest, filters, registry queries; the tests of
the ``store`` fixture run on both engines (a DuckDB file, a PostgreSQL database)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from autoevolve.records import (
    AdapterRecord,
    Candidate,
    Cell,
    EvalReport,
    Expert,
    Message,
    SelectedTrajectory,
    Selection,
    ToolCall,
    Trajectory,
)
from autoevolve.store import LATEST_VERSION, MIGRATIONS, Store, StoreTooNew
from autoevolve.store import base as store_mod


def make_traj(
    task: int,
    sample: int = 0,
    *,
    run_id: str = "run1",
    hcp_id: str = "hcpA",
    adapter: str = "",
    split: str = "train",
    reward: float = 0.5,
    **kw,
) -> Trajectory:
    """A small trajectory with a tool call and its answer, ~4 messages."""
    call = ToolCall.make(f"call_{task}_{sample}", "get_weather", {"city": "Oslo", "n": task})
    messages = [
        Message(role="system", content="You are helpful."),
        Message(role="user", content=f"weather for task {task}?"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", content='{"temp": 3.25}', tool_call_id=call.id),
    ]
    return Trajectory(
        run_id=run_id,
        task_id=f"t{task:06d}",
        split=split,
        hcp_id=hcp_id,
        adapter=adapter,
        sample=sample,
        messages=messages,
        reward=reward,
        **kw,
    )


@pytest.fixture(params=["duckdb", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh writable store of each engine, closed after the test."""
    where = request.getfixturevalue("postgres_url") if request.param == "postgresql" else tmp_path / "sub" / "s.duckdb"
    with Store(where) as s:
        yield s


def test_migrations_recorded_and_not_reapplied(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "s.duckdb"
    with Store(path) as s:
        assert path.exists()
        assert [v for v, _ in s.migrations()] == list(range(1, len(MIGRATIONS) + 1))
        assert s.schema_version() == LATEST_VERSION == len(MIGRATIONS)
    with Store(path) as s:
        assert s._migrate() == []
        assert len(s.migrations()) == len(MIGRATIONS)
        n = s.con.execute("SELECT count(*) FROM schema_migrations").fetchone()[0]
        assert n == len(MIGRATIONS)


def test_lineage_migration_keeps_old_parents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "v3.duckdb"
    monkeypatch.setattr(store_mod, "MIGRATIONS", [m for m in MIGRATIONS if m[0] <= 3])
    with Store(path) as s:
        s.con.execute(
            "INSERT INTO candidates (run_id, round, hcp_id, parent_id, mutator, status, scores, mean_reward, note,"
            " schema_version) VALUES ('r', 0, 'h1', 'h0', 'demos', 'keep', '{\"t1\": 1.0}', 1.0, '', 1),"
            " ('r', 0, 'h0', NULL, 'seed', 'keep', '{}', 0.0, '', 1)"
        )
    monkeypatch.undo()
    with Store(path) as s:
        assert s.schema_version() == LATEST_VERSION
        rows = {c.hcp_id: c for c in s.candidates("r")}
    assert rows["h1"].parents == ["h0"] and rows["h0"].parents == [] and rows["h1"].scores == {"t1": 1.0}


def test_experts_migration_makes_the_newest_promoted_version_live(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "v4.duckdb"
    monkeypatch.setattr(store_mod, "MIGRATIONS", [m for m in MIGRATIONS if m[0] <= 4])
    rows = [
        ("L1-life", 1, "promoted"),
        ("L1-life", 2, "promoted"),
        ("L1-life", 3, "rejected"),
        ("L2-x", 1, "candidate"),
    ]
    with Store(path) as s:
        for name, version, status in rows:
            s.put_adapter(AdapterRecord(name=name, version=version, base_model="m", path="/a", hcp_id="h"))
            s.con.execute("UPDATE adapters SET status = ? WHERE name = ? AND version = ?", [status, name, version])
    monkeypatch.undo()
    with Store(path) as s:
        assert [(e.name, e.base_model, e.live_version) for e in s.experts()] == [
            ("L1-life", "m", 2),
            ("L2-x", "m", None),
        ]
        assert [a.status for a in s.adapters("L1-life")] == ["retired", "promoted", "rejected"]
        assert s.promoted_adapter("L1-life").version == 2 and s.events() == []


def test_newer_schema_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.duckdb"
    Store(path).close()
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, 'from_the_future')", [LATEST_VERSION + 5])
    con.close()
    with pytest.raises(RuntimeError, match="future.duckdb") as err:
        Store(path)
    assert str(LATEST_VERSION + 5) in str(err.value) and str(LATEST_VERSION) in str(err.value)
    with pytest.raises(RuntimeError, match="future.duckdb"):
        Store(path, read_only=True)
    with pytest.raises(StoreTooNew, match=f"store {path} has schema version"):
        Store.snapshot(path)
    for args in (["candidates", "r", "--store"], ["inspect", "r", "--store"], ["registry", "--store"]):
        done = subprocess.run(
            [sys.executable, "-m", "autoevolve.cli", *args, str(path), *(["list"] if args[0] == "registry" else [])],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"has schema version {LATEST_VERSION + 5}" in done.stderr and "upgrade autoevolve" in done.stderr


def test_failed_migration_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.duckdb"
    Store(path).close()
    broken = [*MIGRATIONS, (LATEST_VERSION + 1, "broken", "CREATE TABLE half (x INT); SELECT * FROM nope;")]
    monkeypatch.setattr(store_mod, "MIGRATIONS", broken)
    monkeypatch.setattr(store_mod, "LATEST_VERSION", LATEST_VERSION + 1)
    with pytest.raises(duckdb.Error):
        Store(path)
    monkeypatch.undo()
    with Store(path) as s:
        assert s.schema_version() == LATEST_VERSION
        tables = s.con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'half'").fetchone()
        assert tables[0] == 0


def test_run_and_hcp_round_trip(store: Store) -> None:
    config = {"model": "qwen", "rounds": 3, "temps": [0.7, 1.0], "nested": {"a": None}}
    store.put_run("run1", config)
    store.put_run("run1", {"other": 1})
    assert store.run_config("run1") == config
    assert store.run_config("nope") is None
    body = {"system": "Be brief.", "tools": ["a", "b"], "examples": []}
    store.put_hcp("h1", "seed", body)
    store.put_hcp("h1", "seed", body)
    assert store.get_hcp("h1") == body
    with pytest.raises(KeyError, match="missing"):
        store.get_hcp("missing")


def test_trajectory_round_trip_exact(store: Store) -> None:
    t = make_traj(
        1,
        2,
        adapter="L1-life@v1",
        reward=1 / 3,
        feedback="",
        error="boom",
        round=4,
        stage="gate",
        tier=2,
        prompt_tokens=123,
        completion_tokens=45,
        latency_s=0.1 + 0.2,
    )
    assert store.put_trajectories([t]) == 1
    (back,) = store.trajectories("run1")
    assert back == t
    assert back.messages[2].tool_calls[0].arguments == {"city": "Oslo", "n": 1}
    assert back.messages[3].tool_call_id == "call_1_2"
    assert back.reward == 1 / 3 and back.latency_s == 0.1 + 0.2


def test_bulk_idempotent(store: Store) -> None:
    trajs = [make_traj(i, s) for i in range(50) for s in range(2)]
    assert store.put_trajectories(trajs) == 100
    assert store.put_trajectories(trajs) == 0
    assert store.count_trajectories() == 100
    changed = make_traj(0, 0, reward=1.0)
    assert store.put_trajectories([changed, make_traj(999)]) == 1
    assert store.trajectories("run1", task_ids=["t000000"])[0].reward == 0.5
    assert store.count_trajectories("run1") == 101
    assert store.count_trajectories("run1", round=0) == 101 and store.count_trajectories("run1", round=1) == 0
    assert store.put_trajectories([]) == 0


def test_bulk_duplicates_within_batch(store: Store) -> None:
    first, dup = make_traj(7, reward=0.25), make_traj(7, reward=0.75)
    assert store.put_trajectories([first, dup]) == 1
    assert store.trajectories("run1")[0].reward == 0.25


def test_rowwise_idempotent(store: Store) -> None:
    trajs = [make_traj(i) for i in range(30)]
    assert store.put_trajectories_rowwise(trajs) == 30
    assert store.put_trajectories_rowwise(trajs) == 0
    assert store.put_trajectories(trajs) == 0
    assert store.count_trajectories("run1") == 30
    assert store.trajectories("run1") == sorted(trajs, key=lambda t: t.task_id)


def test_bulk_ingest_20k_fast(store: Store) -> None:
    trajs = [make_traj(i, s, reward=(i % 5) / 4) for i in range(10_000) for s in range(2)]
    start = time.perf_counter()
    assert store.put_trajectories(trajs) == 20_000
    assert time.perf_counter() - start < 20
    assert store.count_trajectories("run1") == 20_000


def test_trajectory_filters(store: Store) -> None:
    trajs = [
        make_traj(1, 0, reward=0.0),
        make_traj(1, 1, reward=1.0),
        make_traj(2, 0, reward=0.5, hcp_id="hcpB"),
        make_traj(2, 0, reward=0.9, adapter="L1"),
        make_traj(3, 0, reward=0.8, split="dev", stage="gate", round=2),
        make_traj(4, 0, run_id="run2"),
    ]
    store.put_trajectories(trajs)
    keys = lambda ts: [(t.task_id, t.sample, t.hcp_id, t.adapter) for t in ts]  # noqa: E731
    assert len(store.trajectories("run1")) == 5
    assert keys(store.trajectories("run1", hcp_id="hcpB")) == [("t000002", 0, "hcpB", "")]
    assert keys(store.trajectories("run1", adapter="L1")) == [("t000002", 0, "hcpA", "L1")]
    assert keys(store.trajectories("run1", split="dev")) == [("t000003", 0, "hcpA", "")]
    assert keys(store.trajectories("run1", stage="gate", round=2)) == [("t000003", 0, "hcpA", "")]
    assert keys(store.trajectories("run1", round=1)) == []
    assert [t.sample for t in store.trajectories("run1", task_ids=["t000001"])] == [0, 1]
    assert store.trajectories("run1", task_ids=[]) == []
    assert [t.reward for t in store.trajectories("run1", min_reward=0.8)] == [1.0, 0.9, 0.8]
    assert keys(store.trajectories("run1", hcp_id="hcpA", adapter="", min_reward=0.5)) == [
        ("t000001", 1, "hcpA", ""),
        ("t000003", 0, "hcpA", ""),
    ]


def test_mean_rewards(store: Store) -> None:
    store.put_trajectories(
        [
            make_traj(1, 0, reward=0.0),
            make_traj(1, 1, reward=1.0),
            make_traj(1, 2, reward=0.5),
            make_traj(2, 0, reward=0.25),
            make_traj(2, 0, reward=1.0, adapter="L1"),
        ]
    )
    assert store.mean_rewards("run1", "hcpA", "") == {"t000001": 0.5, "t000002": 0.25}
    assert store.mean_rewards("run1", "hcpA", "L1") == {"t000002": 1.0}
    assert store.mean_rewards("run1", "hcpA", "", task_ids=["t000002"]) == {"t000002": 0.25}
    assert store.mean_rewards("run1", "hcpX", "") == {}


def test_candidate_upsert(store: Store) -> None:
    seed = Candidate(run_id="run1", hcp_id="h0", status="keep", scores={"t1": 0.5}, mean_reward=0.5)
    child = Candidate(
        run_id="run1", round=1, hcp_id="h1", parents=["h0"], mutator="rewrite", status="crash", diff="not yaml"
    )
    store.put_candidate(seed)
    store.put_candidate(child)
    assert store.candidates("run1") == [seed, child]
    kept = child.model_copy(
        update={
            "status": "keep",
            "components": ["system_prompt"],
            "minibatch": {"t9": 1.0},
            "parent_minibatch": {"t9": 0.0},
            "scores": {"t1": 1.0, "t2": 0.25},
            "spreads": {"t1": 0.0, "t2": 0.5},
            "mean_reward": 0.625,
            "rollouts_used": 40,
        }
    )
    store.put_candidate(kept)
    assert store.candidates("run1") == [seed, kept]
    assert store.candidates("run1", round=1) == [kept]
    assert store.candidates("run1")[0].parents == [] and store.candidates("run1")[1].spreads["t2"] == 0.5
    assert store.candidates("other") == []


def test_selection_round_trip_and_idempotent(store: Store) -> None:
    items = [
        SelectedTrajectory(
            task_id=f"t{i}",
            hcp_id="h1",
            adapter="",
            sample=i,
            reward=1.0,
            baseline_hcp_id="h0",
            baseline_sample=0,
            baseline_reward=0.1 * i,
        )
        for i in range(3)
    ]
    sel = Selection(
        id="sel1", run_id="run1", round=1, baseline_hcp_id="h0", evolved_hcp_id="h1", adapter="", items=items
    )
    empty = Selection(
        id="sel2", run_id="run1", round=2, baseline_hcp_id="h0", evolved_hcp_id="h2", adapter="L1", items=[]
    )
    store.put_selection(sel)
    store.put_selection(sel)
    store.put_selection(empty)
    assert store.selection("sel1") == sel
    assert store.selections("run1") == [sel, empty]
    assert store._one("SELECT count(*) FROM selection_items")[0] == 3
    with pytest.raises(KeyError, match="nope"):
        store.selection("nope")


def test_a_selections_kept_and_beaten_rollouts_come_back_in_its_order(store: Store) -> None:
    store.put_trajectories([make_traj(t, s, hcp_id=h) for t in range(3) for s in range(2) for h in ("h0", "h1")])
    items = [
        SelectedTrajectory(task_id=f"t{t:06d}", hcp_id="h1", adapter="", sample=s, reward=1.0, baseline_hcp_id="h0",
                           baseline_sample=1 - s, baseline_reward=0.0)
        for t, s in [(2, 1), (0, 0), (1, 1)]
    ]  # fmt: skip
    sel = Selection(id="s", run_id="run1", round=0, baseline_hcp_id="h0", evolved_hcp_id="h1", adapter="", items=items)
    assert [(t.hcp_id, t.task_id, t.sample) for t in store.kept_rollouts(sel)] == [
        ("h1", "t000002", 1),
        ("h1", "t000000", 0),
        ("h1", "t000001", 1),
    ]
    assert [(t.hcp_id, t.task_id, t.sample) for t in store.beaten_rollouts(sel)] == [
        ("h0", "t000002", 0),
        ("h0", "t000000", 1),
        ("h0", "t000001", 0),
    ]
    missing = sel.model_copy(update={"items": [items[0].model_copy(update={"sample": 7})]})
    with pytest.raises(KeyError, match="no stored rollout"):
        store.kept_rollouts(missing)


def test_adapter_versioning_and_promotion(store: Store) -> None:
    assert store.next_adapter_version("L1-life") == 1
    assert store.promoted_adapter("L1-life") is None
    v1 = AdapterRecord(
        name="L1-life",
        version=1,
        base_model="qwen",
        path="/a/v1",
        hcp_id="h0",
        eval={"dev": {"mean": 0.75, "n": 40}, "tags": ["x"]},
    )
    store.put_adapter(v1)
    assert store.next_adapter_version("L1-life") == 2
    assert store.adapter("L1-life", 1) == v1
    store.put_expert(Expert(name="L1-life", base_model="qwen"))
    assert store.set_live("L1-life", 1, "promote", detail="first") is None
    v2 = AdapterRecord(
        name="L1-life",
        version=2,
        base_model="qwen",
        path="/a/v2",
        hcp_id="h0",
        parent_version=1,
    )
    store.put_adapter(v2)
    store.put_adapter(AdapterRecord(name="L2-x", version=1, base_model="qwen", path="/b", hcp_id="h9"))
    with pytest.raises(ValueError, match="L1-life@v2: a version becomes 'promoted' only through set_live"):
        store.put_adapter(v2.model_copy(update={"status": "promoted"}))
    assert store.set_live("L1-life", 2, "promote", detail="beat v1") == 1
    assert store.promoted_adapter("L1-life") == v2.model_copy(update={"status": "promoted", "reason": "beat v1"})
    assert [a.ref for a in store.adapters()] == ["L1-life@v1", "L1-life@v2", "L2-x@v1"]
    assert [a.status for a in store.adapters("L1-life")] == ["retired", "promoted"]
    store.put_adapter(store.adapter("L1-life", 2).model_copy(update={"reason": "beat v1 on dev"}))  # live: allowed
    assert store.set_live("L1-life", 1, "rollback") == 2
    assert store.promoted_adapter("L1-life").version == 1 and store.promoted_adapter("L2-x") is None
    assert store.next_adapter_version("L1-life") == 3
    with pytest.raises(KeyError, match="L1-life@v9"):
        store.adapter("L1-life", 9)


def test_evaluation_upsert(store: Store) -> None:
    cells = {
        "live_original": Cell(adapter="", hcp_id="h0", mean=0.4, n=40, prompt_tokens=812.5),
        "new_original": Cell(adapter="L1@v1", hcp_id="h0", mean=0.7, n=40),
    }
    r = EvalReport(run_id="run1", round=1, split="dev", cells=cells, decision="reject", reason="")
    store.put_evaluation(r)
    promoted = r.model_copy(update={"decision": "promote", "reason": "+0.3"})
    store.put_evaluation(promoted)
    test_r = EvalReport(run_id="run1", round=1, split="test", cells={}, decision="report", reason="held out")
    store.put_evaluation(test_r)
    assert store.evaluations("run1") == [promoted, test_r]
    assert store.evaluations("run2") == []


def test_read_only_sees_data(tmp_path: Path) -> None:
    path = tmp_path / "ro.duckdb"
    with Store(path) as s:
        s.put_trajectories([make_traj(1), make_traj(2)])
        s.put_run("run1", {"k": 1})
    with Store(path, read_only=True) as ro:
        assert ro.count_trajectories("run1") == 2
        assert ro.run_config("run1") == {"k": 1}
        assert ro.schema_version() == LATEST_VERSION
        with pytest.raises(duckdb.Error):
            ro.put_run("run2", {})
    with pytest.raises(FileNotFoundError, match="absent.duckdb"):
        Store(tmp_path / "absent.duckdb", read_only=True)


def test_every_record_field_has_a_column(store: Store) -> None:
    tables = {
        "trajectories": Trajectory,
        "candidates": Candidate,
        "selection_items": SelectedTrajectory,
        "adapters": AdapterRecord,
    }
    for table, record in tables.items():
        cols = {
            c for (c,) in store._all("SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table])
        }
        assert set(record.model_fields) <= cols, (table, set(record.model_fields) - cols)
    sel_cols = {
        c for (c,) in store._all("SELECT column_name FROM information_schema.columns WHERE table_name = 'selections'")
    }
    assert set(Selection.model_fields) - {"items"} <= sel_cols


def test_an_unreachable_postgresql_store_is_a_store_error_without_its_password() -> None:
    from autoevolve.store import StoreError

    said = r"postgresql://ae:\*\*\*@127.0.0.1:9/db: connection failed: .* refused"
    with pytest.raises(StoreError, match=said) as err:
        Store("postgresql://ae:secret@127.0.0.1:9/db")
    assert "secret" not in str(err.value) and "\n" not in str(err.value)
