"""The store's connection: opening, locking, transactions and schema migrations; row helpers for the tables."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TypeVar

import duckdb
import pyarrow as pa
from pydantic import BaseModel, TypeAdapter

from autoevolve.records import (
    AdapterRecord,
    Candidate,
    Expert,
    Message,
    RegistryEvent,
    SelectedTrajectory,
    Selection,
    Trajectory,
)
from autoevolve.store.migrations import LATEST_VERSION, MIGRATIONS
from autoevolve.store.postgres import PgConnection, conflict_errors, is_url, shown
from autoevolve.store.snapshot import is_lock_error, private_copy, publish, snapshot_path

R = TypeVar("R", bound=BaseModel)
MIGRATION_LOCK = 0x6175746F  # the PostgreSQL advisory lock a migrating process holds


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


class StoreError(RuntimeError):
    """A store this code cannot open; the message names the file and what to do."""


class StoreBusy(StoreError):
    """Another process holds the database file (DuckDB allows one writer, and readers only without one)."""


class StoreTooNew(StoreError):
    """The file was written by a newer autoevolve whose schema this code does not know."""


class StoreUnreadable(StoreError):
    """The file is not a DuckDB database."""


def _unreadable(exc: duckdb.Error, path: Path) -> StoreUnreadable | None:
    """The error to raise for a file DuckDB refused as not a database, else None."""
    if "not a valid DuckDB database" not in str(exc):
        return None
    return StoreUnreadable(
        f"{path} is not a DuckDB database: point --store (or the run config's store:) at an autoevolve store, "
        "e.g. trajectories/autoevolve.duckdb, or at a path that does not exist yet to start a new one"
    )


class Connection:
    """One DuckDB file (or PostgreSQL database: a ``postgresql://`` URL), migrated on open; the table mixins run their
    SQL through ``_all``/``_one``/``_write``."""

    def __init__(
        self, path: str | Path, read_only: bool = False, publish_every_s: float | None = 15.0, wait_s: float = 10.0
    ) -> None:
        """Open (and, when writable, create and migrate) the database at ``path``.

        A writable store publishes a snapshot for readers at most every ``publish_every_s`` seconds of writing
        (None: never) and when it closes. A file held by another process is retried for ``wait_s`` seconds.
        """
        self.url = str(path) if is_url(path) else None  # a PostgreSQL database (autoevolve.store.postgres)
        self.path: Any = shown(str(path)) if self.url else Path(path)  # what messages name
        self.read_only = read_only
        self.publish_every_s = None if read_only or self.url else publish_every_s  # PostgreSQL readers need none
        self._published = 0.0
        self._in_tx = False
        self._private: Path | None = None  # the temporary folder of a snapshot's private copy
        self.conflicts: tuple[type[Exception], ...] = (duckdb.TransactionException,)
        if self.url:
            self.conflicts = conflict_errors()
        elif read_only and not self.path.exists():
            raise FileNotFoundError(f"no store at {self.path} to open read-only")
        elif not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.con: Any = self._connect_url(read_only) if self.url else self._connect(wait_s)
        try:
            self._check_version()
            if not read_only:
                self._migrate()
            self._publish()
        except BaseException:
            self.con.close()
            raise

    @classmethod
    def snapshot(cls, path: str | Path, wait_s: float = 10.0) -> Self:
        """The store at ``path`` for reading while a round may be writing it: a private copy, deleted on close.

        The copy is of the file, or of its writer's last published snapshot (at most ``publish_every_s`` old);
        reading it never blocks the writer, and an older schema is migrated in the copy, never in the original.
        """
        if is_url(path):  # a read-only PostgreSQL store reads one snapshot for as long as it is open
            return cls(path, read_only=True)
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no store at {path}")
        try:
            copy = private_copy(path, wait_s)
        except TimeoutError as exc:
            raise StoreBusy(str(exc)) from None
        except duckdb.Error as exc:
            raise (_unreadable(exc, path) or exc) from None
        try:
            store = cls(copy, publish_every_s=None)
        except BaseException as exc:
            shutil.rmtree(copy.parent, ignore_errors=True)
            if isinstance(exc, StoreTooNew):
                raise StoreTooNew(str(exc).replace(str(copy), str(path))) from None
            raise
        store._private, store.path = copy.parent, path  # messages name the store the reader asked for
        return store

    def _connect_url(self, read_only: bool) -> PgConnection:
        """Connect to the PostgreSQL database; StoreError naming it when it cannot be reached."""
        try:
            return PgConnection(str(self.url), read_only)
        except ConnectionError as exc:
            raise StoreError(f"{exc}; check the URL in store:, and that the server runs") from None

    def _connect(self, wait_s: float) -> duckdb.DuckDBPyConnection:
        """Connect, retrying while another process holds the file; StoreBusy naming it after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=self.read_only)
            except duckdb.IOException as exc:
                if unreadable := _unreadable(exc, self.path):
                    raise unreadable from None
                if not is_lock_error(exc):
                    raise
                if time.monotonic() >= deadline:
                    held = re.search(r"PID \d+", str(exc))
                    by = f" ({held.group(0)})" if held else ""
                    raise StoreBusy(
                        f"{self.path} is held by another process{by}, e.g. a running round; retry when it ends "
                        "(readers: Store.snapshot, autoevolve inspect)"
                    ) from None
                time.sleep(0.2)

    def _publish(self, force: bool = True) -> None:
        """Publish a snapshot for readers (when writable), unless one was published within the interval."""
        if self.publish_every_s is None or self._in_tx:
            return
        if not force and time.monotonic() - self._published < self.publish_every_s:
            return
        publish(self.con, self.path)
        self._published = time.monotonic()

    def __enter__(self) -> Self:
        """Enter a ``with`` block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on leaving a ``with`` block."""
        self.close()

    def close(self) -> None:
        """Close the connection; a writer's snapshot goes with it (readers read the file again). Safe twice."""
        self.con.close()
        if self.publish_every_s is not None and not self.url:
            snapshot_path(self.path).unlink(missing_ok=True)
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)

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
        self._publish(force=False)
        return int(row[0]) if row and isinstance(row[0], int) else 0

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """Run a block in one transaction: all of it lands or none of it."""
        self.con.begin()
        self._in_tx = True
        try:
            yield
        except BaseException:
            self.con.rollback()
            raise
        finally:
            self._in_tx = False
        self.con.commit()
        self._publish(force=False)

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
            raise StoreTooNew(
                f"store {self.path} has schema version {found}, but this code knows only up to version "
                f"{LATEST_VERSION}; upgrade autoevolve to open it"
            )

    def _migrate(self) -> list[int]:
        """Apply every migration not yet recorded, one transaction each; returns the versions applied."""
        if self.url:  # processes opening a new database at once migrate it one after another
            self._all("SELECT pg_advisory_lock(?)", [MIGRATION_LOCK])
        try:
            return self._apply_migrations()
        finally:
            if self.url:
                self._all("SELECT pg_advisory_unlock(?)", [MIGRATION_LOCK])

    def _apply_migrations(self) -> list[int]:
        """The migrations not yet recorded, applied in order."""
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
