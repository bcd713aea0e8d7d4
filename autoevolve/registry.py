"""The adapter registry: versions of each LoRA expert with their lineage; at most one promoted per expert."""

from __future__ import annotations

import json
from pathlib import Path

from autoevolve.records import AdapterRecord, EvalReport
from autoevolve.store import Store


def register(
    store: Store,
    *,
    name: str,
    path: str | Path,
    base_model: str,
    parent_version: int | None,
    run_id: str,
    round: int,
    hcp_id: str,
    evolved_hcp_id: str,
    selection_id: str,
) -> AdapterRecord:
    """Record a freshly trained adapter as the expert's next version, status 'candidate'."""
    check_adapter_folder(Path(path), base_model)
    record = AdapterRecord(
        name=name,
        version=store.next_adapter_version(name),
        base_model=base_model,
        path=str(path),
        parent_version=parent_version,
        run_id=run_id,
        round=round,
        hcp_id=hcp_id,
        evolved_hcp_id=evolved_hcp_id,
        selection_id=selection_id,
    )
    store.put_adapter(record)
    return record


def decide(store: Store, record: AdapterRecord, report: EvalReport) -> AdapterRecord:
    """Apply the gate's decision: promote (retiring the live version) or reject, with the reason and eval."""
    summary = {
        "decision": report.decision,
        "reason": report.reason,
        "cells": {k: c.mean for k, c in report.cells.items()},
        "gain": report.gain,
        "gain_ci": list(report.gain_ci),
        "retention": report.retention,
        "guard": report.guard.model_dump() if report.guard else None,
    }
    if report.decision != "promote":
        rejected = record.model_copy(update={"status": "rejected", "reason": report.reason, "eval": summary})
        store.put_adapter(rejected)
        return rejected
    live = store.promoted_adapter(record.name)
    if live is not None:
        store.put_adapter(live.model_copy(update={"status": "retired"}))
    promoted = record.model_copy(update={"status": "promoted", "reason": report.reason, "eval": summary})
    store.put_adapter(promoted)
    return promoted


def check_adapter_folder(path: Path, base_model: str) -> None:
    """Refuse an adapter folder that is incomplete, not safetensors, or made for another base model."""
    config = path / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"adapter {path}: adapter_config.json is missing")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"adapter {path}: adapter_model.safetensors is missing (pickled weights are not loaded)")
    declared = json.loads(config.read_text()).get("base_model_name_or_path")
    if declared != base_model:
        raise ValueError(f"adapter {path}: base_model_name_or_path is {declared!r}, expected {base_model!r}")
