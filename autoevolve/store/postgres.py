"""PostgreSQL as the store's engine, for many writing processes: the same tables, queries and ``Store`` API.

A store named by a URL (``postgresql://user@host/db``, or ``postgresql:///db?host=/socket/dir``) is a PostgreSQL
database instead of a DuckDB file. Every process may write at once; each transaction runs at REPEATABLE READ, so
two processes changing the same row conflict and the loser retries on the new state (as DuckDB's writers do), and
a read-only store reads one consistent snapshot for as long as it is open. ``PgConnection`` answers the calls the
store makes of a DuckDB connection, and ``postgres_sql`` rewrites the few spellings that differ.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMES = ("postgresql://", "postgres://")
# DuckDB spellings of the migrations -> PostgreSQL's (every query outside them is written in SQL both run)
_DIALECT = (
    (re.compile(r"\bDOUBLE\b(?! PRECISION)"), "DOUBLE PRECISION"),
    (re.compile(r"to_json\(\[(\w+)\]\)"), r"json_build_array(\1)"),
)


def is_url(path: object) -> bool:
    """Whether a store is named by a PostgreSQL URL (else it is a DuckDB file)."""
    return str(path).startswith(SCHEMES)


def shown(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def postgres_sql(sql: str, params: bool) -> str:
    """A statement as PostgreSQL takes it: DuckDB's type and list spellings replaced, ``?`` placeholders as
    psycopg's ``%s`` (a literal ``%`` doubled) when parameters come with it."""
    for pattern, replacement in _DIALECT:
        sql = pattern.sub(replacement, sql)
    return sql.replace("%", "%%").replace("?", "%s") if params else sql


def conflict_errors() -> tuple[type[Exception], ...]:
    """The errors of a transaction that lost a race to another (retried on the new state)."""
    import psycopg.errors

    return psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected


class PgConnection:
    """One psycopg connection with the calls the store makes of a DuckDB connection (see the module docstring)."""

    def __init__(self, url: str, read_only: bool) -> None:
        try:
            import psycopg
        except ImportError:
            raise ImportError(
                "a postgresql:// store needs psycopg: pip install 'psycopg[binary]' (make install does)"
            ) from None
        self.read_only = read_only
        try:
            self.con = psycopg.connect(url, autocommit=True)
        except psycopg.OperationalError as exc:
            said = " ".join(str(exc).split())
            raise ConnectionError(f"cannot connect to the store at {shown(url)}: {said}") from None
        self._cursor: Any = None
        if read_only:  # one snapshot for the reader's whole life, as a DuckDB reader's private copy
            self.con.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> PgConnection:
        """Run one statement (or, without parameters, a script); its rows are read with ``fetchall``."""
        self._cursor = self.con.execute(postgres_sql(sql, bool(params)), list(params) or None)
        return self

    def fetchall(self) -> list[tuple[Any, ...]]:
        """The last statement's rows; for a write, one row holding the rows it changed (as DuckDB answers)."""
        cursor = self._cursor
        if cursor.description is not None:
            return cursor.fetchall()
        return [(cursor.rowcount,)] if cursor.rowcount >= 0 else []

    def columns(self) -> list[str]:
        """The last statement's column names."""
        return [c.name for c in self._cursor.description or []]

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement for each row of parameters."""
        with self.con.cursor() as cursor:
            cursor.executemany(postgres_sql(sql, True), [list(r) for r in rows])

    def insert_new(self, table: str, cols: Sequence[str], key: Sequence[str], rows: list[list[Any]]) -> int:
        """Insert rows whose key is not stored yet (within ``rows`` the first of a key wins); the rows inserted."""
        seen, fresh = set(), []
        at = [cols.index(k) for k in key]
        for row in rows:
            k = tuple(row[i] for i in at)
            if k not in seen:
                seen.add(k)
                fresh.append(row)
        marks = ", ".join(["%s"] * len(cols))
        sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks}) ON CONFLICT DO NOTHING RETURNING 1"
        with self.con.cursor() as cursor:
            cursor.executemany(sql, fresh, returning=True)
            inserted = 0
            while True:  # one result per row: a row back where it was inserted
                inserted += len(cursor.fetchall())
                if not cursor.nextset():
                    return inserted

    def begin(self) -> None:
        self.con.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")

    def commit(self) -> None:
        self.con.execute("COMMIT")

    def rollback(self) -> None:
        self.con.execute("ROLLBACK")

    def close(self) -> None:
        if not self.con.closed:
            if self.read_only:
                self.con.execute("ROLLBACK")
            self.con.close()


class LocalServer:
    """A PostgreSQL server of its own in a new temporary folder (``initdb``, then ``pg_ctl start``), listening on a
    Unix socket there only: for tests and benches, and for trying a many-writer store on one machine. As root, the
    server runs as the ``postgres`` user (PostgreSQL refuses root). ``url`` names its ``postgres`` database;
    ``stop`` ends it and removes the folder."""

    def __init__(self, user: str = "autoevolve") -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="autoevolve-pg-"))  # in the system's temporary folder: reachable
        self.data = self.folder / "data"
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")
        try:
            self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", user)
            options = f"-k {self.folder} -c listen_addresses='' -c max_connections=128"
            log = str(self.folder / "server.log")
            self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.url = f"postgresql://{user}@/postgres?host={self.folder}"

    @staticmethod
    def tool(name: str) -> str | None:
        """Where a PostgreSQL program is: on PATH, or in Debian's /usr/lib/postgresql/<version>/bin."""
        found = shutil.which(name)
        if found:
            return found
        versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
        return str(versions[-1]) if versions else None

    def _run(self, name: str, *args: str) -> None:
        program = self.tool(name)
        if program is None:
            raise FileNotFoundError(
                f"{name} not found: install PostgreSQL's server (Debian: apt-get install postgresql)"
            )
        runner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*runner, program, *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{name} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-600:]}")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
