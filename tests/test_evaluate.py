"""The gate: bootstrap intervals, the paired gain that must clear zero, retention (stored rollouts, no model)."""

from __future__ import annotations

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.evaluate import bootstrap_ci, format_table, gate, guard_check, held_out, with_guard
from autoevolve.hcp import HCPConfig
from autoevolve.records import Message, Trajectory
from autoevolve.store import Store
from autoevolve.workbench import Workbench
from tests.test_select import NoCalls


def test_bootstrap_interval_is_seeded_and_narrows_with_more_tasks() -> None:
    assert bootstrap_ci([1.0] * 10) == (1.0, 1.0) and bootstrap_ci([]) == (0.0, 0.0)
    small = bootstrap_ci([0.0, 1.0] * 20, seed=3)
    assert small == bootstrap_ci([0.0, 1.0] * 20, seed=3)
    assert small[0] < 0.5 < small[1] and 0.2 < small[1] - small[0] < 0.4  # about 2 x 1.96 x 0.5 / sqrt(40)
    large = bootstrap_ci([0.0, 1.0] * 200, seed=3)
    assert large[1] - large[0] < (small[1] - small[0]) / 2


ORIGINAL = HCPConfig.from_yaml("prompts/life.yaml")


def _put(store: Store, tasks, adapter: str, hcp: HCPConfig, rewards: list[float]) -> None:
    """Store one rollout per task with the given rewards, as if the policy had run them."""
    store.put_trajectories(
        [
            Trajectory(
                run_id="r",
                task_id=t.id,
                split="dev",
                tier=t.tier,
                hcp_id=hcp.id,
                adapter=adapter,
                reward=reward,
                messages=[Message(role="user", content=t.request)],
            )
            for t, reward in zip(tasks, rewards, strict=True)
        ]
    )


def _gate(tmp_path, adapter_wins: list[float], evolved_rewards: list[float]):
    """Gate a candidate whose per-task rewards under the original config are ``adapter_wins`` (base: all 0)."""
    env = LifeEnv(tiers=(1,))
    tasks = env.tasks("dev")[: len(adapter_wins)]
    original = ORIGINAL
    evolved = original.model_copy(update={"tool_format": "python"})
    rows = [
        ("", original, [0.0] * len(tasks)),
        ("", evolved, evolved_rewards),
        ("L1@v2", original, adapter_wins),
        ("L1@v2", evolved, [1.0] * len(tasks)),
    ]
    with Store(tmp_path / "s.duckdb") as store:
        for adapter, hcp, rewards in rows:
            _put(store, tasks, adapter, hcp, rewards)
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        report = gate(bench, original, evolved, "", "L1@v2", tasks)
        test = held_out(bench, original, evolved, "", "L1@v2", tasks)
        assert store.evaluations("r")[0] == report
    return report, test


def test_a_clear_gain_is_promoted_with_its_retention(tmp_path) -> None:
    report, test = _gate(tmp_path, [1.0] * 8, [1.0] * 4 + [0.0] * 4)
    assert report.decision == "promote" and report.gain == 1.0 and report.gain_ci == (1.0, 1.0)
    assert report.retention == pytest.approx(2.0)  # the adapter gained 1.0 where the evolved prompt gained 0.5
    assert set(report.cells) == {"base_original", "base_evolved", "adapter_original", "adapter_evolved"}
    assert report.cells["base_evolved"].ci[0] < 0.5 < report.cells["base_evolved"].ci[1]
    assert test.decision == "report" and "gain +1.000 [+1.000, +1.000], retention 2.00" in format_table(test)


def test_a_gain_whose_interval_touches_zero_is_rejected(tmp_path) -> None:
    report, _ = _gate(tmp_path, [1.0] + [0.0] * 7, [0.0] * 8)
    assert report.gain == 0.125 and report.gain_ci[0] == 0.0
    assert report.decision == "reject" and "(touches zero)" in report.reason
    assert report.retention is None  # the evolved config gained nothing to retain


def test_a_loss_is_rejected(tmp_path) -> None:
    report, _ = _gate(tmp_path, [0.0] * 8, [1.0] * 8)
    assert report.decision == "reject" and report.gain == 0.0 and report.retention == 0.0
    assert "(needs a gain above the minimum)" in report.reason


@pytest.mark.parametrize(("candidate", "decision"), [([1.0] * 3 + [0.0], "reject"), ([1.0] * 4, "promote")])
def test_a_guard_set_that_drops_beyond_tolerance_turns_a_promotion_into_a_reject(tmp_path, candidate, decision) -> None:
    report, _ = _gate(tmp_path / "gate", [1.0] * 8, [1.0] * 8)
    assert report.decision == "promote"
    env = LifeEnv(tiers=(2,))  # another tier than the one trained on
    tasks = env.tasks("dev")[:4]
    with Store(tmp_path / "s.duckdb") as store:
        _put(store, tasks, "", ORIGINAL, [1.0] * 4)
        _put(store, tasks, "L1@v2", ORIGINAL, candidate)
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        guard = guard_check(bench, ORIGINAL, "", "L1@v2", tasks, tolerance=0.1, label="life tiers 2")
        guarded = with_guard(bench, report, guard)
        assert store.evaluations("r") == [guarded]  # the stored report carries the guard
    assert guard.n == 4 and guard.base == 1.0 and guard.candidate == sum(candidate) / 4
    assert guarded.decision == decision and guarded.guard == guard
    drop = "+0.250, tolerance 0.100 exceeded" if decision == "reject" else "+0.000, tolerance 0.100"
    assert guarded.reason.endswith(f"; guard (life tiers 2, 4 tasks): 1.000 -> {guard.candidate:.3f}, drop {drop}")


def test_a_tier_that_drops_beyond_the_tolerance_rejects_a_gain(tmp_path) -> None:
    env = LifeEnv(tiers=(1, 2))
    tasks = env.tasks("dev")[:16]  # tiers interleave: 1, 2, 1, 2, ...
    before = [1.0 if t.tier == 2 else 0.0 for t in tasks]  # A_r solves tier 2 only
    after = [1.0 if t.tier == 1 else 0.75 for t in tasks]  # the candidate learns tier 1 and loses a little of 2
    with Store(tmp_path / "s.duckdb") as store:
        for adapter, rewards in (("", before), ("L1@v2", after)):
            for hcp in (ORIGINAL, ORIGINAL.model_copy(update={"tool_format": "python"})):
                _put(store, tasks, adapter, hcp, rewards)
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        evolved = ORIGINAL.model_copy(update={"tool_format": "python"})
        loose = gate(bench, ORIGINAL, evolved, "", "L1@v2", tasks, tier_tolerance=0.3)
        strict = gate(bench, ORIGINAL, evolved, "", "L1@v2", tasks, tier_tolerance=0.2)
        plain = gate(bench, ORIGINAL, evolved, "", "L1@v2", tasks)
    cells = ("base_original", "base_evolved", "adapter_original", "adapter_evolved")
    assert (
        loose.tiers
        == strict.tiers
        == {
            "1": dict(zip(cells, [0.0, 0.0, 1.0, 1.0], strict=True)) | {"n_tasks": 8},
            "2": dict(zip(cells, [1.0, 1.0, 0.75, 0.75], strict=True)) | {"n_tasks": 8},
        }
    )
    assert plain.decision == loose.decision == "promote" and strict.decision == "reject"
    drops = "; per tier: tier 1 +1.000, tier 2 -0.250 (tolerance 0.200): tier 2 dropped beyond it"
    assert strict.reason.endswith(drops)


def test_evolved_cells_on_fewer_tasks_read_retention_on_those_tasks_only(tmp_path) -> None:
    env = LifeEnv(tiers=(1, 2))
    tasks = env.tasks("dev")[:8]  # tiers 1, 2, 1, 2, ...
    evolved = ORIGINAL.model_copy(update={"tool_format": "python"})
    with Store(tmp_path / "s.duckdb") as store:
        _put(store, tasks, "", ORIGINAL, [0.0] * 8)
        _put(store, tasks, "L1@v2", ORIGINAL, [1.0] * 4 + [0.0] * 4)
        _put(store, tasks[:4], "", evolved, [1.0, 0.0, 0.0, 0.0])  # the evolved cells exist on 4 tasks only:
        _put(store, tasks[:4], "L1@v2", evolved, [1.0] * 4)  # NoCalls fails the test if a fifth is asked for
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        report = gate(bench, ORIGINAL, evolved, "", "L1@v2", tasks, evolved_tasks=4)
        test = held_out(bench, ORIGINAL, evolved, "", "L1@v2", tasks, evolved_tasks=4)
    assert report.cells["base_evolved"].n == 4 and report.cells["adapter_original"].n == 8
    assert report.gain == 0.5  # the decision reads all 8 original-config tasks
    assert report.retention == pytest.approx(4.0)  # gain 1.0 on those 4 tasks where the evolved prompt gained 0.25
    assert report.tiers["1"]["base_evolved"] == 0.5 and report.tiers["2"]["n_tasks"] == 4
    assert test.reason == "held-out table on 8 test tasks (evolved config on the first 4); it decides nothing"
