"""Mutators: each proposes a valid child that differs from its parent, the same one for the same seed."""

from __future__ import annotations

import random

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import COMPONENTS, HCPConfig
from autoevolve.records import Candidate, Trajectory
from autoevolve.stages.evolve import make_mutators
from autoevolve.stages.evolve.mutators import DemoBootstrap, Merge, ToolPresentation, keep_frozen
from autoevolve.stages.evolve.pareto import sample_parent
from autoevolve.stages.evolve.proposal import Evidence, ProposalError, SearchState
from autoevolve.stages.evolve.reflect import Reflective, apply_reply
from autoevolve.stages.settings import EvolveSettings, ReflectionSettings
from tests.harness.test_rollout import Scripted

GOOD_REPLIES = {
    "system_prompt": "```\nYou book things. Tools:\n{tools}\n\n{call_format}\nAlways call a tool first.\n{memory}\n```",
    "tools": "```yaml\n- name: book_table\n  description: Reserve a table; use the id from the request.\n```",
    "routing": "```\nHandle bookings yourself.\n```",
    "memory": "```\nDate: {today}. User: {user}.\n```",
    "sampling": "```yaml\ntemperature: 0.3\ntop_p: 0.9\nmax_new_tokens: 80\n```",
    "scaffold": "```yaml\nmax_steps: 3\ntool_result_role: user\nplan_first: true\n```",
}


def _evidence(env: LifeEnv, successes: int = 0) -> Evidence:
    tasks = env.tasks("train")[:20]
    trajs = [
        Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="h", messages=env.reference(t), reward=1.0)
        for t in tasks[:successes]
    ]
    failed = Trajectory(
        run_id="r",
        task_id=tasks[-1].id,
        split="train",
        hcp_id="h",
        messages=env.reference(tasks[-1])[:1],
        reward=0.0,
        feedback="Expected a booking at R-123.",
    )
    return Evidence(trajectories=trajs, tasks={t.id: t for t in tasks}, reference=env.reference, minibatch=[failed])


def _reflective(component: str, reply: str) -> tuple[Reflective, Scripted]:
    optimiser = Scripted([reply])
    return Reflective(optimiser, ReflectionSettings(components=[component])), optimiser


@pytest.mark.parametrize("name", ["demos", "tool_format", "scaffold", "decoding", "reflective"])
def test_each_mutator_gives_a_valid_different_child_from_a_fixed_seed(env, original, name) -> None:
    settings = EvolveSettings(mutators=[name], demo_pool=4, reflection=ReflectionSettings(components=["system_prompt"]))
    [op] = make_mutators(settings, Scripted([GOOD_REPLIES["system_prompt"]]))
    a = op.mutate(original, _evidence(env, 2), random.Random(7))
    b = op.mutate(original, _evidence(env, 2), random.Random(7))
    assert a == b and a.id != original.id
    assert HCPConfig.model_validate(a.model_dump()) == a  # round-trips: a valid config
    a.render(env.tasks("dev")[0])


@pytest.mark.parametrize("component", sorted(GOOD_REPLIES))
def test_reflective_rewrites_only_the_drawn_component(env, original, component) -> None:
    op, optimiser = _reflective(component, f"Sure! Here it is.\n{GOOD_REPLIES[component]}\nHope it helps.")
    child = op.mutate(original, _evidence(env), random.Random(0))
    changed = [c for c in COMPONENTS if getattr(child, c) != getattr(original, c)]
    assert changed == [component]
    assert optimiser.calls == 1


def test_a_reply_cut_off_inside_its_block_still_parses(original) -> None:
    child = apply_reply(original, "routing", "Here:\n```text\nHandle bookings yourself.\nHand on anything")
    assert child.routing == "Handle bookings yourself.\nHand on anything"


def test_reflective_prompt_shows_the_component_and_the_feedback(env, original) -> None:
    seen = []

    class Recorder(Scripted):
        def generate(self, requests, adapter=None):
            seen.extend(requests)
            return super().generate(requests, adapter)

    op = Reflective(Recorder([GOOD_REPLIES["tools"]]), ReflectionSettings(components=["tools"]))
    child = op.mutate(original, _evidence(env), random.Random(0))
    prompt = seen[0].messages[1]["content"]
    assert "Expected a booking at R-123." in prompt and "name: book_table" in prompt and "(score 0.00)" in prompt
    book = next(t["function"] for t in child.tools if t["function"]["name"] == "book_table")
    assert book["description"] == "Reserve a table; use the id from the request."
    assert child.tool_names == original.tool_names and book["parameters"] == next(
        t["function"]["parameters"] for t in original.tools if t["function"]["name"] == "book_table"
    )


@pytest.mark.parametrize(
    ("component", "reply", "why"),
    [
        ("system_prompt", "```\nBe helpful.\n```", "drops the placeholder {tools}"),
        ("tools", "```yaml\n- name: teleport\n  description: x\n```", "unknown tool 'teleport'"),
        ("tools", "```yaml\n- name: book_table\n  parameters: {seats: n}\n```", "unknown parameter book_table.seats"),
        ("tools", "```yaml\n- name: [unclosed\n```", "is not valid YAML or JSON"),
        ("scaffold", "```yaml\nmax_steps: 999\n```", "not a valid HCP config: scaffold.max_steps"),
        ("sampling", '```json\n{"temperature": "hot"}\n```', "not a valid HCP config: sampling.temperature"),
        ("routing", "```\n```", "holds no new routing"),
    ],
)
def test_unusable_replies_raise_proposal_errors_that_keep_the_reply(original, component, reply, why) -> None:
    with pytest.raises(ProposalError, match=why.replace("{", r"\{").replace("}", r"\}").replace("[", r"\[")) as err:
        apply_reply(original, component, reply)
    assert err.value.reply == reply


def test_frozen_components_are_never_drawn_or_changed(env, original) -> None:
    op, _ = _reflective("system_prompt", GOOD_REPLIES["system_prompt"])
    op.components = []
    with pytest.raises(ValueError, match="every component the reflective mutator may rewrite is frozen"):
        op.mutate(original, _evidence(env), random.Random(0))
    for name in ("demos", "tool_format", "scaffold"):
        [mutator] = make_mutators(EvolveSettings(mutators=[name], demo_pool=4))
        child = mutator.mutate(original, _evidence(env, 2), random.Random(1))
        kept = keep_frozen(original, child, list(COMPONENTS))
        assert kept.id == original.id


def test_demo_bootstrap_is_seeded_and_prefers_own_successes(env, original) -> None:
    op = DemoBootstrap(pool=6)
    a = op.mutate(original, _evidence(env, successes=4), random.Random(1))
    assert len(a.demos.items) == 6 and a.demos.select == "nearest"
    own = {t.id for t in env.tasks("train")[:4]}
    assert own <= {d.task_id for d in a.demos.items}  # all four successes are used before any labelled one
    assert a.tools == original.tools and a.system_prompt == original.system_prompt


def test_demo_bootstrap_fits_the_prompt_token_budget(env, original) -> None:
    evidence = _evidence(env, successes=6)
    loose = DemoBootstrap(pool=6, ks=(3,), styles=("full",)).mutate(original, evidence, random.Random(0))
    tokens = [evidence.count_tokens(*loose.render(t)) for t in sorted(evidence.tasks.values(), key=lambda t: t.id)]
    mean = sum(tokens[:8]) / 8
    tight = DemoBootstrap(pool=6, ks=(3,), styles=("full",), max_prompt_tokens=int(mean) - 1)
    child = tight.mutate(original, evidence, random.Random(0))
    assert child.demos.k < 3
    with pytest.raises(ValueError, match="one demo already makes a"):
        DemoBootstrap(pool=6, ks=(3,), max_prompt_tokens=10).mutate(original, evidence, random.Random(0))


def test_demo_bootstrap_without_any_source_raises(env, original) -> None:
    empty = Evidence(trajectories=[], tasks={}, reference=env.reference)
    with pytest.raises(ValueError, match="no successful train rollouts"):
        DemoBootstrap().mutate(original, empty, random.Random(0))


def test_tool_presentation_changes_format_only(original) -> None:
    child = ToolPresentation().mutate(original, Evidence([], {}), random.Random(3))
    assert (child.tool_format, child.call_syntax) != (original.tool_format, original.call_syntax)
    assert child.system_prompt == original.system_prompt and child.demos == original.demos


def test_merge_takes_each_parents_changes_over_the_ancestor(original) -> None:
    a = original.model_copy(update={"routing": "Route A."})
    b = original.model_copy(update={"tool_format": "python", "call_syntax": "python"})
    child = Merge().combine(a, b, original, prefer_a=True)
    assert (child.routing, child.tool_format, child.call_syntax) == ("Route A.", "python", "python")
    a = a.model_copy(update={"memory": a.memory.model_copy(update={"template": "Date {today}."})})
    both = b.model_copy(update={"routing": "Route B."})
    preferring_b = Merge().combine(a, both, original, prefer_a=False)
    assert (preferring_b.routing, preferring_b.memory, preferring_b.tool_format) == ("Route B.", a.memory, "python")
    assert Merge().combine(a, both, original, prefer_a=True).routing == "Route A."
    with pytest.raises(ValueError, match="no component to combine"):
        Merge().combine(a, original, original, prefer_a=True)


def _member(hcp: HCPConfig, scores: dict[str, float]) -> Candidate:
    mean = sum(scores.values()) / len(scores)
    return Candidate(run_id="r", hcp_id=hcp.id, status="keep", scores=scores, mean_reward=mean)


def test_merge_proposes_two_frontier_siblings_or_nothing(original) -> None:
    a = original.model_copy(update={"routing": "Route A."})
    b = original.model_copy(update={"tool_format": "python", "call_syntax": "python"})
    configs = {c.id: c for c in (original, a, b)}
    state = SearchState([_member(original, {"t1": 0.0, "t2": 0.0})], configs, {}, random.Random(0))
    assert Merge().propose(state) is None  # the seed alone: no pair to merge
    state.pool += [_member(a, {"t1": 1.0, "t2": 0.0}), _member(b, {"t1": 0.0, "t2": 1.0})]
    state.lineage.update({a.id: [original.id], b.id: [original.id]})
    proposal = Merge().propose(state)
    assert sorted(proposal.parents) == sorted([a.id, b.id])
    child = proposal.make(Evidence([], {}))
    assert (child.routing, child.tool_format, child.call_syntax) == ("Route A.", "python", "python")
    state.lineage[b.id] = [a.id]  # b descends from a: no longer a pair
    assert Merge().propose(state) is None


def test_a_single_parent_proposal_draws_a_frontier_parent_and_mutates_it(original) -> None:
    a = original.model_copy(update={"routing": "Route A."})
    pool = [_member(original, {"t1": 0.0}), _member(a, {"t1": 1.0})]
    state = SearchState(pool, {c.id: c for c in (original, a)}, {a.id: [original.id]}, random.Random(3))
    proposal = ToolPresentation().propose(state)
    assert proposal.parents == (a.id,)  # the only frontier member
    child = proposal.make(Evidence([], {}))
    replay = random.Random(3)
    sample_parent(pool, replay)  # the parent is drawn first, then the mutation's own draws
    assert child == ToolPresentation().mutate(a, Evidence([], {}), replay)
    assert child.routing == "Route A." and child.tool_format != a.tool_format


def test_demo_bootstrap_gives_every_tier_in_play_its_share(original) -> None:
    two = LifeEnv(tiers=(1, 2))
    tasks = two.tasks("train")[:20]  # tiers interleave: 10 of each
    wins = [t for t in tasks if t.tier == 1][:8]  # the live adapter solves tier 1 only
    trajs = [
        Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="h", messages=two.reference(t), reward=1.0)
        for t in wins
    ]
    evidence = Evidence(trajectories=trajs, tasks={t.id: t for t in tasks}, reference=two.reference)
    child = DemoBootstrap(pool=6).mutate(original, evidence, random.Random(0))
    tiers = {t.id: t.tier for t in tasks}
    picked = [tiers[d.task_id] for d in child.demos.items]
    assert picked.count(1) == 3 and picked.count(2) == 3  # without shares: six tier-1 successes, no tier-2 demo
    assert {d.task_id for d in child.demos.items if tiers[d.task_id] == 1} <= {t.id for t in wins}


def test_decoding_switches_the_grammar_and_presentations_come_from_the_settings(original) -> None:
    settings = EvolveSettings(mutators=["decoding", "tool_format"], presentations=[("json", "python_list")])
    decoding, presentation = make_mutators(settings)
    on = decoding.mutate(original, Evidence([], {}), random.Random(0))
    assert on.decoding.constrain == "tool_call" and on.model_copy(update={"decoding": original.decoding}) == original
    assert decoding.mutate(on, Evidence([], {}), random.Random(0)).decoding.constrain == "none"
    child = presentation.mutate(original, Evidence([], {}), random.Random(0))
    assert (child.tool_format, child.call_syntax) == ("json", "python_list")
    with pytest.raises(ValueError, match="no other tool presentation to try"):
        presentation.mutate(child, Evidence([], {}), random.Random(0))


def test_every_mutator_a_config_may_name_is_in_the_table() -> None:
    from typing import get_args

    from autoevolve.stages.evolve.search import MUTATORS
    from autoevolve.stages.settings import MutatorName

    assert set(get_args(MutatorName)) == set(MUTATORS)
