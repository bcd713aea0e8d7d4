"""Registry tables: adapter versions, experts with their live version, and the history of live changes."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from autoevolve.records import AdapterRecord, Expert, RegistryEvent
from autoevolve.store.base import (
    ADAPTER_COLS,
    EVENT_COLS,
    EXPERT_COLS,
    Connection,
    StoreBusy,
    _cols,
    _from_row,
    _marks,
    _to_row,
    _upsert_sql,
)

T = TypeVar("T")
JITTER = random.Random()  # its own generator: a retry's wait never moves the random state a run seeded


class RegistryTables(Connection):
    """Adapters, experts and registry events; only ``set_live`` and ``roll_back`` move the live version."""

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
        retries: int = 20,
    ) -> int | None:
        """Make ``version`` (None: the bare base model) the expert's live version; returns the previous one.

        One transaction: the old live row becomes 'retired', the new one 'promoted' (its reason = ``detail``, and
        ``eval`` when given), the expert's live_version moves and the event is written. All of it lands or none, so
        a reader never sees zero or two live versions. A concurrent change of the same expert conflicts (DuckDB, or
        PostgreSQL at REPEATABLE READ); the loser retries on the new state.
        """
        return self._serial(name, retries, lambda: self._set_live(name, version, action, detail, eval))

    def roll_back(self, name: str, detail: str = "", retries: int = 20) -> tuple[int, int | None]:
        """Put back the version that was live when the live one was promoted (None: the bare base model), reading
        both inside the transaction that writes, so a racing promotion cannot make it undo the wrong one. Returns
        (the version rolled back, the one now live); ValueError when nothing is live."""

        def steps() -> tuple[int, int | None]:
            live = self.expert(name).live_version
            if live is None:
                raise ValueError(f"expert {name} has no live version to roll back (the bare base model serves it)")
            row = self._one(
                "SELECT previous_version FROM registry_events WHERE expert = ? AND version = ? AND action = 'promote' "
                "ORDER BY seq DESC LIMIT 1",
                [name, live],
            )
            target = row[0] if row else None
            self._set_live(name, target, "rollback", detail, None)
            return live, target

        return self._serial(name, retries, steps)

    def _serial(self, name: str, retries: int, steps: Callable[[], T]) -> T:
        """Run ``steps`` in one transaction; on a write conflict with a concurrent change, again on the new state."""
        for attempt in range(retries + 1):
            try:
                with self._tx():
                    return steps()
            except self.conflicts:
                if attempt == retries:
                    raise StoreBusy(
                        f"{self.path}: {name}'s live version kept changing under {retries} retries"
                    ) from None
                time.sleep(JITTER.uniform(0, 0.005 * 2 ** min(attempt, 6)))  # racers spread out, then retry
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
        """The registry's history, of one expert or all, in the order the changes were made."""
        where, params = ("WHERE expert = ?", [name]) if name is not None else ("", [])
        rows = self._all(f"SELECT {_cols(EVENT_COLS)}, created_at FROM registry_events {where} ORDER BY seq", params)
        return [_from_row(RegistryEvent, (*EVENT_COLS, "at"), r) for r in rows]

    def adapter_created(self, name: str) -> dict[int, datetime]:
        """When each version of an expert was registered."""
        return dict(self._all("SELECT version, created_at FROM adapters WHERE name = ?", [name]))
