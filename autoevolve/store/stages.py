"""Stage results: what each finished stage of a round handed on, so a re-run resumes instead of redoing it."""

from __future__ import annotations

import json
from typing import Any

from autoevolve.store.base import Connection


class StageTables(Connection):
    """One row per finished (run, round, stage); the first write wins."""

    def put_stage(self, run_id: str, round: int, stage: str, result: dict[str, Any], seconds: float) -> None:
        """Record that a stage finished and what it handed on; a stage already recorded keeps its first result."""
        self._write(
            "INSERT INTO stage_results (run_id, round, stage, result, seconds) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            [run_id, round, stage, json.dumps(result), seconds],
        )

    def stage_result(self, run_id: str, round: int, stage: str) -> tuple[dict[str, Any], float] | None:
        """A finished stage's result and seconds, or None if it has not finished."""
        row = self._one(
            "SELECT result, seconds FROM stage_results WHERE run_id = ? AND round = ? AND stage = ?",
            [run_id, round, stage],
        )
        return (json.loads(row[0]), float(row[1])) if row else None

    def finished_stages(self, run_id: str) -> list[tuple[int, str]]:
        """(round, stage) of every finished stage of a run, in the order they finished."""
        rows = self._all(
            "SELECT round, stage FROM stage_results WHERE run_id = ? ORDER BY created_at, round, stage", [run_id]
        )
        return [(int(r), s) for r, s in rows]
