"""The gate: the exact sign-flip test of the paired gain, its level by simulation, bootstrap intervals, retention."""

from __future__ import annotations

import random

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import Decoding, HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import Message, Trajectory
from autoevolve.stages.gate import (
    bootstrap_ci,
    decline,
    gate,
    gate_decision,
    guard_check,
    held_out,
    sign_flip_p,
    with_guard,
)
from autoevolve.store import Store
from autoevolve.views.twobytwo import format_table
from tests.stages.test_select import NoCalls


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
    """Gate a candidate whose per-task rewards under the original config are ``adapter_wins`` (the live adapter,
    here the bare base model: all 0)."""
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
    assert report.p_value == 1 / 256 and "p = 0.0039; required: gain > 0.000 and p < 0.025" in report.reason
    assert report.retention == pytest.approx(2.0)  # the adapter gained 1.0 where the evolved prompt gained 0.5
    assert set(report.cells) == {"live_original", "live_evolved", "new_original", "new_evolved"}
    assert report.cells["live_evolved"].ci[0] < 0.5 < report.cells["live_evolved"].ci[1]
    assert test.decision == "report" and "+1.000 [+1.000, +1.000], p = 0.0039, retention 2.00" in format_table(test)


def test_a_declined_promotion_is_stored_as_a_reject_with_why(tmp_path) -> None:
    report, _ = _gate(tmp_path, [1.0] * 8, [1.0] * 4 + [0.0] * 4)
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(NoCalls(), LifeEnv(tiers=(1,)), store, run_id="r", progress=None)
        declined = decline(bench, report, "declined: too soon")
        assert store.evaluations("r")[0] == declined  # it replaced the gate's promotion
    assert declined.decision == "reject" and declined.gain == report.gain
    assert declined.reason == f"{report.reason}; not approved: declined: too soon"


def test_a_gain_that_is_not_significant_is_rejected(tmp_path) -> None:
    report, _ = _gate(tmp_path, [1.0] + [0.0] * 7, [0.0] * 8)
    assert report.gain == 0.125 and report.gain_ci[0] == 0.0 and report.p_value == 0.5
    assert report.decision == "reject" and "sign-flip p = 0.5000 (not significant)" in report.reason
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
    cells = ("live_original", "live_evolved", "new_original", "new_evolved")
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
    assert report.cells["live_evolved"].n == 4 and report.cells["new_original"].n == 8
    assert report.gain == 0.5  # the decision reads all 8 original-config tasks
    assert report.retention == pytest.approx(4.0)  # gain 1.0 on those 4 tasks where the evolved prompt gained 0.25
    assert report.tiers["1"]["live_evolved"] == 0.5 and report.tiers["2"]["n_tasks"] == 4
    assert test.reason == "held-out table on 8 test tasks (evolved config on the first 4); it decides nothing"


def test_a_grammar_evolved_config_adds_the_grammar_cell_and_its_retention(tmp_path) -> None:
    """When the evolved config decodes under the tool-call grammar, the test table adds the live adapter under the
    original config with the grammar alone, and the share of that gain the new adapter keeps without it."""
    env = LifeEnv(tiers=(1,))
    tasks = env.tasks("dev")[:4]  # stored as dev rollouts (_put)
    evolved = ORIGINAL.model_copy(update={"decoding": Decoding(constrain="tool_call"), "tool_format": "python"})
    grammar = ORIGINAL.model_copy(update={"decoding": Decoding(constrain="tool_call")})
    with Store(tmp_path / "s.duckdb") as store:
        _put(store, tasks, "", ORIGINAL, [0.0] * 4)
        _put(store, tasks, "", grammar, [1.0, 1.0, 1.0, 1.0])
        _put(store, tasks, "", evolved, [1.0] * 4)
        _put(store, tasks, "L1@v2", ORIGINAL, [1.0, 1.0, 1.0, 0.0])
        _put(store, tasks, "L1@v2", evolved, [1.0] * 4)
        bench = Workbench(NoCalls(), env, store, run_id="r", progress=None)
        test = held_out(bench, ORIGINAL, evolved, "", "L1@v2", tasks)
        free = ORIGINAL.model_copy(update={"tool_format": "python"})
        _put(store, tasks, "", free, [1.0] * 4)
        _put(store, tasks, "L1@v2", free, [1.0] * 4)
        plain = held_out(bench, ORIGINAL, free, "", "L1@v2", tasks)
    assert test.cells["live_grammar"].mean == 1.0 and test.cells["live_grammar"].hcp_id == grammar.id
    assert test.grammar_retention == pytest.approx(0.75)
    assert "live_grammar" not in plain.cells and plain.grammar_retention is None


def _gate_trial(rng: random.Random, edge: float, n: int = 24, levels: int = 4) -> bool:
    """One simulated gate on ``n`` dev tasks: per task a difficulty, the live adapter's reward and the candidate's (true
    skill ``edge`` higher) drawn around it on ``levels`` reward steps; whether the gate would promote."""

    def draw(p: float) -> float:
        return round(min(1.0, max(0.0, p + rng.gauss(0, 0.3))) * levels) / levels

    skill = [rng.random() for _ in range(n)]
    diffs = [draw(s + edge) - draw(s) for s in skill]
    return gate_decision(sum(diffs) / n, sign_flip_p(diffs))


def test_the_gate_promotes_an_equal_adapter_in_at_most_5_percent_of_200_trials_and_a_better_one_mostly() -> None:
    rng = random.Random(0)
    equal = sum(_gate_trial(rng, 0.0) for _ in range(200))
    better = sum(_gate_trial(rng, 0.3) for _ in range(200))
    print(f"false promotions {equal}/200 ({equal / 2:.1f}%), planted +0.3 adapter promoted {better}/200")
    assert equal <= 10 and better >= 150  # measured: 1 and 161


def test_the_sign_flip_p_value_is_exact_on_small_samples() -> None:
    assert sign_flip_p([1.0] * 8) == 1 / 256  # all 2^8 flips: only the observed one reaches the sum
    assert sign_flip_p([1.0, 0.0, 0.0]) == 0.5  # a zero difference flips to itself
    # differences averaged over seeds: each rounds down, their sum does not; the observed flip still counts
    assert sign_flip_p([1 / 3] * 3) == 1 / 8
    assert sign_flip_p([1.0, -1.0, 1.0, 1.0]) == 5 / 16  # sums >= 2: all four plus, or one of four minus
    assert sign_flip_p([0.5, 0.25, -0.25]) == 3 / 8  # sums >= 0.5 of 0.5 ± 0.25 ± 0.25
    assert sign_flip_p([]) == 1.0 and sign_flip_p([-1.0] * 4) == 1.0


def test_past_the_exact_limit_the_sign_flip_p_value_is_drawn_close_to_the_exact_one(monkeypatch) -> None:
    diffs = [1.0] * 14 + [-1.0] * 4 + [0.5, -0.25, 0.75]
    exact = sign_flip_p(diffs)
    monkeypatch.setattr("autoevolve.stats.EXACT_SUMS", 4)  # count no sums: draw the flips
    drawn = sign_flip_p(diffs, seed=1)
    assert drawn != exact and drawn == sign_flip_p(diffs, seed=1) and abs(drawn - exact) < 0.005
