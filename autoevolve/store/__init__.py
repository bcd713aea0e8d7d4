"""DuckDB trajectory store: runs, HCP configs, trajectories, candidates, selections, adapters, evaluations.

All SQL of the project lives in this package; other modules ask questions by method name.
The schema grows through numbered migrations recorded in ``schema_migrations`` (sqlite-utils style).
One ``Store`` wraps one DuckDB connection, which is not safe to share between threads.
"""

from __future__ import annotations

from autoevolve.store.adapters import RegistryTables
from autoevolve.store.base import TRAJ_COLS, TRAJ_KEY, StoreBusy, StoreError, StoreTooNew, StoreUnreadable
from autoevolve.store.export import ExportTables
from autoevolve.store.migrations import LATEST_VERSION, MIGRATIONS
from autoevolve.store.runs import RunTables
from autoevolve.store.stages import StageTables

__all__ = [
    "LATEST_VERSION",
    "MIGRATIONS",
    "TRAJ_COLS",
    "TRAJ_KEY",
    "Store",
    "StoreBusy",
    "StoreError",
    "StoreTooNew",
    "StoreUnreadable",
]


class Store(RunTables, RegistryTables, StageTables, ExportTables):
    """The project's DuckDB database: one file, migrated on open, every query by name."""
