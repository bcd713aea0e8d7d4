"""Stage 1: the Pareto search, its budgets and ledger (scripted policies, real store, real environment)."""

from __future__ import annotations

import json

import pytest

from autoevolve.envs.life import LifeEnv, _book_args
from autoevolve.harness.hcp import COMPONENTS, HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.policy import ChatRequest, Completion
from autoevolve.stages.evolve import evolve, make_mutators
from autoevolve.stages.evolve.mutators import ScaffoldSampling
from autoevolve.stages.plan import train_tasks
from autoevolve.stages.settings import BudgetSettings, EvolveSettings
from autoevolve.store import Store
from tests.harness.test_rollout import Scripted


class DemoLearner:
    """A policy that books correctly only when the prompt holds demos, and never otherwise."""

    def __init__(self, env: LifeEnv) -> None:
        self.goals = {t.request: t.goal for s in ("train", "dev", "test") for t in env.tasks(s)}

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        return [self._one(r.messages) for r in requests]

    def _one(self, messages: list[dict]) -> Completion:
        if messages[-1]["role"] != "user" or "Tool result" in messages[-1]["content"]:
            return Completion(text="Done.", completion_tokens=2)
        if len(messages) <= 2:  # system + request: no demos
            return Completion(text="I am not sure.", completion_tokens=4)
        goal = self.goals[messages[-1]["content"]]
        call = {"name": "book_table", "arguments": _book_args(goal)}
        return Completion(text=json.dumps(call), completion_tokens=20)

    def add_adapter(self, name: str, path: str) -> None:
        pass


def _settings(**kw) -> EvolveSettings:
    base = {"minibatch": 4, "dev_tasks": 4, "candidates": 4, "demo_pool": 4, "demo_k": [2], "demo_styles": ["full"]}
    return EvolveSettings(**(base | kw))


def _search(env, original, tmp_path, policy, settings, reflector=None, seed=0, carried=()):
    """Run the search on 4 train and 4 dev table-booking tasks; returns the result and the stored ledger."""
    train = [t for t in env.tasks("train") if t.goal["kind"] == "table"][:4]
    dev = [t for t in env.tasks("dev") if t.goal["kind"] == "table"][:4]
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(policy, env, store, run_id="r", seed=seed, progress=None)
        ops = make_mutators(settings, reflector)
        result = evolve(bench, original, settings, train=train, dev=dev, mutators=ops, carried=carried)
        return result, store.candidates("r"), store.count_trajectories("r")


def test_a_child_that_beats_its_parent_joins_the_pool_with_lineage(env, original, tmp_path) -> None:
    result, ledger, _ = _search(env, original, tmp_path, DemoLearner(env), _settings(mutators=["demos"], candidates=2))
    seed, child, again = ledger
    assert seed.mutator == "seed" and seed.parents == [] and seed.mean_reward == 0.0 and len(seed.scores) == 4
    assert child.status == "keep" and child.parents == [original.id] and child.components == ["demos"]
    assert child.mean_reward == 1.0 and set(child.minibatch.values()) == {1.0}
    assert set(child.parent_minibatch.values()) == {0.0} and "demos:" in child.diff
    assert child.spreads == dict.fromkeys(child.scores, 0.0)
    assert result.best.id == child.hcp_id and result.best.demos.items
    # The second child's parent is drawn from the frontier: the demo config, which no demo set can beat.
    assert again.parents == [child.hcp_id] and again.status == "discard" and "not better" in again.note
    assert result.budget["stop"] == "candidates" and result.budget["rollouts"] == again.rollouts_used


def test_a_config_carried_from_an_earlier_round_joins_the_pool_and_can_stay_best(env, original, tmp_path) -> None:
    first, _, _ = _search(env, original, tmp_path / "r0", DemoLearner(env), _settings(mutators=["demos"], candidates=1))
    assert first.best.demos.items  # round 0 found demos
    settings = _settings(mutators=["tool_format"], candidates=1)
    result, ledger, _ = _search(env, original, tmp_path / "r1", DemoLearner(env), settings, carried=[first.best])
    seed, carried, child = ledger
    assert (carried.mutator, carried.status, carried.parents) == ("carried", "keep", [original.id])
    assert carried.hcp_id == first.best.id and carried.components == ["demos"] and carried.mean_reward == 1.0
    assert len(carried.scores) == 4 and seed.mean_reward == 0.0  # scored on dev again, this round
    assert result.best.id == first.best.id and child.status == "discard"


def test_without_references_the_demos_mutator_has_nothing_until_the_model_succeeds(env, original, tmp_path) -> None:
    # The same search that finds demos from labelled solutions (above) finds none without them: no rollout succeeds.
    settings = _settings(mutators=["demos"], candidates=1, references=False)
    result, ledger, _ = _search(env, original, tmp_path, DemoLearner(env), settings)
    seed, failed = ledger
    assert failed.status == "crash" and failed.note.startswith("no successful train rollouts")
    assert result.best.id == original.id and seed.mean_reward == 0.0


def test_rollout_budget_is_never_exceeded(env, original, tmp_path) -> None:
    # Seed: 4 dev rollouts. A step may need parent 4 + child 4 + dev 4 = 12; after the first, the parent's
    # minibatch (all 4 train tasks) is stored, so each later step may need 8 and uses 4.
    budget = BudgetSettings(rollouts=20)
    settings = _settings(mutators=["tool_format"], minibatch=4, candidates=10, budget=budget)
    result, ledger, stored = _search(env, original, tmp_path, Scripted(["No."]), settings)
    assert result.budget["stop"] == "rollouts"
    assert [c.rollouts_used for c in ledger] == [4, 12, 16]  # a third child could need 16 + 8 > 20
    assert result.budget["rollouts"] == 16 == stored


def test_token_call_and_patience_budgets_stop_exactly(env, original, tmp_path) -> None:
    tokens = _settings(mutators=["tool_format"], candidates=10, budget=BudgetSettings(generated_tokens=60))
    result, ledger, _ = _search(env, original, tmp_path / "a", Scripted(["No."]), tokens)
    # Scripted: 5 tokens a rollout. Seed 20; each child step 40 (parent and child on 4 tasks), then 20.
    assert result.budget["stop"] == "generated_tokens" and len(ledger) == 2 and result.budget["generated_tokens"] == 60
    patience = _settings(mutators=["tool_format"], candidates=10, budget=BudgetSettings(patience=3))
    result, ledger, _ = _search(env, original, tmp_path / "b", Scripted(["No."]), patience)
    assert result.budget["stop"] == "patience" and len(ledger) == 1 + 3
    calls = _settings(mutators=["reflective"], candidates=10, budget=BudgetSettings(optimiser_calls=2))
    optimiser = Scripted(["```\nnot a prompt\n```"])
    result, ledger, _ = _search(env, original, tmp_path / "c", Scripted(["No."]), calls, reflector=optimiser)
    assert result.budget["stop"] == "optimiser_calls" and optimiser.calls == 2 and len(ledger) == 3


def test_an_unparseable_optimiser_reply_is_a_recorded_failed_proposal(env, original, tmp_path) -> None:
    settings = _settings(mutators=["reflective"], candidates=1)
    settings.reflection.components = ["tools"]
    reply = "Here you go:\n```yaml\n- name: book_table\n  description: [unclosed\n```"
    result, ledger, _ = _search(env, original, tmp_path, Scripted(["No."]), settings, reflector=Scripted([reply]))
    failed = ledger[1]
    assert failed.status == "crash" and failed.mutator == "reflective" and failed.parents == [original.id]
    assert failed.note.startswith("failed proposal: the optimiser's tools is not valid YAML or JSON")
    assert failed.diff == reply and result.best.id == original.id


def test_frozen_components_never_change_in_a_search(env, original, tmp_path) -> None:
    settings = _settings(mutators=["demos", "tool_format", "scaffold"], candidates=6, frozen=["tool_format", "demos"])
    result, ledger, _ = _search(env, original, tmp_path, DemoLearner(env), settings)
    children = [result.configs[c.hcp_id] for c in ledger if c.hcp_id in result.configs]
    assert len(children) >= 2
    for child in children:
        assert child.tool_format == original.tool_format and child.demos == original.demos
    assert all(set(c.components) <= set(COMPONENTS) - {"tool_format", "demos"} for c in ledger)


class TwoSkills(DemoLearner):
    """Books with demos on even-numbered tasks, with Python-style tools on odd ones; the seed alone on the first."""

    def __init__(self, env: LifeEnv, first: str) -> None:
        super().__init__(env)
        self.order = {t.request: i for s in ("train", "dev") for i, t in enumerate(env.tasks(s))}
        self.first = first

    def _one(self, messages: list[dict]) -> Completion:
        if messages[-1]["role"] != "user" or "Tool result" in messages[-1]["content"]:
            return Completion(text="Done.", completion_tokens=2)
        request, system = messages[-1]["content"], messages[0]["content"]
        demos, python = len(messages) > 2, "def " in system or "tool_name(" in system
        odd = self.order[request] % 2 == 1
        seed_only = request == self.first and not demos and not python
        if seed_only or (request != self.first and ((odd and python) or (not odd and demos))):
            return Completion(text=json.dumps({"name": "book_table", "arguments": _book_args(self.goals[request])}))
        return Completion(text="I am not sure.")


def test_a_merge_combines_two_frontier_members_over_their_ancestor(env, original, tmp_path) -> None:
    first = next(t for t in env.tasks("dev") if t.goal["kind"] == "table").request
    settings = _settings(mutators=["demos", "tool_format", "merge"], candidates=3)
    # Workbench seed 4 draws the seed config as the tool_format child's parent, so two siblings share an ancestor.
    result, ledger, _ = _search(env, original, tmp_path, TwoSkills(env, first), settings, seed=4)
    assert [c.mutator for c in ledger] == ["seed", "demos", "tool_format", "merge"], [c.note for c in ledger]
    demos, tools, merged = ledger[1:]
    assert demos.parents == tools.parents == [original.id]
    assert sorted(merged.parents) == sorted([demos.hcp_id, tools.hcp_id])
    child = result.configs[merged.hcp_id]
    assert child.demos == result.configs[demos.hcp_id].demos
    assert child.tool_format == result.configs[tools.hcp_id].tool_format
    assert merged.status == "keep" and merged.mean_reward > max(demos.mean_reward, tools.mean_reward)


def test_the_seed_alone_must_fit_the_rollout_budget(env, original, tmp_path) -> None:
    settings = _settings(budget=BudgetSettings(rollouts=3))
    with pytest.raises(ValueError, match=r"evolve.budget.rollouts=3 cannot even score the original config on 4 dev"):
        _search(env, original, tmp_path, Scripted(["No."]), settings)


def test_scaffold_mutator_changes_one_knob(original: HCPConfig) -> None:
    import random

    seen = set()
    for seed in range(12):
        child = ScaffoldSampling().mutate(original, None, random.Random(seed))
        changed = [c for c in COMPONENTS if getattr(child, c) != getattr(original, c)]
        assert len(changed) == 1 and child.id != original.id
        seen.add(changed[0])
    assert seen == {"sampling", "scaffold", "call_syntax"}


def test_train_tasks_nest_for_the_same_seed(env: LifeEnv) -> None:
    small, large = train_tasks(env, 8, seed=3), train_tasks(env, 24, seed=3)
    assert {t.id for t in small} <= {t.id for t in large} and len(large) == 24
    assert train_tasks(env, 8, seed=4) != small


class Trade(DemoLearner):
    """Solves one train task without demos and another one (only) with them: a tie on the minibatch."""

    def __init__(self, env: LifeEnv, alone: str, with_demos: str) -> None:
        super().__init__(env)
        self.alone, self.with_demos = alone, with_demos

    def _one(self, messages: list[dict]) -> Completion:
        if messages[-1]["role"] != "user" or "Tool result" in messages[-1]["content"]:
            return Completion(text="Done.", completion_tokens=2)
        request = messages[-1]["content"]
        if request == (self.with_demos if len(messages) > 2 else self.alone):
            return Completion(text=json.dumps({"name": "book_table", "arguments": _book_args(self.goals[request])}))
        return Completion(text="I am not sure.")


@pytest.mark.parametrize("keep_ties", [False, True])
def test_a_tie_that_wins_a_task_the_parent_loses_is_kept_only_with_keep_ties(env, original, tmp_path, keep_ties):
    a, b = [t.request for t in env.tasks("train") if t.goal["kind"] == "table"][:2]
    settings = _settings(mutators=["demos"], candidates=1, keep_ties=keep_ties)
    _, ledger, _ = _search(env, original, tmp_path, Trade(env, a, b), settings)
    child = ledger[1]
    assert sum(child.minibatch.values()) == sum(child.parent_minibatch.values()) == 1.0
    if keep_ties:
        assert child.status == "keep" and child.note.endswith("a tie that wins a task the parent loses")
        assert len(child.scores) == 4  # scored on dev, as every pool member is
    else:
        assert child.status == "discard" and child.note.endswith("not better")


class FlakyDemoLearner(DemoLearner):
    """A DemoLearner whose endpoint refuses the request that asks one task (demos showing it are fine)."""

    def __init__(self, env, refused: str) -> None:
        super().__init__(env)
        self.refused = refused

    def _one(self, messages: list[dict]) -> Completion:
        if messages[-1]["content"] == self.refused:
            return Completion(error="BadRequestError after 1 attempt: Error code: 400 - refused")
        return super()._one(messages)


def test_a_child_whose_rollouts_failed_at_the_endpoint_is_never_ranked(env, original, tmp_path) -> None:
    train = [t for t in env.tasks("train") if t.goal["kind"] == "table"][:4]
    policy = FlakyDemoLearner(env, refused=train[0].request)
    result, ledger, _ = _search(env, original, tmp_path, policy, _settings(mutators=["demos"], candidates=1))
    seed, child = ledger
    # Without the refusal the demos child wins 3 tasks to 0 and joins the pool (the test above).
    assert child.status == "discard" and sum(child.minibatch.values()) == 3.0
    assert child.note == "2 minibatch rollouts failed at the policy endpoint: not ranked"  # the child's and parent's
    assert result.best.id == original.id
