"""Mutators: each proposes a child HCP config from its parent(s) in the pool and the evidence gathered so far.

A mutator changes components of the config and nothing else; the environment's scorer is out of its reach.
Single-parent mutators draw their parent from the Pareto frontier; ``Merge`` draws a pair of frontier members.
"""

from __future__ import annotations

import random

from autoevolve.harness.hcp import COMPONENTS, CallSyntax, Demo, Demos, HCPConfig, ToolFormat
from autoevolve.records import Task, Trajectory, without_failed_calls
from autoevolve.stages.evolve.pareto import merge_pairs
from autoevolve.stages.evolve.proposal import Evidence, Proposal, SearchState, from_frontier
from autoevolve.stages.settings import EvolveSettings


class DemoBootstrap:
    """Few-shot demos from successful train rollouts (the model's own), topped up with labelled solutions.

    As in DSPy's bootstrapping, labelled train examples seed the first demo set when the model has no
    successes yet; later proposals prefer trajectories the model itself completed with full reward.
    """

    name = "demos"
    calls = 0

    def __init__(
        self,
        pool: int = 12,
        ks: tuple[int, ...] = (2, 3),
        styles: tuple[str, ...] = ("full", "first_call"),
        max_prompt_tokens: int | None = None,
        orders: tuple[str, ...] = ("nearest_last",),
        matches: tuple[str, ...] = ("request",),
    ) -> None:
        self.pool, self.ks, self.styles, self.orders, self.matches = pool, ks, styles, orders, matches
        self.max_prompt_tokens = max_prompt_tokens

    def propose(self, state: SearchState) -> Proposal:
        """A frontier parent and its child by ``mutate``."""
        return from_frontier(state, self.mutate)

    def mutate(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Parent with a fresh demo set retrieved per task by similarity."""
        own = _successes(evidence.trajectories)
        tiers = sorted({t.tier for t in evidence.tasks.values()})
        if len(tiers) > 1:  # every tier in play gets its share, so a new tier's tasks see demos of their own kind
            chosen = []
            for i, tier in enumerate(tiers):
                share = self.pool // len(tiers) + (i < self.pool % len(tiers))
                tier_tasks = {k: t for k, t in evidence.tasks.items() if t.tier == tier}
                mine = [d for d in own if d.task_id in tier_tasks]
                labelled = {k: t for k, t in _labelled(evidence).items() if t.tier == tier}
                chosen += self._draw(mine, labelled, evidence, share, rng)
        else:
            chosen = self._draw(own, _labelled(evidence), evidence, self.pool, rng)
        if not chosen:
            raise ValueError("no successful train rollouts and no labelled solutions to take demos from")
        chosen.sort(key=lambda d: d.task_id)  # the order is fixed by content, not by draw order
        order = rng.choice(self.orders)
        k, style = rng.choice(self.ks), rng.choice(self.styles)
        match = self.matches[0] if len(self.matches) == 1 else rng.choice(self.matches)  # one: no draw, same stream
        demos = Demos(items=chosen, select="nearest", k=k, style=style, order=order, match=match)
        return self._within_budget(parent.model_copy(update={"demos": demos}), evidence)

    @staticmethod
    def _draw(own: list[Demo], tasks: dict[str, Task], evidence: Evidence, n: int, rng: random.Random) -> list[Demo]:
        """Up to n demos: the model's own successes first, topped up with the labelled solutions of ``tasks``."""
        chosen = rng.sample(own, min(n, len(own)))
        taken = {d.task_id for d in chosen}
        spare = [t for t in tasks.values() if t.id not in taken]
        rng.shuffle(spare)
        for task in spare:
            if len(chosen) >= n:
                break
            messages = evidence.reference(task)
            if messages:
                chosen.append(Demo(task_id=task.id, messages=messages))
        return chosen

    def _within_budget(self, child: HCPConfig, evidence: Evidence) -> HCPConfig:
        """Fewer demos per task until the mean first prompt fits the prompt-token budget."""
        if self.max_prompt_tokens is None:
            return child
        probe = sorted(evidence.tasks.values(), key=lambda t: t.id)[:8]
        while True:
            tokens = sum(evidence.count_tokens(*child.render(t)) for t in probe) / max(len(probe), 1)
            if tokens <= self.max_prompt_tokens:
                return child
            if child.demos.k == 1:
                raise ValueError(
                    f"one demo already makes a {tokens:.0f}-token prompt (budget {self.max_prompt_tokens})"
                )
            child = child.model_copy(update={"demos": child.demos.model_copy(update={"k": child.demos.k - 1})})


def _labelled(evidence: Evidence) -> dict[str, Task]:
    """The tasks whose references may top up a demo set: the labelled set, or (without one) the train tasks."""
    return evidence.tasks if evidence.labelled is None else evidence.labelled


def _successes(trajs: list[Trajectory]) -> list[Demo]:
    """One demo per task from full-reward, error-free rollouts (the shortest conversation wins), without the calls
    the harness could not run."""
    best: dict[str, Trajectory] = {}
    for t in trajs:
        if t.reward < 1.0 or t.error:
            continue
        if t.task_id not in best or len(t.messages) < len(best[t.task_id].messages):
            best[t.task_id] = t
    ordered = sorted(best.values(), key=lambda t: t.task_id)
    return [Demo(task_id=t.task_id, messages=without_failed_calls(t.messages)) for t in ordered]


class ToolPresentation:
    """Another way of showing the tools (JSON schema, Python signatures, compact list) with a call syntax."""

    name = "tool_format"
    calls = 0

    def __init__(self, presentations: list[tuple[ToolFormat, CallSyntax]] | None = None) -> None:
        self.presentations = presentations or EvolveSettings().presentations

    def propose(self, state: SearchState) -> Proposal:
        """A frontier parent and its child by ``mutate``."""
        return from_frontier(state, self.mutate)

    def mutate(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Parent with a different (tool format, call syntax) pair, and demo style toggled half the time."""
        options = [p for p in self.presentations if p != (parent.tool_format, parent.call_syntax)]
        if not options:
            raise ValueError("no other tool presentation to try (evolve.presentations)")
        tool_format, call_syntax = rng.choice(options)
        update: dict = {"tool_format": tool_format, "call_syntax": call_syntax}
        if parent.demos.items and rng.random() < 0.5:
            style = "first_call" if parent.demos.style == "full" else "full"
            update["demos"] = parent.demos.model_copy(update={"style": style})
        return parent.model_copy(update=update)


class ScaffoldSampling:
    """One scaffold or sampling knob: temperature, step limit, plan-before-acting, or the reply's call syntax."""

    name = "scaffold"
    calls = 0

    def propose(self, state: SearchState) -> Proposal:
        """A frontier parent and its child by ``mutate``."""
        return from_frontier(state, self.mutate)

    def mutate(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Parent with one knob changed."""
        knobs = ["temperature", "max_steps", "plan_first"] + (["call_syntax"] if parent.tool_format != "native" else [])
        knob = rng.choice(knobs)
        if knob == "temperature":
            value = rng.choice([t for t in (0.0, 0.3, 0.7) if t != parent.sampling.temperature])
            return parent.model_copy(update={"sampling": parent.sampling.model_copy(update={"temperature": value})})
        if knob == "max_steps":
            steps = parent.scaffold.max_steps
            value = rng.choice([s for s in (steps - 1, steps + 1) if 1 <= s <= 64])
            return parent.model_copy(update={"scaffold": parent.scaffold.model_copy(update={"max_steps": value})})
        if knob == "plan_first":
            scaffold = parent.scaffold.model_copy(update={"plan_first": not parent.scaffold.plan_first})
            return parent.model_copy(update={"scaffold": scaffold})
        return parent.model_copy(update={"call_syntax": "python" if parent.call_syntax == "json" else "json"})


class ConstrainedDecoding:
    """Decoding under the tool-call grammar, or free again (see autoevolve.policy.grammar)."""

    name = "decoding"
    calls = 0

    def propose(self, state: SearchState) -> Proposal:
        """A frontier parent and its child by ``mutate``."""
        return from_frontier(state, self.mutate)

    def mutate(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Parent with ``decoding.constrain`` switched between 'none' and 'tool_call'."""
        constrain = "none" if parent.decoding.constrain == "tool_call" else "tool_call"
        return parent.model_copy(update={"decoding": parent.decoding.model_copy(update={"constrain": constrain})})


class Merge:
    """Combine two pool members that share an ancestor: each takes over the components it changed (GEPA's merge)."""

    name = "merge"
    calls = 0

    def propose(self, state: SearchState) -> Proposal | None:
        """A frontier pair with a common ancestor, neither descending from the other; None when no pair qualifies.

        Where both changed a component, the parent with the higher dev score (the first on a tie) gives it.
        """
        pairs = merge_pairs(state.pool, state.lineage)
        if not pairs:
            return None
        a, b, ancestor = state.rng.choice(pairs)
        scores = {c.hcp_id: c.mean_reward for c in state.pool}
        configs, prefer_a = state.configs, scores[a] >= scores[b]
        return Proposal((a, b), lambda evidence: self.combine(configs[a], configs[b], configs[ancestor], prefer_a))

    def combine(self, a: HCPConfig, b: HCPConfig, ancestor: HCPConfig, prefer_a: bool) -> HCPConfig:
        """``a`` with every component only ``b`` changed from the ancestor; where both changed, the preferred one's."""
        update = {}
        for name in COMPONENTS:
            mine, theirs, old = getattr(a, name), getattr(b, name), getattr(ancestor, name)
            if mine != theirs and (mine == old or (theirs != old and not prefer_a)):
                update[name] = theirs
        child = a.model_copy(update=update)
        if child.id in (a.id, b.id):
            raise ValueError(f"merging {a.id} and {b.id} gives one of them back: no component to combine")
        return child


def keep_frozen(parent: HCPConfig, child: HCPConfig, frozen: list[str]) -> HCPConfig:
    """The child with every frozen component copied back from the parent."""
    if not frozen:
        return child
    return child.model_copy(update={name: getattr(parent, name) for name in frozen})
