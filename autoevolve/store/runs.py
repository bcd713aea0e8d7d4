"""Tables of a run: its config, HCP configs, trajectories, stage-1 candidates, selections, evaluations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from autoevolve.records import Candidate, EvalReport, SelectedTrajectory, Selection, Trajectory
from autoevolve.store.base import (
    _CAND_JSON,
    _MESSAGES,
    CAND_COLS,
    ITEM_COLS,
    SEL_COLS,
    TRAJ_COLS,
    TRAJ_KEY,
    Connection,
    _cols,
    _from_row,
    _marks,
    _to_row,
    _traj_from_row,
    _traj_table,
    _upsert_sql,
)


class RunTables(Connection):
    """Runs, HCP configs, trajectories, candidates, selections and evaluations."""

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
        if self.url:
            rows = [[_MESSAGES.dump_json(t.messages).decode() if c == "messages" else getattr(t, c) for c in TRAJ_COLS]
                    for t in trajs]  # fmt: skip
            with self._tx():
                return self.con.insert_new("trajectories", TRAJ_COLS, TRAJ_KEY, rows)
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
            where.append("task_id = ANY(?::VARCHAR[])")
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

    def count_trajectories(
        self, run_id: str | None = None, round: int | None = None, backend_failed: bool = False
    ) -> int:
        """Number of stored trajectories: of all runs, of one run, or of one round of a run.

        ``backend_failed`` counts only the rollouts the policy endpoint failed (after its retries).
        """
        where, params = [], []
        for column, value in (("run_id", run_id), ("round", round)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if backend_failed:
            where.append("starts_with(error, 'backend error')")
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
            sql += " AND task_id = ANY(?::VARCHAR[])"
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
            "WHERE selection_id = ANY(?::VARCHAR[]) ORDER BY selection_id, position",
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

    def kept_rollouts(self, selection: Selection) -> list[Trajectory]:
        """The stored rollouts a selection kept, in its order (one query)."""
        return self._by_key(
            selection.run_id, [(i.hcp_id, selection.adapter, i.task_id, i.sample) for i in selection.items]
        )

    def beaten_rollouts(self, selection: Selection) -> list[Trajectory]:
        """The baseline rollout each kept one beat, in the selection's order (one query)."""
        keys = [(i.baseline_hcp_id, selection.adapter, i.task_id, i.baseline_sample) for i in selection.items]
        return self._by_key(selection.run_id, keys)

    def _by_key(self, run_id: str, keys: list[tuple[str, str, str, int]]) -> list[Trajectory]:
        """Trajectories of a run by (hcp_id, adapter, task_id, sample), in the keys' order; KeyError for one missing."""
        if not keys:
            return []
        columns = list(zip(*keys, strict=True))
        rows = self._all(
            f"SELECT {_cols(TRAJ_COLS)} FROM trajectories JOIN ("
            "SELECT unnest(?::VARCHAR[]) AS hcp_id, unnest(?::VARCHAR[]) AS adapter, unnest(?::VARCHAR[]) AS task_id, "
            "unnest(?::INTEGER[]) AS sample, unnest(?::INTEGER[]) AS position"
            ") AS wanted USING (hcp_id, adapter, task_id, sample) WHERE run_id = ? ORDER BY position",
            [*(list(c) for c in columns), list(range(len(keys))), run_id],
        )
        found = [_traj_from_row(r) for r in rows]
        if len(found) < len(keys):
            have = {(t.hcp_id, t.adapter, t.task_id, t.sample) for t in found}
            missing = next(k for k in keys if k not in have)
            raise KeyError(f"run {run_id} has no stored rollout {missing} in {self.path}")
        return found

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
