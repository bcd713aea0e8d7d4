"""The round and loop flows on a tiny random model: nothing selected is said so; rounds run in turn."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from autoevolve.config import load_config
from autoevolve.envs.life import LifeEnv
from autoevolve.harness.workbench import Workbench
from autoevolve.records import EvalReport
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _tiny_config(tmp_path: Path, model_dir: Path, extra: str = ""):
    """A run config on the tiny random model: 4 dev and test tasks, one tool_format child, nothing to select."""
    path = tmp_path / "tiny.yaml"
    path.write_text(
        f"run_id: tiny\nhcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: {model_dir}, batch_size: 8}}\nenv: {{tiers: [1], n_train: 16, n_dev: 4, n_test: 4}}\n"
        "evolve: {train_tasks: 4, candidates: 1, mutators: [tool_format]}\nselect: {train_tasks: 4}\n" + extra
    )
    return load_config(path)


def test_round_flow_reports_an_empty_selection(tmp_path: Path, prefect_harness, tiny_model_dir, capsys) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from autoevolve_flows.round import round_flow

    state = round_flow(_tiny_config(tmp_path, tiny_model_dir), return_state=True)
    report = state.result()
    # Narration prints once on the terminal and reaches the run's logs, as a deployed run's would.
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        run_id = state.state_details.flow_run_id
        logged = [row.message for row in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]
    said = f"no rollout of the evolved configs beat the original: nothing to distil ({tmp_path / 'runs' / 'tiny'})"
    assert capsys.readouterr().out.splitlines().count(said) == 1
    assert said in logged
    assert report["selected"] == 0 and report["adapter"] is None and "eval" not in report
    assert [c["mutator"] for c in report["candidates"]] == ["seed", "tool_format"]
    assert set(report["seconds"]) == {"plan", "evolve", "select"}
    on_disk = json.loads((tmp_path / "runs" / "tiny" / "report.json").read_text())
    assert on_disk == report
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        # The seed on 4 dev tasks, seed and child on a 4-task train minibatch; selection reuses the seed's.
        assert store.count_trajectories("tiny") == report["rollouts"] == 4 + 4 * 2
        assert report["evolve"]["budget"]["rollouts"] == 12 and report["evolve"]["budget"]["stop"] == "candidates"
        assert len(store.selections("tiny")) == 1 and store.adapters() == []


def test_loop_flow_runs_rounds_in_turn(tmp_path: Path, prefect_harness, tiny_model_dir) -> None:
    from autoevolve_flows.loop_flow import loop_flow

    reports = loop_flow(_tiny_config(tmp_path, tiny_model_dir, "rounds: 2\n"))
    assert [r["round"] for r in reports] == [0, 1]
    rows = json.loads((tmp_path / "runs" / "tiny" / "rounds.json").read_text())
    assert [(r["round"], r["decision"], r["adapter"]) for r in rows] == [
        (0, "nothing selected", None),
        (1, "nothing selected", None),
    ]
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        second = [c for c in store.candidates("tiny") if c.round == 1]
        per_round = [store.count_trajectories("tiny", round=r) for r in (0, 1)]
    # Each round counts its own; round 1 tried the same configs with the same (bare) model, so reused them all.
    assert [r["rollouts"] for r in rows] == per_round == [12, 0]
    assert [c.mutator for c in second] == ["seed", "tool_format"]  # round 1 searched and recorded its own ledger


@pytest.mark.parametrize(
    ("answer", "timeout", "decision", "reason_end"),
    [
        ({"approve": True}, 60, "promote", "CI above 0"),
        ({"approve": False, "note": "too risky"}, 60, "reject", "; not approved: declined: too risky"),
        (None, 2, "reject", "; not approved: no answer within 2 s"),
    ],
)
def test_approval_pauses_the_flow_until_a_person_answers(
    tmp_path: Path, prefect_harness, answer, timeout, decision, reason_end
):  # noqa: ANN001
    from prefect import flow, resume_flow_run
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from autoevolve.round import Round
    from autoevolve_flows.round import approval
    from tests.approval_flow import gate_report
    from tests.stages.test_select import NoCalls

    # An answered pause waits long enough for a loaded machine's SQLite-backed test server to record the answer.
    config = _tiny_config(tmp_path, tmp_path, f"registry: {{approval: true, approval_timeout_s: {timeout}}}\n")
    dev = gate_report("tiny")
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(NoCalls(), LifeEnv(tiers=(1,)), store, run_id="tiny", progress=None)
        r = Round(config=config, bench=bench, original=config.original_hcp(), base_adapter=None)
        ids, results = [], []

        @flow
        def promotion() -> EvalReport:
            ids.append(flow_run.id)
            return approval(r, dev, poll_s=1)

        thread = threading.Thread(target=lambda: results.append(promotion()))
        thread.start()
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            while not ids or not client.read_flow_run(ids[0]).state.is_paused():
                assert time.monotonic() < deadline, "the flow run did not pause within 120 s"
                time.sleep(0.2)
        if answer is not None:
            resume_flow_run(ids[0], run_input=answer)
        thread.join(timeout=90)
        stored = store.evaluations("tiny")
    [report] = results
    assert report.decision == decision and report.reason.endswith(reason_end)
    assert stored == ([] if decision == "promote" else [report])


def test_the_router_environment_runs_through_the_same_round(tmp_path: Path, prefect_harness, tiny_model_dir) -> None:
    from autoevolve_flows.round import round_flow

    path = tmp_path / "router.yaml"
    path.write_text(
        f"run_id: route\nexpert: L0-chat\nhcp: {ROOT}/prompts/router.yaml\nstore: {tmp_path}/s.duckdb\n"
        f"run_dir: {tmp_path}/runs\nmodel: {{name: {tiny_model_dir}, batch_size: 8}}\n"
        "env: {name: router, tiers: [1], n_train: 12, n_dev: 6, n_test: 6}\n"
        "evolve: {train_tasks: 6, minibatch: 6, dev_tasks: 6, candidates: 1, mutators: [demos]}\n"
        "select: {train_tasks: 6}\n"
    )
    report = round_flow(load_config(path))
    assert [c["mutator"] for c in report["candidates"]] == ["seed", "demos"]
    with Store(tmp_path / "s.duckdb", read_only=True) as store:
        rows = store.trajectories("route")
    assert len(rows) == report["rollouts"] > 0 and {r.task_id[:7] for r in rows} == {"router-"}
    assert all(r.messages[0].content for r in rows)
    # The tiny model's garbage never routes: only the small-talk third of the dev tasks, answered by L0, scores.
    assert report["evolve"]["dev_original"] == pytest.approx(2 / 6)


def test_the_flows_run_offline_outside_make() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_SERVER_ANALYTICS_ENABLED", "HF_HUB_OFFLINE")}
    code = (
        "import autoevolve_flows.stage_flows, logging, os; from prefect.settings import get_current_settings as s; "
        "from prefect.logging.handlers import APILogHandler as H; "
        "print(s().server.analytics_enabled, os.environ['HF_HUB_OFFLINE'], "
        "any(isinstance(h, H) for h in logging.getLogger('autoevolve').handlers))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    # No telemetry attempt from the temporary server; the library's loggers reach a flow run's logs.
    assert done.stdout.split() == ["False", "1", "True"]


def test_the_loop_runs_a_round_again_after_a_transient_error_only(prefect_harness, monkeypatch) -> None:
    import autoevolve_flows.loop_flow
    from autoevolve.store import StoreBusy

    calls: list[int] = []

    def failing(errors: list[BaseException]):
        def round_flow(config, round):  # noqa: ANN001, ANN202 - stands in for the round flow
            calls.append(round)
            raise errors.pop(0)

        return round_flow

    config = load_config(ROOT / "configs/quickstart.yaml")
    monkeypatch.setattr(autoevolve_flows.loop_flow, "RETRY_DELAY_S", 0.0)
    monkeypatch.setattr(autoevolve_flows.loop_flow, "round_flow", failing([StoreBusy("held"), ValueError("bad data")]))
    with pytest.raises(ValueError, match="bad data"):
        autoevolve_flows.loop_flow.loop_flow(config)
    assert calls == [0, 0]  # the busy store: once more; the data error then stops the loop
    calls.clear()
    monkeypatch.setattr(autoevolve_flows.loop_flow, "round_flow", failing([ValueError("bad field")]))
    with pytest.raises(ValueError, match="bad field"):
        autoevolve_flows.loop_flow.loop_flow(config)
    assert calls == [0]


def test_a_round_runs_as_library_code_without_prefect(tmp_path: Path, tiny_model_dir) -> None:
    import subprocess
    import sys

    _tiny_config(tmp_path, tiny_model_dir)  # writes tiny.yaml
    code = (
        "import json, sys; from autoevolve import loop; from autoevolve.config import load_config; "
        f"r = loop.open_round(load_config({str(tmp_path / 'tiny.yaml')!r})); report = loop.run_round(r); "
        "r.bench.store.close(); "
        "print(json.dumps({'report': report, 'prefect': any(m.split('.')[0] == 'prefect' for m in sys.modules)}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    report = out["report"]
    assert out["prefect"] is False
    assert report["selected"] == 0 and "eval" not in report and set(report["seconds"]) == {"plan", "evolve", "select"}
    assert [c["mutator"] for c in report["candidates"]] == ["seed", "tool_format"]
    assert json.loads((tmp_path / "runs" / "tiny" / "report.json").read_text()) == report


def test_a_run_prints_one_screen_progress_and_summaries_with_warnings_in_the_run_log(
    tmp_path: Path, tiny_model_dir
) -> None:
    import subprocess
    import sys

    extra = (
        "labels: {budget: 4}\ndistill: {epoch_grid: [1, 2], dev_tasks: 2, batch_size: 2, lora_r: 4, lora_alpha: 8, "
        "max_length: 384}\ngate: {dev_tasks: 2, test_tasks: 4}\n"
    )
    _tiny_config(tmp_path, tiny_model_dir, extra)
    done = subprocess.run(
        [sys.executable, "-m", "autoevolve.cli", "run", str(tmp_path / "tiny.yaml")],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    screen = (done.stdout + done.stderr).replace("\r", "\n")
    for noise in ("Warning", "warnings.warn", "{'loss'", "Loading weights", "Building labels", "| INFO |"):
        assert noise not in screen, f"{noise!r} on the terminal:\n{screen[-3000:]}"
    said = done.stdout.splitlines()
    for stage in ("plan", "evolve", "select", "distill", "gate", "decide", "report"):
        assert sum(line.startswith(f"  {stage}: ") for line in said) == 1, (stage, said)
    assert "  distill: L1-life@v1 trained on 4 examples" in done.stdout and "mean reward [95% CI]" in done.stdout
    log = (tmp_path / "runs" / "tiny" / "run.log").read_text()
    assert "FutureWarning" in log  # kept, off the screen
    assert 'INFO autoevolve.training: {"epoch": ' in log and '"loss": ' in log  # each training step's row
