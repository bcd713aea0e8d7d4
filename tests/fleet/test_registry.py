"""The adapter registry: lineage, one promoted version per expert, refused adapter folders."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from autoevolve.cli import main
from autoevolve.fleet.hooks import CommandHook, CommandHookSettings, VLLMHook, VLLMHookSettings
from autoevolve.fleet.registry import (
    PromotionRolledBack,
    Publisher,
    adapter_dir,
    add_expert,
    check_adapter_folder,
    decide,
    promote,
    register,
    rollback,
)
from autoevolve.records import Cell, EvalReport
from autoevolve.store import Store
from tests.fleet.test_hooks import servers  # noqa: F401 - fixture: fake vLLM servers

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _adapter(path: Path, base: str = BASE, weights: str = "adapter_model.safetensors") -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
    (path / weights).write_bytes(b"\0")
    return path


def _report(decision: str) -> EvalReport:
    cell = Cell(adapter="", hcp_id="h0", mean=0.5, n=8)
    return EvalReport(
        run_id="r", round=0, split="dev", cells={"live_original": cell}, decision=decision, reason=f"{decision} because"
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


def _three_versions(store: Store, tmp_path: Path) -> None:
    """v1, v2, v3 of L1-life registered as candidates; nothing live yet."""
    for v in (1, 2, 3):
        _register(store, _adapter(tmp_path / f"a{v}"), parent=v - 1 or None)


def _live(store: Store) -> list[int]:
    """Versions whose row says 'promoted' (the invariant: exactly the expert's live version, or none)."""
    return [a.version for a in store.adapters("L1-life") if a.status == "promoted"]


def test_promote_and_rollback_move_the_live_version_and_keep_history(tmp_path: Path) -> None:
    with Store(tmp_path / "s.duckdb") as store:
        _three_versions(store, tmp_path)
        assert store.expert("L1-life").live_version is None and store.promoted_adapter("L1-life") is None
        promote(store, "L1-life", 1)
        assert promote(store, "L1-life", 3, reason="v3 by hand").status == "promoted"
        assert _live(store) == [3] and store.adapter("L1-life", 1).status == "retired"
        assert rollback(store, "L1-life").version == 1  # the version live when v3 was promoted
        assert _live(store) == [1] and store.promoted_adapter("L1-life").version == 1
        assert rollback(store, "L1-life") is None  # before v1: the bare base model
        assert _live(store) == [] and store.expert("L1-life").live_version is None
        with pytest.raises(ValueError, match="has no live version to roll back"):
            rollback(store, "L1-life")
        history = [(e.action, e.previous_version, e.version) for e in store.events("L1-life")]
    assert history == [("promote", None, 1), ("promote", 1, 3), ("rollback", 3, 1), ("rollback", 1, None)]


def test_a_crash_between_steps_leaves_the_previous_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store(tmp_path / "s.duckdb") as store:
        _three_versions(store, tmp_path)
        promote(store, "L1-life", 1)
        write = store._write

        def crash_before_the_expert_row(sql: str, params=()):  # noqa: ANN001, ANN202
            if sql.startswith("UPDATE experts"):
                raise RuntimeError("power cut")  # v1 already retired and v2 promoted inside the transaction
            return write(sql, params)

        monkeypatch.setattr(store, "_write", crash_before_the_expert_row)
        with pytest.raises(RuntimeError, match="power cut"):
            promote(store, "L1-life", 2)
        monkeypatch.undo()
        assert _live(store) == [1] and store.expert("L1-life").live_version == 1
        assert store.adapter("L1-life", 2).status == "candidate" and len(store.events("L1-life")) == 1


@pytest.fixture(params=["duckdb", "postgresql"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where several connections open one store: a DuckDB file, or a PostgreSQL database."""
    return request.getfixturevalue("postgres_url") if request.param == "postgresql" else tmp_path / "s.duckdb"


def test_racing_promotions_leave_exactly_one_live_version(tmp_path: Path, shared: Path | str) -> None:
    path = shared
    with Store(path) as store:
        _three_versions(store, tmp_path)
    racers, rounds = 6, 10
    stores = [Store(path) for _ in range(racers)]  # one connection each: six writers in one process
    barrier = threading.Barrier(racers)
    errors: list[BaseException] = []

    def promote_many(store: Store, version: int) -> None:
        try:
            for _ in range(rounds):
                barrier.wait()
                promote(store, "L1-life", version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=promote_many, args=(s, 1 + i % 3)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    assert errors == []
    with Store(path) as store:
        live = store.expert("L1-life").live_version
        assert live in (1, 2, 3) and _live(store) == [live]
        events = store.events("L1-life")
    assert len(events) == racers * rounds and events[-1].version == live
    assert [e.previous_version for e in events[1:]] == [e.version for e in events[:-1]]  # a serial history


def _raced(store: Store, other: Store, version: int) -> None:
    """Make ``store``'s next live change let ``other`` promote ``version`` in full after its transaction began."""
    steps, raced = store._set_live, []

    def late(*args: object) -> object:
        if not raced:
            raced.append(promote(other, "L1-life", version))
        return steps(*args)  # type: ignore[arg-type]

    store._set_live = late  # type: ignore[method-assign]


def test_a_promotion_that_began_first_but_landed_last_is_last_in_the_history(
    tmp_path: Path, shared: Path | str
) -> None:
    with Store(shared) as store:
        _three_versions(store, tmp_path)
        promote(store, "L1-life", 1)
    with Store(shared) as first, Store(shared) as second:
        _raced(first, second, 3)
        promote(first, "L1-life", 2)  # its transaction began before v3's promotion, its writes came after
        history = [(e.action, e.version, e.previous_version) for e in first.events("L1-life")]
        assert history == [("promote", 1, None), ("promote", 3, 1), ("promote", 2, 3)]
        assert first.expert("L1-life").live_version == 2 and _live(first) == [2]


def test_a_rollback_racing_a_promotion_undoes_the_version_live_when_it_lands(
    tmp_path: Path, shared: Path | str
) -> None:
    with Store(shared) as store:
        _three_versions(store, tmp_path)
        promote(store, "L1-life", 1)
        promote(store, "L1-life", 2)
    with Store(shared) as first, Store(shared) as second:
        _raced(first, second, 3)
        back = rollback(first, "L1-life")  # v3 went live while it ran: v3 is what it undoes, so v2 comes back
        assert back is not None and back.version == 2 and _live(first) == [2]
        history = [(e.action, e.version, e.previous_version) for e in first.events("L1-life")]
        assert history[-2:] == [("promote", 3, 2), ("rollback", 2, 3)]


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/b", "L1..x", ""])
def test_names_that_could_escape_the_adapter_directory_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="is not allowed: use letters, digits"):
        adapter_dir(tmp_path, name, 1)
    with Store(tmp_path / "s.duckdb") as store, pytest.raises(ValueError, match="is not allowed"):
        add_expert(store, name, BASE)
    assert adapter_dir(tmp_path, "L1-life", 3) == (tmp_path / "L1-life-v3").resolve()


def test_an_expert_is_metadata_and_its_base_model_is_enforced(tmp_path: Path) -> None:
    with Store(tmp_path / "s.duckdb") as store:
        add_expert(store, "L0-chat", BASE, tier=0, routing_rule="Small talk and anything else.")
        assert store.adapters() == [] and store.expert("L0-chat").live_version is None
        _register(store, _adapter(tmp_path / "a1"))  # an unknown expert is made on first registration
        promote(store, "L1-life", 1)
        updated = add_expert(store, "L1-life", BASE, routing_rule="Bookings: tables, hotels, rides, events.")
        assert updated.live_version == 1 and updated.routing_rule.startswith("Bookings")  # metadata only
        assert [e.name for e in store.experts()] == ["L0-chat", "L1-life"]
        with pytest.raises(ValueError, match="is built on 'HuggingFaceTB/SmolLM2-135M-Instruct', not 'other/m'"):
            add_expert(store, "L1-life", "other/m")
        with pytest.raises(ValueError, match="but expert L1-life is built on"):
            register(
                store,
                name="L1-life",
                path=_adapter(tmp_path / "other", base="other/m"),
                base_model="other/m",
                parent_version=None,
                run_id="r",
                round=0,
                hcp_id="h",
                evolved_hcp_id="h",
                selection_id="s",
            )
        with pytest.raises(KeyError, match=r"no expert 'L9' .*\(known: L0-chat, L1-life\)"):
            store.expert("L9")


def test_registry_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "s.duckdb")

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(["registry", "--store", db, *args])
        out, err = capsys.readouterr()
        return code, out, err

    missing = f"autoevolve: no store at {db} (pass --store with an existing store's path; a run creates one)\n"
    assert cli("list") == (2, "", missing)
    assert cli("rollback", "L1-life") == (2, "", missing) and not Path(db).exists()  # a failed command creates none
    assert cli("add-expert", "L0-chat", "--base-model", BASE, "--tier", "0", "--rule", "Anything else.")[0] == 0
    with Store(db) as store:
        _three_versions(store, tmp_path)
    assert cli("promote", "L1-life", "2") == (0, "L1-life@v2 is live\n", "")
    code, out, _ = cli("list")
    assert code == 0 and out.splitlines()[1].split()[:4] == ["L0-chat", "0", "base", "0"]
    assert out.splitlines()[2].split()[:4] == ["L1-life", "1", "v2", "3"]
    code, out, _ = cli("show", "L1-life")
    assert "live v2" in out and "  promote  base -> v2  promoted by hand" in out
    assert cli("rollback", "L1-life") == (0, "the bare base model is live for L1-life\n", "")
    code, _, err = cli("promote", "L1-life", "7")
    assert code == 2 and err == f"autoevolve: no adapter L1-life@v7 in {db}\n"
    code, _, err = cli("show", "L9")
    assert code == 2 and err.startswith("autoevolve: no expert 'L9'")
    code, _, err = cli("add-expert", "../x", "--base-model", BASE)
    assert code == 2 and "expert name '../x' is not allowed" in err


@pytest.mark.parametrize("failure", ["500", "timeout"])
def test_a_failing_vllm_hook_rolls_the_promotion_back(tmp_path: Path, servers, failure: str) -> None:  # noqa: ANN001, F811
    with Store(tmp_path / "s.duckdb") as store:
        _three_versions(store, tmp_path)
        promote(store, "L1-life", 1)
        v1, v2 = store.adapter("L1-life", 1), store.adapter("L1-life", 2)
        server = servers({"L1-life": v1.path})
        if failure == "500":
            server.load_status = 500
        else:
            server.load_delay = 1.0
        hook = VLLMHook(VLLMHookSettings(kind="vllm", servers=[server.url], timeout_s=0.2))
        error = "load_lora_adapter answered 500" if failure == "500" else "load_lora_adapter timed out after 0.2 s"
        with pytest.raises(PromotionRolledBack, match=f"L1-life@v2: promotion rolled back: vllm .*{error}"):
            promote(store, "L1-life", 2, publisher=Publisher([hook], retries=1, backoff_s=0))
        assert store.expert("L1-life").live_version == 1 and _live(store) == [1]
        failed = store.adapter("L1-life", 2)
        events = store.events("L1-life")
    assert failed.status == "retired" and failed.reason.startswith("promotion rolled back, a hook failed: vllm")
    assert error in failed.reason and v2.path not in server.loaded.values()
    assert [(e.action, e.previous_version, e.version) for e in events] == [
        ("promote", None, 1),
        ("promote", 1, 2),
        ("hook_failed", 1, 2),
        ("rollback", 2, 1),
        ("hook_failed", 2, 1),  # the fleet could not be told about the rollback either: recorded, not hidden
    ]
    assert events[2].detail.startswith("v2 rolled back: vllm") and "after 2 attempt(s)" in events[2].detail
    loads = [c for c in server.calls() if c[1] == "/v1/load_lora_adapter"]
    assert loads[:2] == [("POST", "/v1/load_lora_adapter", {"lora_name": "L1-life", "lora_path": v2.path})] * 2
    assert loads[2][2] == {"lora_name": "L1-life", "lora_path": v1.path}  # the rollback asked for v1 again


def test_hooks_hear_promotions_and_rollbacks_and_a_kept_failure_is_flagged(tmp_path: Path) -> None:
    heard = tmp_path / "heard.jsonl"
    script = f"import sys; open({str(heard)!r}, 'a').write(sys.stdin.read() + '\\n')"
    listener = CommandHook(CommandHookSettings(kind="command", command=[sys.executable, "-c", script]))
    broken = CommandHook(CommandHookSettings(kind="command", command=[sys.executable, "-c", "raise SystemExit(3)"]))
    with Store(tmp_path / "s.duckdb") as store:
        _three_versions(store, tmp_path)
        publisher = Publisher([listener], retries=0, backoff_s=0)
        promote(store, "L1-life", 1, publisher=publisher)
        promote(store, "L1-life", 2, publisher=publisher)
        rollback(store, "L1-life", publisher=publisher)
        kept = promote(store, "L1-life", 3, publisher=Publisher([broken], retries=0, on_failure="keep", backoff_s=0))
        last = store.events("L1-life")[-1]
    bodies = [json.loads(line) for line in heard.read_text().splitlines()]
    assert [(b["action"], b["previous_version"], b["version"]) for b in bodies] == [
        ("promote", None, 1),
        ("promote", 1, 2),
        ("rollback", 2, 1),
    ]
    assert bodies[1]["path"] == str(tmp_path / "a2") and bodies[1]["base_model"] == BASE
    assert kept.status == "promoted" and last.action == "hook_failed" and last.version == 3
    assert last.detail.startswith("promote stands, flagged: command ") and "exit 3" in last.detail
