"""DuckDB trajectory store: runs, HCP configs, trajectories, candidates, selections, adapters, evaluations.

All SQL of the project lives here; other modules ask questions by method name.
The schema grows through numbered migrations recorded in ``schema_migrations`` (sqlite-utils style).
One ``Store`` wraps one DuckDB connection, which is not safe to share between threads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import duckdb
import pyarrow as pa
from pydantic import BaseModel, TypeAdapter

from autoevolve.migrations import LATEST_VERSION, MIGRATIONS
from autoevolve.records import (
    AdapterRecord,
    Candidate,
    EvalReport,
    Expert,
    Message,
    RegistryEvent,
    SelectedTrajectory,
    Selection,
    Trajectory,
)

R = TypeVar("R", bound=BaseModel)


_MESSAGES = TypeAdapter(list[Message])

# Column names are the record field names, so a field added to a record without a migration fails loudly.
TRAJ_KEY = ("run_id", "hcp_id", "adapter", "task_id", "sample")
TRAJ_COLS = tuple(Trajectory.model_fields)
CAND_COLS = tuple(Candidate.model_fields)
_CAND_JSON = ("parents", "components", "minibatch", "parent_minibatch", "scores", "spreads")
SEL_COLS = tuple(f for f in Selection.model_fields if f != "items")
ITEM_COLS = tuple(SelectedTrajectory.model_fields)
ADAPTER_COLS = tuple(AdapterRecord.model_fields)
EXPERT_COLS = tuple(Expert.model_fields)
EVENT_COLS = tuple(c for c in RegistryEvent.model_fields if c != "at")  # 'at' is the row's created_at
_TRAJ_INTS = {"sample", "tier", "round", "prompt_tokens", "completion_tokens", "schema_version"}
# Explicit types so an all-empty or all-int column does not make Arrow guess wrong.
_TRAJ_ARROW = pa.schema(
    [
        (c, pa.int64() if c in _TRAJ_INTS else pa.float64() if c in ("reward", "latency_s") else pa.string())
        for c in TRAJ_COLS
    ]
)


def _cols(cols: Sequence[str]) -> str:
    """Comma-joined column list."""
    return ", ".join(cols)


def _marks(n: int) -> str:
    """Comma-joined ``?`` placeholders."""
    return ", ".join("?" * n)


def _upsert_sql(table: str, cols: Sequence[str], key: Sequence[str], touch: bool = True) -> str:
    """INSERT that replaces every non-key column on key conflict (and bumps updated_at)."""
    sets = [f"{c} = excluded.{c}" for c in cols if c not in key]
    if touch:
        sets.append("updated_at = now()")
    return (
        f"INSERT INTO {table} ({_cols(cols)}) VALUES ({_marks(len(cols))}) "
        f"ON CONFLICT ({_cols(key)}) DO UPDATE SET {', '.join(sets)}"
    )


def _to_row(record: BaseModel, cols: Sequence[str], json_cols: Sequence[str] = ()) -> list[Any]:
    """Column values of a flat record, dict-valued fields as JSON text."""
    return [json.dumps(getattr(record, c)) if c in json_cols else getattr(record, c) for c in cols]


def _from_row(cls: type[R], cols: Sequence[str], row: Sequence[Any], json_cols: Sequence[str] = ()) -> R:
    """Rebuild a flat record from a row written by ``_to_row``."""
    data = {c: json.loads(v) if c in json_cols else v for c, v in zip(cols, row, strict=True)}
    return cls.model_validate(data)


def _traj_from_row(row: Sequence[Any]) -> Trajectory:
    """Rebuild a trajectory from a row selected with ``TRAJ_COLS``."""
    data = dict(zip(TRAJ_COLS, row, strict=True))
    data["messages"] = _MESSAGES.validate_json(data["messages"])
    return Trajectory.model_validate(data)


def _traj_table(trajs: Sequence[Trajectory]) -> pa.Table:
    """One Arrow table of trajectories, messages serialized to JSON text."""
    columns = {c: [getattr(t, c) for t in trajs] for c in TRAJ_COLS if c != "messages"}
    columns["messages"] = [_MESSAGES.dump_json(t.messages).decode() for t in trajs]
    return pa.table(columns, schema=_TRAJ_ARROW)


class StoreBusy(RuntimeError):
    """Another process holds the database file (DuckDB allows one writer, and readers only without one)."""


class Store:
    """The project's DuckDB database: one file, migrated on open, every query by name."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        """Open (and, when writable, create and migrate) the database at ``path``."""
        self.path = Path(path)
        self.read_only = read_only
        if read_only and not self.path.exists():
            raise FileNotFoundError(f"no store at {self.path} to open read-only")
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower():
                raise
            held = re.search(r"PID \d+", str(exc))
            by = f" ({held.group(0)})" if held else ""
            raise StoreBusy(
                f"{self.path} is held by another process{by}, e.g. a running round; retry when it ends"
            ) from None
        try:
            self._check_version()
            if not read_only:
                self._migrate()
        except BaseException:
            self.con.close()
            raise

    def __enter__(self) -> Self:
        """Enter a ``with`` block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on leaving a ``with`` block."""
        self.close()

    def close(self) -> None:
        """Close the connection; safe to call twice."""
        self.con.close()

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement and fetch every row, so no half-read result blocks the connection."""
        return self.con.execute(sql, list(params)).fetchall()

    def _one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """First row of one statement, or None."""
        rows = self._all(sql, params)
        return rows[0] if rows else None

    def _write(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one write statement; returns the rows it changed (0 for DDL)."""
        row = self._one(sql, params)
        return int(row[0]) if row and isinstance(row[0], int) else 0

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """Run a block in one transaction: all of it lands or none of it."""
        self.con.begin()
        try:
            yield
        except BaseException:
            self.con.rollback()
            raise
        self.con.commit()

    # -- schema ---------------------------------------------------------------------------------

    def _applied(self) -> set[int]:
        """Versions recorded in schema_migrations (empty for a fresh file)."""
        exists = self._one("SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_migrations'")
        if not exists or not exists[0]:
            return set()
        return {v for (v,) in self._all("SELECT version FROM schema_migrations")}

    def _check_version(self) -> None:
        """Refuse a file written by newer code: its tables may mean things this code does not know."""
        found = self.schema_version()
        if found > LATEST_VERSION:
            raise RuntimeError(
                f"store {self.path} has schema version {found}, but this code knows only up to version "
                f"{LATEST_VERSION}; upgrade autoevolve to open it"
            )

    def _migrate(self) -> list[int]:
        """Apply every migration not yet recorded, one transaction each; returns the versions applied."""
        self._write(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            "version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP DEFAULT current_timestamp)"
        )
        applied = self._applied()
        done = []
        for version, name, sql in sorted(MIGRATIONS):
            if version in applied:
                continue
            with self._tx():
                self._write(sql)
                self._write("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [version, name])
            done.append(version)
        return done

    def schema_version(self) -> int:
        """Highest migration version recorded in the file (0 for a fresh file)."""
        return max(self._applied(), default=0)

    def migrations(self) -> list[tuple[int, str]]:
        """Recorded migrations as (version, name), oldest first."""
        if not self._applied():
            return []
        rows = self._all("SELECT version, name FROM schema_migrations ORDER BY version")
        return [(v, n) for v, n in rows]

    # -- runs and HCP configs -----------------------------------------------------------------------

    def put_run(self, run_id: str, config: dict) -> None:
        """Record a run and its config; the first write wins, so re-putting is a no-op."""
        self._write(
            "INSERT INTO runs (run_id, config) VALUES (?, ?) ON CONFLICT DO NOTHING", [run_id, json.dumps(config)]
        )

    def run_config(self, run_id: str) -> dict | None:
        """Config a run was recorded with, or None if the run is unknown."""
        row = self._one("SELECT config FROM runs WHERE run_id = ?", [run_id])
        return json.loads(row[0]) if row else None

    def runs(self) -> list[str]:
        """Run ids, oldest first."""
        return [r[0] for r in self._all("SELECT run_id FROM runs ORDER BY created_at, run_id")]

    def put_hcp(self, hcp_id: str, name: str, body: dict) -> None:
        """Record an HCP config under its content hash; re-putting is a no-op."""
        self._write(
            "INSERT INTO hcp_configs (hcp_id, name, body) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            [hcp_id, name, json.dumps(body)],
        )

    def get_hcp(self, hcp_id: str) -> dict:
        """Body of the HCP config stored under ``hcp_id``."""
        row = self._one("SELECT body FROM hcp_configs WHERE hcp_id = ?", [hcp_id])
        if not row:
            raise KeyError(f"no HCP config {hcp_id!r} in {self.path}")
        return json.loads(row[0])

    # -- trajectories -------------------------------------------------------------------------------

    def put_trajectories(self, trajs: Sequence[Trajectory]) -> int:
        """Bulk-insert trajectories in one statement, skipping keys already stored; returns rows inserted."""
        if not trajs:
            return 0
        incoming = _traj_table(trajs)
        incoming = incoming.append_column("ord", pa.array(range(len(trajs)), pa.int64()))
        # Within one batch the first row of a duplicated key wins, matching the row-wise path.
        sql = (
            f"INSERT INTO trajectories ({_cols(TRAJ_COLS)}) "
            f"SELECT {_cols(TRAJ_COLS)} FROM incoming "
            f"QUALIFY row_number() OVER (PARTITION BY {_cols(TRAJ_KEY)} ORDER BY ord) = 1 "
            "ON CONFLICT DO NOTHING"
        )
        self.con.register("incoming", incoming)
        try:
            with self._tx():
                inserted = self._write(sql)
        finally:
            self.con.unregister("incoming")
        return inserted

    def put_trajectories_rowwise(self, trajs: Sequence[Trajectory]) -> int:
        """Same as ``put_trajectories`` but one INSERT per row; kept only so a benchmark can compare."""
        sql = f"INSERT INTO trajectories ({_cols(TRAJ_COLS)}) VALUES ({_marks(len(TRAJ_COLS))}) ON CONFLICT DO NOTHING"
        inserted = 0
        with self._tx():
            for t in trajs:
                values = [
                    _MESSAGES.dump_json(t.messages).decode() if c == "messages" else getattr(t, c) for c in TRAJ_COLS
                ]
                inserted += self._write(sql, values)
        return inserted

    def trajectories(
        self,
        run_id: str,
        *,
        hcp_id: str | None = None,
        adapter: str | None = None,
        split: str | None = None,
        task_ids: Sequence[str] | None = None,
        stage: str | None = None,
        round: int | None = None,
        min_reward: float | None = None,
    ) -> list[Trajectory]:
        """Trajectories of a run matching every given filter, ordered by task_id, sample."""
        where, params = ["run_id = ?"], [run_id]
        for col, value in (
            ("hcp_id", hcp_id),
            ("adapter", adapter),
            ("split", split),
            ("stage", stage),
            ("round", round),
        ):
            if value is not None:
                where.append(f"{col} = ?")
                params.append(value)
        if task_ids is not None:
            where.append("list_contains(?::VARCHAR[], task_id)")
            params.append(list(task_ids))
        if min_reward is not None:
            where.append("reward >= ?")
            params.append(min_reward)
        rows = self._all(
            f"SELECT {_cols(TRAJ_COLS)} FROM trajectories WHERE {' AND '.join(where)} "
            "ORDER BY task_id, sample, hcp_id, adapter",
            params,
        )
        return [_traj_from_row(r) for r in rows]

    def count_trajectories(self, run_id: str | None = None, round: int | None = None) -> int:
        """Number of stored trajectories: of all runs, of one run, or of one round of a run."""
        where, params = [], []
        for column, value in (("run_id", run_id), ("round", round)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        sql = "SELECT count(*) FROM trajectories" + (" WHERE " + " AND ".join(where) if where else "")
        row = self._one(sql, params)
        return int(row[0]) if row else 0

    def mean_rewards(
        self, run_id: str, hcp_id: str, adapter: str, task_ids: Sequence[str] | None = None
    ) -> dict[str, float]:
        """Mean reward over samples per task_id, for one config and adapter."""
        sql = "SELECT task_id, avg(reward) FROM trajectories WHERE run_id = ? AND hcp_id = ? AND adapter = ?"
        params: list[Any] = [run_id, hcp_id, adapter]
        if task_ids is not None:
            sql += " AND list_contains(?::VARCHAR[], task_id)"
            params.append(list(task_ids))
        rows = self._all(sql + " GROUP BY task_id ORDER BY task_id", params)
        return {task_id: float(mean) for task_id, mean in rows}

    # -- candidates and selections -----------------------------------------------------------------

    def put_candidate(self, c: Candidate) -> None:
        """Insert a candidate, or replace status, scores and the rest of an existing (run, round, hcp) row."""
        self._write(
            _upsert_sql("candidates", CAND_COLS, ("run_id", "round", "hcp_id")), _to_row(c, CAND_COLS, _CAND_JSON)
        )

    def candidates(self, run_id: str, round: int | None = None) -> list[Candidate]:
        """Candidates of a run (optionally one round) in first-insertion order."""
        sql = f"SELECT {_cols(CAND_COLS)} FROM candidates WHERE run_id = ?"
        params: list[Any] = [run_id]
        if round is not None:
            sql += " AND round = ?"
            params.append(round)
        rows = self._all(sql + " ORDER BY seq", params)
        return [_from_row(Candidate, CAND_COLS, r, _CAND_JSON) for r in rows]

    def put_selection(self, s: Selection) -> None:
        """Store a selection with its items; the first write of an id wins, so re-putting is a no-op."""
        with self._tx():
            fresh = self._write(
                f"INSERT INTO selections ({_cols(SEL_COLS)}) VALUES ({_marks(len(SEL_COLS))}) ON CONFLICT DO NOTHING",
                _to_row(s, SEL_COLS),
            )
            if fresh and s.items:
                self.con.executemany(
                    f"INSERT INTO selection_items (selection_id, position, {_cols(ITEM_COLS)}) "
                    f"VALUES ({_marks(len(ITEM_COLS) + 2)})",
                    [[s.id, i, *_to_row(item, ITEM_COLS)] for i, item in enumerate(s.items)],
                )

    def _selections(self, where: str, params: list[Any]) -> list[Selection]:
        """Selections matching a WHERE clause, with their items, in insertion order."""
        heads = [
            dict(zip(SEL_COLS, h, strict=True))
            for h in self._all(f"SELECT {_cols(SEL_COLS)} FROM selections WHERE {where} ORDER BY seq", params)
        ]
        items: dict[str, list[SelectedTrajectory]] = {h["id"]: [] for h in heads}
        rows = self._all(
            f"SELECT selection_id, {_cols(ITEM_COLS)} FROM selection_items "
            "WHERE list_contains(?::VARCHAR[], selection_id) ORDER BY selection_id, position",
            [list(items)],
        )
        for sel_id, *rest in rows:
            items[sel_id].append(_from_row(SelectedTrajectory, ITEM_COLS, rest))
        return [Selection.model_validate({**h, "items": items[h["id"]]}) for h in heads]

    def selection(self, selection_id: str) -> Selection:
        """The selection stored under ``selection_id``."""
        found = self._selections("id = ?", [selection_id])
        if not found:
            raise KeyError(f"no selection {selection_id!r} in {self.path}")
        return found[0]

    def selections(self, run_id: str) -> list[Selection]:
        """Selections of a run in insertion order."""
        return self._selections("run_id = ?", [run_id])

    # -- adapters ---------------------------------------------------------------------------------

    def put_adapter(self, a: AdapterRecord) -> None:
        """Insert an adapter version, or replace the existing (name, version) row (e.g. a new status).

        Only the expert's live version may carry the status 'promoted': ``set_live`` moves it, in one transaction.
        """
        if a.status == "promoted":
            live = self.promoted_adapter(a.name)
            if live is None or live.version != a.version:
                raise ValueError(f"{a.ref}: a version becomes 'promoted' only through set_live (registry.promote)")
        self._write(_upsert_sql("adapters", ADAPTER_COLS, ("name", "version")), _to_row(a, ADAPTER_COLS, ("eval",)))

    def adapters(self, name: str | None = None) -> list[AdapterRecord]:
        """Adapter versions, of one expert or all, ordered by name then version."""
        sql = f"SELECT {_cols(ADAPTER_COLS)} FROM adapters"
        params: list[Any] = []
        if name is not None:
            sql += " WHERE name = ?"
            params.append(name)
        rows = self._all(sql + " ORDER BY name, version", params)
        return [_from_row(AdapterRecord, ADAPTER_COLS, r, ("eval",)) for r in rows]

    def adapter(self, name: str, version: int) -> AdapterRecord:
        """One adapter version."""
        row = self._one(f"SELECT {_cols(ADAPTER_COLS)} FROM adapters WHERE name = ? AND version = ?", [name, version])
        if not row:
            raise KeyError(f"no adapter {name}@v{version} in {self.path}")
        return _from_row(AdapterRecord, ADAPTER_COLS, row, ("eval",))

    def next_adapter_version(self, name: str) -> int:
        """Version number the next adapter of ``name`` should take (1 if none yet)."""
        row = self._one("SELECT coalesce(max(version), 0) + 1 FROM adapters WHERE name = ?", [name])
        return int(row[0]) if row else 1

    def promoted_adapter(self, name: str) -> AdapterRecord | None:
        """The expert's live version, or None when the bare base model serves it (or the expert is unknown)."""
        row = self._one(
            f"SELECT {_cols(ADAPTER_COLS)} FROM adapters WHERE name = ? "
            "AND version = (SELECT live_version FROM experts WHERE name = ?)",
            [name, name],
        )
        return _from_row(AdapterRecord, ADAPTER_COLS, row, ("eval",)) if row else None

    # -- experts and their live version -------------------------------------------------------------

    def put_expert(self, e: Expert) -> None:
        """Insert an expert or update its metadata; its live version changes only through ``set_live``."""
        cols = tuple(c for c in EXPERT_COLS if c != "live_version")
        self._write(_upsert_sql("experts", cols, ("name",)), _to_row(e, cols))

    def experts(self) -> list[Expert]:
        """Every expert, ordered by tier then name."""
        rows = self._all(f"SELECT {_cols(EXPERT_COLS)} FROM experts ORDER BY tier, name")
        return [_from_row(Expert, EXPERT_COLS, r) for r in rows]

    def expert(self, name: str) -> Expert:
        """One expert; KeyError naming the known ones if there is none of that name."""
        row = self._one(f"SELECT {_cols(EXPERT_COLS)} FROM experts WHERE name = ?", [name])
        if not row:
            known = ", ".join(e.name for e in self.experts()) or "none yet"
            raise KeyError(f"no expert {name!r} in {self.path} (known: {known})")
        return _from_row(Expert, EXPERT_COLS, row)

    def set_live(
        self,
        name: str,
        version: int | None,
        action: str,
        detail: str = "",
        eval: dict[str, Any] | None = None,
        retries: int = 5,
    ) -> int | None:
        """Make ``version`` (None: the bare base model) the expert's live version; returns the previous one.

        One transaction: the old live row becomes 'retired', the new one 'promoted' (its reason = ``detail``, and
        ``eval`` when given), the expert's live_version moves and the event is written. All of it lands or none, so
        a reader never sees zero or two live versions. A concurrent change of the same expert conflicts in DuckDB;
        the loser retries on the new state.
        """
        for attempt in range(retries + 1):
            try:
                with self._tx():
                    return self._set_live(name, version, action, detail, eval)
            except duckdb.TransactionException:
                if attempt == retries:
                    raise StoreBusy(
                        f"{self.path}: {name}'s live version kept changing under {retries} retries"
                    ) from None
        raise AssertionError("unreachable")

    def _set_live(self, name: str, version: int | None, action: str, detail: str, eval: dict | None) -> int | None:
        """The steps of ``set_live``, inside its transaction."""
        previous = self.expert(name).live_version
        if previous is not None and previous != version:
            self._write(
                "UPDATE adapters SET status = 'retired', updated_at = current_timestamp WHERE name = ? AND version = ?",
                [name, previous],
            )
        if version is not None:
            changed = self._write(
                "UPDATE adapters SET status = 'promoted', reason = ?, eval = coalesce(?, eval), "
                "updated_at = current_timestamp WHERE name = ? AND version = ?",
                [detail, None if eval is None else json.dumps(eval), name, version],
            )
            if not changed:
                raise KeyError(f"no adapter {name}@v{version} in {self.path}")
        self._write(
            "UPDATE experts SET live_version = ?, updated_at = current_timestamp WHERE name = ?", [version, name]
        )
        self.put_event(
            RegistryEvent(expert=name, action=action, version=version, previous_version=previous, detail=detail)
        )
        return previous

    def put_event(self, e: RegistryEvent) -> None:
        """Append one event to the registry's history."""
        self._write(
            f"INSERT INTO registry_events ({_cols(EVENT_COLS)}) VALUES ({_marks(len(EVENT_COLS))})",
            _to_row(e, EVENT_COLS),
        )

    def events(self, name: str | None = None) -> list[RegistryEvent]:
        """The registry's history, of one expert or all, oldest first."""
        where, params = ("WHERE expert = ?", [name]) if name is not None else ("", [])
        rows = self._all(
            f"SELECT {_cols(EVENT_COLS)}, created_at FROM registry_events {where} ORDER BY created_at, rowid", params
        )
        return [_from_row(RegistryEvent, (*EVENT_COLS, "at"), r) for r in rows]

    def adapter_created(self, name: str) -> dict[int, datetime]:
        """When each version of an expert was registered."""
        return dict(self._all("SELECT version, created_at FROM adapters WHERE name = ?", [name]))

    # -- evaluations ------------------------------------------------------------------------------

    def put_evaluation(self, r: EvalReport) -> None:
        """Insert an evaluation report, or replace the one for the same (run, round, split)."""
        self._write(
            _upsert_sql("evaluations", ("run_id", "round", "split", "decision", "body"), ("run_id", "round", "split")),
            [r.run_id, r.round, r.split, r.decision, r.model_dump_json()],
        )

    def evaluations(self, run_id: str) -> list[EvalReport]:
        """Evaluation reports of a run, ordered by round then split."""
        rows = self._all("SELECT body FROM evaluations WHERE run_id = ? ORDER BY round, split", [run_id])
        return [EvalReport.model_validate_json(body) for (body,) in rows]
