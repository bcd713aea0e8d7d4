"""Many writers, one logical store: which engine lets several runs commit trajectories at once?

Per engine, 1, 4 and 16 writer processes each commit ``--chunks`` chunks of ``--rows`` trajectories (the
workbench's chunk: one commit per batch of rollouts); per cell the trajectories committed per second (all writers
together, wall clock) and the commit latency's median and p99 (a commit's wait for the store included), then a
count that every row landed exactly once (a writer that gives up, e.g. on a DuckLake commit that keeps conflicting,
is counted with its reason, and the rows it did not commit are missing from the count). Then one reader's query
over ``--reader-rows`` trajectories (each run's mean reward and rollouts per stage), timed cold.

Engines, side by side in one process tree:
- ``duckdb-file``: today's store, one DuckDB file. DuckDB allows one writing process, so each commit opens the
  file (waiting while another holds it), writes and closes.
- ``duckdb-per-run``: one DuckDB file per writer, held open for its whole run (no waiting); the reader attaches
  every file and reads them as one.
- ``ducklake``: DuckLake, its catalog in a SQLite file and its data as Parquet files in a folder (the local
  many-process setup). Its extension is built for DuckDB <= 1.4 and the project pins a newer DuckDB, so its writers
  are processes of another interpreter (``--ducklake-python``, with ``duckdb==1.4.*``, ``duckdb-ext-ducklake`` and
  ``duckdb-ext-sqlite``), running ``bench/ducklake_writer.py``: a commit writes the chunk's Arrow table (the one
  ``Store.put_trajectories`` inserts) to a Parquet file, and the writer inserts its rows not stored yet (DuckLake
  has no primary keys, so the store's skip-stored-keys insert becomes an anti-join). Skipped without the flag.
- ``postgresql``: one PostgreSQL server (``autoevolve.store.postgres.LocalServer``: a cluster made by ``initdb`` in a
  temporary folder, on a Unix socket) as the store (``store: postgresql://...``); each writer keeps its store open
  and commits each chunk in one transaction.

Every writer commits through the project's ``Store.put_trajectories``. Skipped, with the reason,
  when ``initdb``/``pg_ctl`` or ``psycopg`` is missing.

Goal: 16 writers commit >= 4x the trajectories/s of one writer, with p99 commit latency <= 1 s; the reader's query
over 1M trajectories <= 1 s.

Run: .venv/bin/python bench/store_writers.py [--writers 1 4 16] [--chunks 40] [--rows 64] [--reader-rows 1000000]
     [--ducklake-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import write_json  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "store_writers.json"
READER = (
    "SELECT run_id, stage, count(*) AS rollouts, avg(reward) AS reward FROM trajectories GROUP BY run_id, stage "
    "ORDER BY run_id, stage"
)


def trajectories(run: str, first: int, n: int) -> list[Any]:
    """n realistic trajectories of one run (a request, a tool call, its result, a reply), task numbers from first."""
    from autoevolve.records import Message, ToolCall, Trajectory

    out = []
    for i in range(first, first + n):
        call = ToolCall(id=f"call_{i}", function={"name": "book_table", "arguments": '{"party_size": 4}'})
        messages = [
            Message(role="user", content=f"Book a table for 4 at Luigi's tonight at 19:00, request {i}."),
            Message(role="assistant", content="", tool_calls=[call]),
            Message(role="tool", content='{"status": "booked", "ref": "R123"}', tool_call_id=f"call_{i}"),
            Message(role="assistant", content="Your table for 4 at Luigi's is booked for 19:00 (ref R123)."),
        ]
        out.append(
            Trajectory(
                run_id=run, task_id=f"life-1-{i:07d}", split="train", hcp_id="h" * 12, reward=float(i % 2),
                messages=messages, stage=("evolve", "select", "report")[i % 3], prompt_tokens=300,
                completion_tokens=40,
            )
        )  # fmt: skip
    return out


class DuckFile:
    """Today's store: one DuckDB file; a writer opens it for each commit (one writing process at a time)."""

    name = "duckdb-file"

    def __init__(self, folder: Path) -> None:
        self.path = folder / "store.duckdb"

    def writer(self, index: int) -> Any:
        return _StoreCommits(self.path, hold=False)

    def count(self) -> int:
        import duckdb

        with duckdb.connect(str(self.path), read_only=True) as con:
            return con.execute("SELECT count(*) FROM trajectories").fetchone()[0]

    def read(self) -> float:
        import duckdb

        started = time.perf_counter()
        with duckdb.connect(str(self.path), read_only=True) as con:
            con.execute(READER).fetchall()
        return time.perf_counter() - started

    def load(self, rows: int) -> None:
        _bulk(_StoreCommits(self.path, hold=True), rows)

    def close(self) -> None:
        pass


class DuckPerRun:
    """One DuckDB file per writer, held open; the reader attaches them all."""

    name = "duckdb-per-run"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def writer(self, index: int) -> Any:
        return _StoreCommits(self.folder / f"run-{index}.duckdb", hold=True)

    def _attached(self) -> Any:
        import duckdb

        con = duckdb.connect()
        files = sorted(self.folder.glob("run-*.duckdb"))
        for i, path in enumerate(files):
            con.execute(f"ATTACH '{path}' AS r{i} (READ_ONLY)")
        union = " UNION ALL ".join(f"SELECT * FROM r{i}.trajectories" for i in range(len(files)))
        con.execute(f"CREATE TEMP VIEW trajectories AS {union}")
        return con

    def count(self) -> int:
        with self._attached() as con:
            return con.execute("SELECT count(*) FROM trajectories").fetchone()[0]

    def read(self) -> float:
        started = time.perf_counter()
        with self._attached() as con:
            con.execute(READER).fetchall()
        return time.perf_counter() - started

    def load(self, rows: int) -> None:
        _bulk(self.writer(0), rows)

    def close(self) -> None:
        pass


class _StoreCommits:
    """A writer's commits through the project's Store (opened per commit unless ``hold``)."""

    def __init__(self, path: Path | str, hold: bool) -> None:
        self.path, self.hold, self.store = path, hold, None

    def warm(self) -> None:
        """Imports done (and a held file opened) before the clock starts."""
        from autoevolve.store import Store

        if self.hold:
            self.store = Store(self.path, publish_every_s=None, wait_s=3600)

    def commit(self, trajs: list[Any]) -> None:
        from autoevolve.store import Store

        if self.store is None:
            self.store = Store(self.path, publish_every_s=None, wait_s=3600)
        self.store.put_trajectories(trajs)
        if not self.hold:
            self.store.close()
            self.store = None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class Postgres:
    """One PostgreSQL server of its own (``LocalServer``: a temporary cluster on a Unix socket); a writer keeps one
    connection."""

    name = "postgresql"

    def __init__(self, folder: Path) -> None:
        from autoevolve.store import Store
        from autoevolve.store.postgres import LocalServer

        self.server = LocalServer()
        self.dsn = self.server.url
        Store(self.dsn).close()  # migrated once, before the writers start

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.dsn, autocommit=False)

    def writer(self, index: int) -> Any:
        return _StoreCommits(self.dsn, hold=True)

    def count(self) -> int:
        with self._connect() as con:
            return con.execute("SELECT count(*) FROM trajectories").fetchone()[0]

    def read(self) -> float:
        started = time.perf_counter()
        with self._connect() as con:
            con.execute(READER).fetchall()
        return time.perf_counter() - started

    def load(self, rows: int) -> None:
        _bulk(self.writer(0), rows)

    def close(self) -> None:
        self.server.stop()


class DuckLake:
    """DuckLake with a SQLite catalog; its writers run ``bench/ducklake_writer.py`` under ``python`` (see the module
    docstring)."""

    name = "ducklake"
    python: str | None = None  # --ducklake-python
    helper = str(ROOT / "bench" / "ducklake_writer.py")

    def __init__(self, folder: Path) -> None:
        import duckdb

        from autoevolve.store import TRAJ_COLS, Store

        self.folder, self.where = folder, [str(folder / "catalog.sqlite"), f"{folder / 'data'}/"]
        Store(folder / "schema.duckdb").close()
        with duckdb.connect(str(folder / "schema.duckdb"), read_only=True) as con:
            types = {name: kind for name, kind, *_ in con.execute("DESCRIBE trajectories").fetchall()}
        (folder / "schema.json").write_text(json.dumps([(c, types[c]) for c in TRAJ_COLS]))
        self._run("init", str(folder / "schema.json"))

    def _run(self, action: str, *args: str) -> str:
        command = [str(self.python), self.helper, action, *self.where, *args]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    def writer(self, index: int) -> Any:
        return _LakeCommits(self, index)

    def count(self) -> int:
        return int(self._run("count"))

    def read(self) -> float:
        return float(self._run("read", READER))  # timed inside the writer process, its start left out

    def load(self, rows: int) -> None:
        _bulk(self.writer(0), rows)

    def close(self) -> None:
        pass


class _LakeCommits:
    """A writer process holding the lake attached; each commit hands it the chunk as a Parquet file."""

    def __init__(self, lake: DuckLake, index: int) -> None:
        self.lake, self.index, self.commits, self.proc = lake, index, 0, None

    def warm(self) -> None:
        command = [str(self.lake.python), self.lake.helper, "write", *self.lake.where]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready", "the DuckLake writer did not start"

    def commit(self, trajs: list[Any]) -> None:
        import pyarrow.parquet as pq

        from autoevolve.store.base import _traj_table

        if self.proc is None:
            self.warm()
        path = self.lake.folder / f"writer-{self.index}-{self.commits}.parquet"
        self.commits += 1
        pq.write_table(_traj_table(trajs), path)
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        said = self.proc.stdout.readline().strip()
        assert said.startswith("ok"), said or "the DuckLake writer exited"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


ENGINES = {e.name: e for e in (DuckFile, DuckPerRun, DuckLake, Postgres)}


def _bulk(writer: Any, rows: int, chunk: int = 20_000) -> None:
    """``rows`` trajectories over 16 runs, in large commits (the reader's table)."""
    for first in range(0, rows, chunk):
        writer.commit(trajectories(f"run-{first * 16 // rows:02d}", first, min(chunk, rows - first)))
    writer.close()


def _write(engine: Any, index: int, chunks: int, rows: int, ready: Any, out: Any) -> None:
    """One writer process: its trajectories made and its store opened first, then (once every writer is ready)
    its commits, each one's latency sent back with when the commits began and ended."""
    writer = engine.writer(index)
    batches = [trajectories(f"writer-{index:02d}", c * rows, rows) for c in range(chunks)]
    writer.warm()
    ready.wait()
    began, latencies, failure = time.perf_counter(), [], None
    try:
        for batch in batches:
            started = time.perf_counter()
            writer.commit(batch)
            latencies.append(time.perf_counter() - started)
    except Exception as exc:  # a writer that gives up is part of the cell's result, not a hang of the bench
        failure = f"writer {index} after {len(latencies)} commits: {exc}"
    out.put((latencies, began, time.perf_counter(), failure))
    with contextlib.suppress(OSError):
        writer.close()


def cell(kind: type, writers: int, chunks: int, rows: int) -> dict[str, Any]:
    """N writer processes on a fresh store of one engine: throughput, commit latency, rows landed."""
    folder = Path(tempfile.mkdtemp(prefix=f"writers-{kind.name}-"))
    engine = kind(folder)
    try:
        if kind is DuckFile:  # the schema made once, before the writers race to open the file
            _StoreCommits(engine.path, hold=False).commit([])
        ctx = mp.get_context("fork")
        out, ready = ctx.Queue(), ctx.Barrier(writers)
        procs = [ctx.Process(target=_write, args=(engine, i, chunks, rows, ready, out)) for i in range(writers)]
        for p in procs:
            p.start()
        results = [out.get() for _ in procs]
        for p in procs:
            p.join()
        wall = max(end for _, _, end, _ in results) - min(began for _, began, _, _ in results)
        latencies = sorted(x for lat, _, _, _ in results for x in lat)
        failures = [failure for *_, failure in results if failure]
        landed = engine.count()
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    p50 = round(statistics.median(latencies), 4) if latencies else None
    p99 = round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4) if latencies else None
    return {
        "engine": kind.name, "writers": writers, "rows": writers * chunks * rows, "landed": landed,
        "seconds": round(wall, 2), "per_s": round(landed / wall, 1), "p50_s": p50, "p99_s": p99,
        "failed_writers": len(failures), "failures": failures,
    }  # fmt: skip


def reader(kind: type, rows: int) -> dict[str, Any]:
    """The reader's query over ``rows`` trajectories loaded in bulk (the load's time printed too)."""
    folder = Path(tempfile.mkdtemp(prefix=f"reader-{kind.name}-"))
    engine = kind(folder)
    try:
        started = time.perf_counter()
        engine.load(rows)
        loaded = time.perf_counter() - started
        seconds = min(engine.read() for _ in range(3))
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {"engine": kind.name, "rows": rows, "load_s": round(loaded, 1), "query_s": round(seconds, 3)}


def missing(kind: type) -> str | None:
    """Why an engine cannot run here, or None."""
    if kind is DuckLake:
        if not kind.python:
            return "needs --ducklake-python: an interpreter with duckdb 1.4, duckdb-ext-ducklake and duckdb-ext-sqlite"
        check = "import duckdb; assert duckdb.__version__.startswith('1.'), duckdb.__version__"
        said = subprocess.run([kind.python, "-c", check], capture_output=True, text=True)
        return None if said.returncode == 0 else f"{kind.python} cannot run it: {said.stderr.strip()[-200:]}"
    if kind is not Postgres:
        return None
    from autoevolve.store.postgres import LocalServer

    if LocalServer.tool("initdb") is None:
        return "PostgreSQL's server is not installed (Debian: apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    return None


def _seconds(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>7.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--writers", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--chunks", type=int, default=40, help="commits per writer")
    parser.add_argument("--rows", type=int, default=64, help="trajectories per commit")
    parser.add_argument("--reader-rows", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--ducklake-python", help="an interpreter with duckdb 1.4 and DuckLake's extensions")
    args = parser.parse_args()
    DuckLake.python = args.ducklake_python
    cells, reads, skipped = [], [], {}
    columns = ("writers", "rows", "landed", "traj/s", "x one", "p50 s", "p99 s")
    print(f"{'engine':<15} " + " ".join(f"{c:>{9 if c == 'traj/s' else 7}}" for c in columns), flush=True)
    for name in args.engines:
        kind = ENGINES[name]
        if why := missing(kind):
            skipped[name] = why
            print(f"{name:<15} skipped: {why}", flush=True)
            continue
        one = None
        for n in args.writers:
            row = cell(kind, n, args.chunks, args.rows)
            one = one or row["per_s"]
            row["vs_one"] = round(row["per_s"] / one, 2)
            cells.append(row)
            print(
                f"{name:<15} {n:>7} {row['rows']:>7} {row['landed']:>7} {row['per_s']:>9.1f} {row['vs_one']:>6.2f} "
                f"{_seconds(row['p50_s'])} {_seconds(row['p99_s'])}",
                flush=True,
            )
            for failure in row["failures"]:
                print(f"{'':<15} gave up: {failure}", flush=True)
    print(f"\n{'engine':<15} {'rows':>9} {'load s':>7} {'query s':>8}")
    for name in args.engines:
        if name in skipped:
            continue
        row = reader(ENGINES[name], args.reader_rows)
        reads.append(row)
        print(f"{name:<15} {row['rows']:>9} {row['load_s']:>7.1f} {row['query_s']:>8.3f}", flush=True)
    checks = []
    for name in {c["engine"] for c in cells}:
        top = max((c for c in cells if c["engine"] == name), key=lambda c: c["writers"])
        ok = (
            top["vs_one"] >= 4
            and top["p99_s"] is not None
            and top["p99_s"] <= 1
            and all(c["landed"] == c["rows"] for c in cells if c["engine"] == name)
        )
        checks.append(
            f"{name}: {top['writers']} writers {top['vs_one']:.2f}x one writer (>= 4x), "
            f"p99 {_seconds(top['p99_s']).strip()} s (<= 1 s), every row once: {'PASS' if ok else 'FAIL'}"
        )
    for row in reads:
        verdict = "PASS" if row["query_s"] <= 1 else "FAIL"
        checks.append(f"{row['engine']}: reader over {row['rows']} rows {row['query_s']:.3f} s (<= 1 s): {verdict}")
    print("\n" + "\n".join(sorted(checks)))
    write_json(args.json, {"cells": cells, "reader": reads, "skipped": skipped, "checks": sorted(checks)})


if __name__ == "__main__":
    main()
