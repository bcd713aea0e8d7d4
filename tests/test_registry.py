"""The adapter registry: lineage, one promoted version per expert, refused adapter folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoevolve.records import Cell, EvalReport
from autoevolve.registry import check_adapter_folder, decide, register
from autoevolve.store import Store

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _adapter(path: Path, base: str = BASE, weights: str = "adapter_model.safetensors") -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
    (path / weights).write_bytes(b"\0")
    return path


def _report(decision: str) -> EvalReport:
    cell = Cell(adapter="", hcp_id="h0", mean=0.5, n=8)
    return EvalReport(
        run_id="r", round=0, split="dev", cells={"base_original": cell}, decision=decision, reason=f"{decision} because"
    )


def _register(store: Store, path: Path, parent: int | None = None):
    return register(
        store,
        name="L1-life",
        path=path,
        base_model=BASE,
        parent_version=parent,
        run_id="r",
        round=0,
        hcp_id="h0",
        evolved_hcp_id="h1",
        selection_id="sel-1",
    )


def test_versions_lineage_and_single_promoted(tmp_path: Path) -> None:
    with Store(tmp_path / "s.duckdb") as store:
        v1 = _register(store, _adapter(tmp_path / "a1"))
        assert (v1.version, v1.status, v1.ref) == (1, "candidate", "L1-life@v1")
        decide(store, v1, _report("promote"))
        v2 = _register(store, _adapter(tmp_path / "a2"), parent=1)
        decide(store, v2, _report("promote"))
        v3 = decide(store, _register(store, _adapter(tmp_path / "a3"), parent=2), _report("reject"))
        rows = {a.version: a for a in store.adapters("L1-life")}
    assert [rows[v].status for v in (1, 2, 3)] == ["retired", "promoted", "rejected"]
    assert rows[2].parent_version == 1 and rows[2].selection_id == "sel-1" and rows[2].evolved_hcp_id == "h1"
    assert v3.reason == "reject because" and rows[2].eval["decision"] == "promote"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": "other/model"}, "base_model_name_or_path is 'other/model'"),
        ({"weights": "adapter_model.bin"}, "adapter_model.safetensors is missing"),
    ],
)
def test_bad_adapter_folders_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_adapter_folder(_adapter(tmp_path / "a", **kwargs), BASE)
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        check_adapter_folder(tmp_path, BASE)
