"""One DuckLake writer of bench/store_writers.py, run by an interpreter with DuckDB 1.4 and the ducklake and sqlite
extensions (DuckLake's extension is built for DuckDB <= 1.4; the project's own DuckDB is newer).

    PYTHON ducklake_writer.py init CATALOG DATA SCHEMA.json   make the trajectories table
    PYTHON ducklake_writer.py write CATALOG DATA              commit each Parquet file named on stdin
    PYTHON ducklake_writer.py count CATALOG DATA              rows in the table
    PYTHON ducklake_writer.py read CATALOG DATA QUERY         seconds the reader's query takes

``write`` attaches the lake, prints ``ready``, then for each path read from stdin inserts, in one transaction, the
file's rows whose key is not stored yet (DuckLake tables have no primary key to skip them by), and prints ``ok``.
A commit that conflicts with another writer's, or finds the SQLite catalog locked by one, is tried again (``ok``
says how many times it was retried); after 100 tries the writer prints why and exits 1.
"""

from __future__ import annotations

import glob
import json
import os
import site
import sys
import time

import duckdb

KEY = ("run_id", "task_id", "hcp_id", "adapter", "sample")
RETRIES = 100


def connect(catalog: str, data: str) -> duckdb.DuckDBPyConnection:
    """A connection with the lake attached as ``lake`` (a catalog path ending in .sqlite: SQLite; else a URL)."""
    con = duckdb.connect()
    for folder in site.getsitepackages():
        for ext in sorted(glob.glob(os.path.join(folder, "duckdb_ext/extensions/*/*/*.duckdb_extension"))):
            con.execute(f"LOAD '{ext}'")
    where = f"sqlite:{catalog}" if catalog.endswith(".sqlite") else f"postgres:{catalog}"
    con.execute(f"ATTACH 'ducklake:{where}' AS lake (DATA_PATH '{data}')")
    return con


def main() -> None:
    action, catalog, data = sys.argv[1:4]
    con = connect(catalog, data)
    if action == "init":
        columns = json.loads(open(sys.argv[4]).read())
        con.execute(f"CREATE TABLE lake.trajectories ({', '.join(f'{n} {t}' for n, t in columns)})")
    elif action == "count":
        print(con.execute("SELECT count(*) FROM lake.trajectories").fetchone()[0])
    elif action == "read":
        started = time.perf_counter()
        con.execute(sys.argv[4].replace("FROM trajectories", "FROM lake.trajectories")).fetchall()
        print(time.perf_counter() - started)
    elif action == "write":
        columns = [r[0] for r in con.execute("DESCRIBE lake.trajectories").fetchall()]
        new = " AND ".join(f"t.{k} = s.{k}" for k in KEY)
        insert = (
            f"INSERT INTO lake.trajectories SELECT {', '.join(f's.{c}' for c in columns)} FROM read_parquet(?) s "
            f"WHERE NOT EXISTS (SELECT 1 FROM lake.trajectories t WHERE {new})"
        )
        print("ready", flush=True)
        for line in sys.stdin:
            for retry in range(RETRIES):
                try:
                    con.execute(insert, [line.strip()])
                    break
                except duckdb.Error as exc:  # a conflicting commit, or the SQLite catalog busy with another's
                    if not isinstance(exc, duckdb.TransactionException) and "locked" not in str(exc):
                        raise
                    time.sleep(0.01 * (retry + 1))
            else:
                print(f"a commit conflicted {RETRIES} times", flush=True)  # the bench records it
                sys.exit(1)
            print(f"ok {retry}", flush=True)


if __name__ == "__main__":
    main()
