"""Reading a store while a round writes it: the writer publishes snapshots, a reader works on a private copy.

DuckDB lets one process hold a file for writing, and other processes open it only while nobody writes. So a
writing ``Store`` publishes a consistent copy beside its file (``<file>.snapshot``) every few seconds and when it
closes, and a reader never opens the live file for longer than a file copy: it copies the store (or, while a
writer holds it, the last published snapshot) to a private file and reads that.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import duckdb


def snapshot_path(path: Path) -> Path:
    """Where the writer of ``path`` publishes its snapshots."""
    return path.with_name(path.name + ".snapshot")


def is_lock_error(exc: Exception) -> bool:
    """Whether DuckDB refused a file because another process (or a connection of this one) holds it."""
    held_here = isinstance(exc, duckdb.Error) and "already attached" in str(exc)
    return held_here or (isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower())


def sql_path(path: Path | str) -> str:
    """A path as a SQL string literal."""
    return "'" + str(path).replace("'", "''") + "'"


def _copy_into(con: duckdb.DuckDBPyConnection, source: str, target: Path) -> None:
    """Copy every table of the attached database ``source`` into a new database file ``target``.

    DuckDB copies through the connection that holds the source: opening the file a second time (a plain file
    copy) would drop this process's lock on it, since POSIX file locks belong to the process, not the handle.
    """
    con.execute(f"ATTACH {sql_path(target)} AS autoevolve_copy")
    try:
        con.execute(f'COPY FROM DATABASE "{source}" TO autoevolve_copy')
    finally:
        con.execute("DETACH autoevolve_copy")


def publish(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Write a consistent copy of the open store beside it, replacing the last one atomically."""
    target = snapshot_path(path)
    folder = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=path.parent))
    try:
        _copy_into(con, con.execute("SELECT current_database()").fetchall()[0][0], folder / target.name)
        os.replace(folder / target.name, target)  # a reader copying the old one keeps reading the old file
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def private_copy(path: Path, wait_s: float = 10.0) -> Path:
    """A private copy of the store at ``path``: of the file itself, or of its writer's last snapshot.

    The file is attached read-only for the copy (a writer cannot start meanwhile, and what a crashed writer left
    in the write-ahead log is replayed). While a writer holds it, the writer's last published snapshot is copied
    instead. Waits up to ``wait_s`` when neither can be read yet (a writer that has not published its first
    snapshot), then raises TimeoutError.
    """
    folder = Path(tempfile.mkdtemp(prefix="autoevolve-read-"))
    copy = folder / path.name
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with duckdb.connect() as con:
                con.execute(f"ATTACH {sql_path(path)} AS autoevolve_source (READ_ONLY)")
                _copy_into(con, "autoevolve_source", copy)
            return copy
        except duckdb.Error as exc:
            if not is_lock_error(exc):
                shutil.rmtree(folder, ignore_errors=True)
                raise
        published = snapshot_path(path)
        try:
            shutil.copyfile(published, copy)  # this process holds no lock on it, so a plain copy is safe
            return copy
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            shutil.rmtree(folder, ignore_errors=True)
            raise TimeoutError(f"{path} is held by a writer that has published no snapshot within {wait_s:.0f} s")
        time.sleep(0.2)
