"""Export of one run to Parquet: one hive-partitioned folder per table (``<table>/round=<r>/data_0.parquet``).

Pandas, Polars, Spark or a fresh DuckDB read the folders without autoevolve installed, e.g.
``read_parquet('out/trajectories/**/*.parquet', hive_partitioning=true)`` in DuckDB, or
``pandas.read_parquet('out/trajectories')``.
"""

from __future__ import annotations

from pathlib import Path

from autoevolve.store.base import Connection
from autoevolve.store.snapshot import sql_path

# table folder -> the run's rows of it. Every query has a ``round`` column (the partition key) and one ``?``
# for the run id; JSON columns stay JSON text, so a reader decodes them with its own JSON functions.
EXPORTS: dict[str, str] = {
    "trajectories": "SELECT * FROM trajectories WHERE run_id = ? ORDER BY round, task_id, sample, hcp_id, adapter",
    "candidates": "SELECT * FROM candidates WHERE run_id = ? ORDER BY seq",
    "selections": "SELECT * FROM selections WHERE run_id = ? ORDER BY seq",
    # Items carry no round of their own: the selection's is joined in so they partition like the rest.
    "selection_items": (
        "SELECT i.*, s.round FROM selection_items i JOIN selections s ON s.id = i.selection_id "
        "WHERE s.run_id = ? ORDER BY s.seq, i.position"
    ),
    "evaluations": "SELECT run_id, round, split, decision, body, created_at, updated_at FROM evaluations "
    "WHERE run_id = ? ORDER BY round, split",
    "adapters": "SELECT * FROM adapters WHERE run_id = ? ORDER BY name, version",
}


class ExportTables(Connection):
    """Parquet export of one run's rows, for analysis outside autoevolve."""

    def export_run(self, run_id: str, out_dir: str | Path) -> dict[str, int]:
        """Write the run's rows of each table under ``out_dir/<table>/round=<r>/``; returns rows per table.

        A table without rows for the run gets an empty folder. Re-exporting the same run into the same folder
        overwrites its files; ``out_dir`` should hold one run only, since rounds another run wrote there stay.
        """
        known = [r for (r,) in self._all("SELECT run_id FROM runs ORDER BY created_at, run_id")]
        if run_id not in known:
            raise KeyError(f"no run {run_id!r} in {self.path} (runs: {', '.join(known) or 'none'})")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        counts = {}
        for table, query in EXPORTS.items():
            options = "FORMAT parquet, PARTITION_BY (round), OVERWRITE_OR_IGNORE"
            if self.url:  # PostgreSQL's rows, written by an in-memory DuckDB
                counts[table] = _copy_rows(self._all(query, [run_id]), self.con.columns(), out / table, options)
                continue
            row = self._one(f"COPY ({query}) TO {sql_path(out / table)} ({options})", [run_id])
            counts[table] = int(row[0]) if row else 0  # COPY answers with the number of rows it wrote
        return counts


def _copy_rows(rows: list[tuple], columns: list[str], folder: Path, options: str) -> int:
    """Rows (with their column names) written to ``folder`` as DuckDB's COPY writes a query; the rows written."""
    import duckdb
    import pyarrow as pa

    table = pa.table({name: [r[i] for r in rows] for i, name in enumerate(columns)})
    folder.mkdir(parents=True, exist_ok=True)
    if not rows:
        return 0
    with duckdb.connect() as local:
        local.register("exported", table)
        local.execute(f"COPY (SELECT * FROM exported) TO {sql_path(folder)} ({options})")
    return len(rows)
