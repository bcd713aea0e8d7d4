"""The inspection tables over a two-round store, and `autoevolve inspect` run as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from autoevolve.records import AdapterRecord, Message, ToolCall
from autoevolve.store import Store
from autoevolve.views.inspection import (
    best_diff,
    reply,
    round_summary,
    search_progress,
    training_curves,
    two_by_two,
    wins,
)
from autoevolve.views.lineage import LineageError
from tests.test_export import ADAPTER, RUN, build_run, configs

NAN = math.nan


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The two-round store of ``tests.test_export.build_run``."""
    path = tmp_path_factory.mktemp("inspect") / "s.duckdb"
    build_run(path)
    return path


def _same(got: list[float], want: list[float]) -> bool:
    """Equal lists of floats, NaN equal to NaN."""
    pairs = zip(got, want, strict=True) if len(got) == len(want) else []
    return len(got) == len(want) and all((math.isnan(a) and math.isnan(b)) or a == b for a, b in pairs)


def test_search_progress_follows_the_ledger(built: Path) -> None:
    with Store.snapshot(built) as store:
        frame = search_progress(store, RUN)
    assert frame["round"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert frame["attempt"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert frame["status"].tolist() == ["keep", "keep", "discard", "crash", "keep", "keep", "discard"]
    assert _same(frame["dev"].tolist(), [0.0, 0.5, NAN, NAN, 0.5, 0.75, NAN])
    assert frame["best_dev"].tolist() == [0.0, 0.5, 0.5, 0.5, 0.5, 0.75, 0.75]  # per round: round 1 restarts
    assert _same(frame["minibatch"].tolist(), [NAN, 1.0, 0.0, NAN, NAN, 1.0, 0.0])
    assert _same(frame["parent_minibatch"].tolist(), [NAN, 0.0, 0.5, NAN, NAN, 0.0, 1.0])


def test_round_summary_has_one_row_per_round(built: Path) -> None:
    with Store.snapshot(built) as store:
        frame = round_summary(store, RUN).set_index("round")
    assert frame["rollouts"].tolist() == [12, 4] and frame["selected"].tolist() == [3, 2]
    assert frame["candidates"].tolist() == [3, 2] and frame["kept"].tolist() == [1, 1]
    assert frame["dev_original"].tolist() == [0.0, 0.5] and frame["dev_best"].tolist() == [0.5, 0.75]
    assert frame["decision"].tolist() == ["promote", "reject"] and frame["dev_gain"].tolist() == [0.625, 0.0]
    assert frame.loc[0, ["live_original", "live_evolved", "new_original", "new_evolved"]].tolist() == [
        0.0,
        0.5,
        0.75,
        0.625,
    ]
    assert frame["test_gain"].tolist() == [0.75, 0.0] and frame["retention"].tolist() == [1.5, 0.0]


def test_two_by_two_is_the_test_report(built: Path) -> None:
    with Store.snapshot(built) as store:
        frame = two_by_two(store, RUN, 1)
        with pytest.raises(LineageError, match="no test evaluation for run 'demo' round 7"):
            two_by_two(store, RUN, 7)
    assert frame.index.tolist() == ["live", "new"]
    assert frame["original"]["mean"].tolist() == [0.75, 0.75] and frame["evolved"]["mean"].tolist() == [0.875] * 2
    assert frame.loc["live", ("evolved", "ci_low")] == 0.775 and frame.loc["live", ("evolved", "ci_high")] == 0.975
    assert frame["original"]["prompt_tokens"].tolist() == [254.0, 254.0] and frame["evolved"]["n"].tolist() == [8, 8]
    assert frame.attrs["adapters"] == {"live": ADAPTER, "new": "L1-life@v2"} and frame.attrs["gain"] == 0.0


def test_wins_put_both_replies_side_by_side(built: Path) -> None:
    with Store.snapshot(built) as store:
        first, second = wins(store, RUN, 0), wins(store, RUN, 1)
        assert wins(store, RUN, 5).empty
    assert first["task_id"].tolist() == ["t0", "t1", "t2"] and len(second) == 2
    row = first.iloc[0]
    assert (
        row["evolved_reply"] == ('add_event({"title": "dentist t0", "day": "2025-03-04"}) -> Booked t0.')
        and row["evolved_reward"] == 1.0
    )
    assert row["original_reply"] == "I cannot book t0." and row["original_reward"] == 0.0
    assert second["evolved_reply"].tolist()[1].endswith("-> Booked t1.")  # round 1's rows are the adapter's


def test_reply_of_a_call_without_text_and_of_no_assistant() -> None:
    call = ToolCall.make("c", "list_events", {"day": "today"})
    assert reply([Message(role="user", content="hi"), Message(role="assistant", tool_calls=[call])]) == (
        'list_events({"day": "today"})'
    )
    assert reply([Message(role="user", content="hi")]) == ""


def test_best_diff_is_the_rounds_evolved_config(built: Path) -> None:
    original, evolved, evolved2 = configs()
    with Store.snapshot(built) as store:
        first, second = best_diff(store, RUN, 0), best_diff(store, RUN, 1)
    assert f"--- {original.id}/system_prompt" in first and f"+++ {evolved.id}/system_prompt" in first
    assert "Call a tool before answering." in first and "tool_format" not in first
    assert f"+++ {evolved2.id}/tool_format" in second and "+tool_format: json" in second


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoevolve.cli", *args], capture_output=True, text=True)


def test_cli_inspect_prints_counts_rounds_and_the_last_2x2(built: Path) -> None:
    done = _cli("inspect", RUN, "--store", str(built))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "run demo: 2 round(s), 16 rollouts, 7 candidates (4 keep, 2 discard, 1 crash), 5 selected items"
    )
    assert lines[2].split()[:3] == ["round", "rollouts", "candidates"]
    assert lines[3].split()[:8] == ["0", "12", "3", "1", "0.000", "0.500", "3", "promote"]
    assert lines[4].split()[:8] == ["1", "4", "2", "1", "0.500", "0.750", "2", "reject"]
    assert lines[6] == "round 1, test split, 8 tasks, mean reward [95% CI]"
    assert lines[7].split() == ["adapter", "original", "config", "evolved", "config"]
    assert lines[8].split() == f"live adapter A_r {ADAPTER} 0.750 [0.650, 0.850] 0.875 [0.775, 0.975]".split()
    assert lines[9].split()[:5] == ["new", "adapter", "A_r+1", "L1-life@v2", "0.750"]
    assert lines[10].split() == ["prompt", "tokens", "254", "423"]
    assert lines[11] == "gain +0.000 [-0.050, +0.050], retention 0.00"


def test_cli_inspect_unknown_run_or_store_exits_2(built: Path, tmp_path: Path) -> None:
    done = _cli("inspect", "nope", "--store", str(built))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"autoevolve: no run 'nope' in {built} (runs: demo, other)"]
    done = _cli("inspect", RUN, "--store", str(tmp_path / "missing.duckdb"))
    assert done.returncode == 2 and "no store at" in done.stderr and len(done.stderr.splitlines()) == 1


def add_trained_adapters(store: Store, folder: Path) -> None:
    """Two adapters of the run with a training log each (v2 continues v1), and one of another run."""
    for version, run, losses in ((1, RUN, [2.0, 1.0, 0.5]), (2, RUN, [0.8, 0.4]), (3, "other", [9.0])):
        path = folder / f"L1-life-v{version}"
        path.mkdir(parents=True)
        rows = [{"step": i + 1, "epoch": 0.5 * (i + 1), "loss": v, "learning_rate": 1e-3, "grad_norm": 1.5}
                for i, v in enumerate(losses)]  # fmt: skip
        rows.append({"step": len(losses), "train_runtime": 3.2, "train_loss": sum(losses) / len(losses)})
        (path / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        store.put_adapter(
            AdapterRecord(name="L1-life", version=version, base_model="m", path=str(path), run_id=run,
                          round=version - 1, hcp_id="h")
        )  # fmt: skip


def test_training_curves_read_each_adapters_log_of_the_run(tmp_path: Path) -> None:
    build_run(tmp_path / "s.duckdb")
    with Store(tmp_path / "s.duckdb") as store:
        add_trained_adapters(store, tmp_path / "adapters")
        (tmp_path / "adapters" / "L1-life-v2" / "training_log.jsonl").unlink()  # an adapter from before the log
        curves = training_curves(store, RUN)
    assert curves[["round", "adapter", "step", "loss"]].values.tolist() == [
        [0, "L1-life@v1", 1, 2.0],
        [0, "L1-life@v1", 2, 1.0],
        [0, "L1-life@v1", 3, 0.5],
    ]  # the summary row and the other run's adapter are not steps of this run
    assert curves["grad_norm"].tolist() == [1.5] * 3 and curves["reward"].isna().all()
