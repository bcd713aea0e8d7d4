"""What a round shows in the Prefect UI: its report as Markdown, its candidates as a table, progress while it runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

from autoevolve.config import load_config
from autoevolve.views.markdown import candidate_rows, round_markdown

ROOT = Path(__file__).resolve().parents[1]


def _report(**changes) -> dict:  # noqa: ANN003
    """A promoted round's report.json, in the shape ``write_report`` gives it."""
    cells = {"live_original": 0.25, "live_evolved": 0.625, "new_original": 0.5625, "new_evolved": 0.6875}
    report = {
        "run_id": "nightly-2026-11-30",
        "round": 2,
        "hcp": {"original": "aaaa1111", "evolved": "bbbb2222"},
        "candidates": [
            {"hcp_id": "aaaa1111", "parents": [], "mutator": "seed", "components": [], "status": "keep",
             "dev_mean": 0.25, "note": ""},
            {"hcp_id": "bbbb2222", "parents": ["aaaa1111"], "mutator": "demos",
             "components": ["system_prompt", "tools"], "status": "keep", "dev_mean": 0.6041666, "note": "2 demos"},
            {"hcp_id": "crash-1", "parents": ["bbbb2222"], "mutator": "reflective", "components": [],
             "status": "crash", "dev_mean": None, "note": "unparsable reply"},
        ],
        "evolve": {"dev_original": 0.25, "dev_best": 0.6041666, "budget": {}},
        "rollouts": 412,
        "failed_rollouts": 3,
        "selected": 57,
        "promoted": True,
        "adapter": "L1-life-v3",
        "live_adapter": "L1-life-v2",
        "eval": cells | {"n_tasks": 64, "split": "test"},
        "eval_ci": {k: [round(v - 0.1, 4), round(v + 0.1, 4)] for k, v in cells.items()},
        "gain": {"test": 0.3125, "test_ci": [0.1875, 0.4375], "dev": 0.2917, "dev_ci": [0.125, 0.4583]},
        "retention": {"test": 0.8333, "dev": None},
        "prompt_tokens": {"original": 212.4, "evolved": 655.9},
        "gate": {
            "split": "dev",
            "decision": "promote",
            "reason": "gain +0.292, 95% CI [+0.125, +0.458]; required: gain > 0.000 and CI above 0",
            "cells": {},
            "n_tasks": 24,
            "guard": {"env": "life tiers 2", "n": 16, "base": 0.5, "candidate": 0.4375, "tolerance": 0.1,
                      "drop": 0.0625},
        },
    }  # fmt: skip
    return report | changes


def test_the_round_markdown_has_the_2x2_with_intervals_the_decision_and_the_diff() -> None:
    diff = "--- aaaa1111/tools\n+++ bbbb2222/tools\n@@ -1 +1 @@\n-tools: json\n+tools: python"
    text = round_markdown(_report(), diff)
    lines = text.splitlines()
    assert lines[0] == "# autoevolve run `nightly-2026-11-30`, round 2"
    assert lines[2] == (
        "**Gate (dev, 24 tasks): promote** — gain +0.292, 95% CI [+0.125, +0.458]; "
        "required: gain > 0.000 and CI above 0"
    )
    assert "Adapter `L1-life-v3` is now live." in lines
    assert "Guard (life tiers 2, 16 tasks): 0.500 -> 0.438, drop +0.062, tolerance 0.100." in lines
    assert "## Held-out test (64 tasks): mean reward [95% CI]" in lines
    assert "|  | adapter | original config | evolved config |" in lines
    assert "| live adapter A_r | L1-life-v2 | 0.250 [0.150, 0.350] | 0.625 [0.525, 0.725] |" in lines
    assert "| new adapter A_r+1 | L1-life-v3 | 0.562 [0.463, 0.662] | 0.688 [0.588, 0.787] |" in lines
    assert (
        "- gain of A_r+1 over A_r, original config: test +0.312 [+0.188, +0.438], dev +0.292 [+0.125, +0.458]" in lines
    )
    assert "- retention (share of the evolved config's gain kept with the original config): test 0.83, dev -" in lines
    assert "- prompt tokens of the first call: original 212, evolved 656" in lines
    assert "- dev mean: original 0.250 -> best 0.604 (`bbbb2222`, 3 candidates)" in lines
    assert "- kept for distillation: 57 rollouts; rollouts this round: 412 (3 failed at the endpoint)" in lines
    assert text.endswith(f"## Best config vs the original\n\n```diff\n{diff}\n```\n")


def test_a_round_that_selected_nothing_says_so_and_a_diff_with_backticks_keeps_its_fence() -> None:
    report = {k: v for k, v in _report(selected=0, adapter=None, promoted=False).items() if k not in ("eval", "gate")}
    text = round_markdown(report, "")
    assert "**Nothing selected**: no rollout of an evolved config beat the original on a train task (0 kept)" in text
    assert "Held-out" not in text and "Gate" not in text
    assert text.endswith("The best config is the original: no evolved config beat it on dev.\n")
    demo = '+demos:\n+- \'```json {"name": "book"}```\''
    assert round_markdown(report, demo).endswith(f"````diff\n{demo}\n````\n")  # a longer fence than the diff's own


def test_candidate_rows_are_flat_and_mark_the_best() -> None:
    rows = candidate_rows(_report())
    assert [(r["mutator"], r["parents"], r["components"], r["dev_mean"], r["best"]) for r in rows] == [
        ("seed", "-", "-", 0.25, False),
        ("demos", "aaaa1111", "system_prompt,tools", 0.6042, True),
        ("reflective", "bbbb2222", "-", None, False),
    ]
    assert all(not isinstance(v, list | dict) for r in rows for v in r.values())


def _tiny_config(tmp_path: Path, model_dir: Path, extra: str = "") -> Path:
    """A run config on the tiny random model: 4 dev and test tasks, one tool_format child, nothing to select."""
    path = tmp_path / "artifacts.yaml"
    path.write_text(
        f"hcp: {ROOT}/prompts/life.yaml\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: {model_dir}, batch_size: 8}}\nenv: {{tiers: [1], n_train: 16, n_dev: 4, n_test: 4}}\n"
        "evolve: {train_tasks: 4, candidates: 1, mutators: [tool_format]}\nselect: {train_tasks: 4}\n" + extra
    )
    return path


def test_a_scheduled_round_leaves_its_report_candidates_and_progress_as_artifacts(
    tmp_path: Path, prefect_harness, tiny_model_dir
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    from autoevolve_flows.deploy import evolution_flow, scheduled_run_id

    path = _tiny_config(tmp_path, tiny_model_dir)
    state = evolution_flow(str(path), return_state=True)
    [report] = state.result()

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
        run_id = scheduled_run_id(load_config(path), run.expected_start_time)  # artifacts-<the scheduled date>
        [loop_run] = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
        )
        [round_run] = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[loop_run.id]))
        )
        key = f"autoevolve-{run_id}-round-0"
        found = {
            suffix: sorted(
                client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key + suffix]))),
                key=lambda a: a.created,
            )
            for suffix in ("", "-candidates", "-progress")
        }
        tasks = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[round_run.id]))
        )

    assert report["run_id"] == run_id and run_id.startswith("artifacts-20")
    [markdown], [table], progress = found[""], found["-candidates"], found["-progress"]
    assert markdown.type == "markdown" and markdown.flow_run_id == round_run.id
    assert markdown.data.startswith(f"# autoevolve run `{run_id}`, round 0\n\n**Nothing selected**")
    assert "- kept for distillation: 0 rollouts; rollouts this round: 12" in markdown.data
    assert table.type == "table"
    assert [(r["mutator"], r["status"]) for r in json.loads(table.data)] == [
        (c["mutator"], c["status"]) for c in report["candidates"]
    ] and len(report["candidates"]) == 2
    # One version per batch of rollouts: the seed on 4 dev tasks, then seed and child on a 4-task minibatch.
    assert [(p.type, p.data) for p in progress] == [("progress", 100.0)] * 3
    assert all(
        p.description.startswith("evolve ") and p.description.endswith(": 4/4 tasks rolled out") for p in progress
    )
    by_name = {t.name.rsplit("-", 1)[0]: t for t in tasks}
    assert {p.task_run_id for p in progress} == {by_name["evolve_stage"].id}  # made inside the stage
    # The stages that call the policy endpoint retry and carry the tag a concurrency limit bounds.
    assert by_name["evolve_stage"].tags == by_name["select_stage"].tags == ["autoevolve-policy"]
    assert by_name["evolve_stage"].empirical_policy.retries == 2


def test_progress_updates_a_batch_in_place_and_starts_a_version_per_batch(prefect_harness) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from autoevolve_flows.round import RolloutProgress

    shown = []

    @flow
    def rollouts() -> None:
        report = RolloutProgress("test-progress-batches", lambda *a: shown.append(a))
        for call in [("a", 64, 128), ("a", 128, 128), ("a", 64, 100), ("b", 10, 10)]:
            report(*call)

    rollouts()
    with get_client(sync_client=True) as client:
        made = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["test-progress-batches"]))
        )
    made.sort(key=lambda a: a.created)
    assert [(a.data, a.description) for a in made] == [
        (100.0, "a: 128/128 tasks rolled out"),  # its 50% was updated in place
        (64.0, "a: 64/100 tasks rolled out"),  # the same config on other tasks: a new batch
        (100.0, "b: 10/10 tasks rolled out"),
    ]
    assert len(shown) == 4  # the terminal bar saw every call


def test_a_tag_concurrency_limit_holds_a_slot_while_a_policy_stage_runs(
    tmp_path: Path, prefect_harness, tiny_model_dir, monkeypatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.concurrency import services

    from autoevolve.stages import pipeline
    from autoevolve_flows.round import POLICY_TAG, round_flow

    seen, run_stage = [], pipeline.run_stage

    def watched(r, stage, *args):  # noqa: ANN001, ANN202
        # The server records a slot shortly after the task run enters Running: look for up to 5 s before the stage.
        with get_client(sync_client=True) as client:
            for _ in range(50):
                slots = client.read_global_concurrency_limit_by_name(f"tag:{POLICY_TAG}").active_slots
                if slots:
                    break
                time.sleep(0.1)
        seen.append((stage, slots))
        return run_stage(r, stage, *args)

    monkeypatch.setattr(pipeline, "run_stage", watched)
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=POLICY_TAG, concurrency_limit=1)  # `prefect concurrency-limit create`
    services._no_limits_cache.clear()  # a process that ran tagged tasks before remembers "no limit for this tag" (5 s)
    try:
        round_flow(load_config(_tiny_config(tmp_path, tiny_model_dir)))
        with get_client(sync_client=True) as client:
            after = client.read_global_concurrency_limit_by_name(f"tag:{POLICY_TAG}").active_slots
    finally:
        with get_client(sync_client=True) as client:
            client.delete_concurrency_limit_by_tag(POLICY_TAG)
    # Each policy stage ran holding the one slot, and gave it back: the next one could take it.
    assert seen == [("plan", 1), ("evolve", 1), ("select", 1)] and after == 0
