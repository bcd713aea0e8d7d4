"""Stage 1's search: a Pareto search over HCP configs around the frozen weights.

Each step asks the next mutator for a proposal: its parent(s) from the per-task Pareto frontier of the pool (dev
scores) and how to make their child. The search rolls the parents out on a train minibatch, makes the child and
tries it on the same minibatch. A child that beats every parent there joins the pool and is scored on the dev
tasks; every attempt, kept or not, is a ledger row in the store with its lineage. The search stops when a budget
is spent, after ``patience`` children in a row that do not raise the best dev score, or after ``candidates``
children.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autoevolve.harness.hcp import COMPONENTS, HCPConfig, diff
from autoevolve.harness.rollout import ENDPOINT_ERROR
from autoevolve.harness.workbench import Workbench
from autoevolve.policy import ChatRequest, Policy
from autoevolve.records import Candidate, Task, Trajectory
from autoevolve.stages.evolve.budget import Budget
from autoevolve.stages.evolve.mutators import (
    ConstrainedDecoding,
    DemoBootstrap,
    Merge,
    ScaffoldSampling,
    ToolPresentation,
    keep_frozen,
)
from autoevolve.stages.evolve.proposal import (
    Evidence,
    Mutator,
    Proposal,
    ProposalError,
    SearchState,
    approx_tokens,
    unlabelled,
)
from autoevolve.stages.evolve.reflect import Reflective
from autoevolve.stages.settings import EvolveSettings
from autoevolve.stats import mean


@dataclass
class EvolveResult:
    """The search's outcome: the best config by dev score, the ledger, every config tried, the budget spent."""

    best: HCPConfig
    original: HCPConfig
    candidates: list[Candidate]
    configs: dict[str, HCPConfig]
    budget: dict[str, Any] = field(default_factory=dict)

    @property
    def best_dev(self) -> float:
        """Dev score of the best config."""
        return max(c.mean_reward for c in self.candidates if c.status == "keep")


def _demos(settings: EvolveSettings, reflector: Any, adapter: str | None) -> Mutator:
    return DemoBootstrap(
        settings.demo_pool,
        tuple(settings.demo_k),
        tuple(settings.demo_styles),
        settings.max_prompt_tokens,
        tuple(settings.demo_orders),
        tuple(settings.demo_matches),
    )


def _reflective(settings: EvolveSettings, reflector: Any, adapter: str | None) -> Mutator:
    if reflector is None:
        raise ValueError("the reflective mutator needs an optimiser policy")
    return Reflective(reflector, settings.reflection, frozen=settings.frozen, adapter=adapter)


MakeMutator = Callable[[EvolveSettings, Any, "str | None"], Mutator]  # (settings, optimiser policy, adapter)
MUTATORS: dict[str, MakeMutator] = {  # evolve.mutators names these
    "demos": _demos,
    "tool_format": lambda s, reflector, adapter: ToolPresentation([tuple(p) for p in s.presentations]),
    "scaffold": lambda s, reflector, adapter: ScaffoldSampling(),
    "decoding": lambda s, reflector, adapter: ConstrainedDecoding(),
    "reflective": _reflective,
    "merge": lambda s, reflector, adapter: Merge(),
}


def make_mutators(settings: EvolveSettings, reflector: Any = None, adapter: str | None = None) -> list[Mutator]:
    """Mutators by name (``MUTATORS``), in the order the settings list them (the reflective one needs an optimiser
    policy)."""
    return [MUTATORS[name](settings, reflector, adapter) for name in settings.mutators]


def evolve(
    bench: Workbench,
    original: HCPConfig,
    settings: EvolveSettings,
    *,
    train: list[Task],
    dev: list[Task],
    mutators: list[Mutator],
    adapter: str = "",
    carried: Sequence[HCPConfig] = (),
    labelled: list[Task] | None = None,
    labelled_demos: HCPConfig | None = None,
) -> EvolveResult:
    """Search configs from the original; children tried on ``train`` minibatches, pool members scored on ``dev``.

    ``carried`` configs (what earlier rounds found) and ``labelled_demos`` (the labelled references as demos) join
    the pool at the start, scored on dev under this round's adapter, so the search goes on from them instead of from
    the original alone. ``labelled``: the only tasks whose references may be shown (None: any train task's).
    """
    search = _Search(bench, settings, adapter, dev, labelled)
    limit = settings.budget.rollouts
    if limit is not None and search.budget.cost(original.id, dev) > limit:
        raise ValueError(
            f"evolve.budget.rollouts={limit} cannot even score the original config on {len(dev)} dev tasks "
            f"x {settings.samples} samples; raise it or lower evolve.dev_tasks"
        )
    search.seed(original)
    if labelled_demos is not None:
        search.carry(labelled_demos, original, "labels", "the labelled references as demos")
    for config in carried:
        search.carry(config, original, "carried", "carried over from an earlier round")
    rng = random.Random(bench.seed + 1000 * bench.round)  # a later round searches afresh, round 0 as seeded
    stop = search.run(mutators, train, rng)
    best = max(search.pool, key=lambda c: c.mean_reward)  # the first of equals: the seed wins ties
    return EvolveResult(
        search.configs[best.hcp_id], original, search.ledger, search.configs, search.budget.report(stop)
    )


STARTS = ("carried", "labels")  # pool members the search starts from, never discarded


class _Search:
    """The search's state: the pool (kept candidates), the ledger (every attempt), configs, lineage, budget."""

    def __init__(
        self, bench: Workbench, settings: EvolveSettings, adapter: str, dev: list[Task], labelled: list[Task] | None
    ) -> None:
        self.bench, self.settings, self.adapter, self.dev = bench, settings, adapter, dev
        self.budget = Budget(settings.budget, settings.samples)
        reference = bench.env.reference if settings.references else unlabelled
        shown = None if labelled is None else {t.id: t for t in labelled}
        if shown is not None:  # nothing outside the labelled set is ever read
            reference = _only(shown, reference)
        self.evidence = Evidence(
            trajectories=[], tasks={}, reference=reference, labelled=shown, count_tokens=_token_counter(bench.policy)
        )
        self.configs: dict[str, HCPConfig] = {}
        self.pool: list[Candidate] = []
        self.ledger: list[Candidate] = []
        self.parents: dict[str, list[str]] = {}
        self._evidence_keys: set[tuple[str, str, int]] = set()

    def seed(self, original: HCPConfig) -> None:
        """Score the original config on dev: the pool's first member."""
        self.configs[original.id] = original
        self._keep(Candidate(run_id=self.bench.run_id, round=self.bench.round, hcp_id=original.id, status="keep"))

    def carry(self, config: HCPConfig, original: HCPConfig, mutator: str, note: str) -> None:
        """Score a config on dev: a pool member from the start, as a child of the original."""
        if config.id in self.configs:
            return
        self.configs[config.id] = config
        self.parents[config.id] = [original.id]
        row = Candidate(
            run_id=self.bench.run_id,
            round=self.bench.round,
            hcp_id=config.id,
            parents=[original.id],
            mutator=mutator,
            status="keep",
            components=[c for c in COMPONENTS if getattr(config, c) != getattr(original, c)],
            diff=diff(original, config),
            note=note,
        )
        self._keep(row)

    def run(self, ops: list[Mutator], train: list[Task], rng: random.Random) -> str:
        """Propose children until a stop; returns why it stopped."""
        self.evidence.tasks = {t.id: t for t in train}
        s = self.settings
        state = SearchState(self.pool, self.configs, self.parents, rng)
        fails = 0
        for i in range(s.candidates):
            turn = self._next(ops, i, state)
            if turn is None:
                return "no mutator can propose (merge needs two pool members with a common ancestor)"
            op, proposal = turn
            batch = sorted(rng.sample(train, min(s.minibatch, len(train))), key=lambda t: t.id)
            cost = sum(self.budget.cost(p, batch) for p in proposal.parents) + (len(batch) + len(self.dev)) * s.samples
            stop = self.budget.spent(cost, op.calls)
            if stop:
                return stop
            best = max(c.mean_reward for c in self.pool)
            row = self._step(op, proposal, batch)
            fails = 0 if row.status == "keep" and row.mean_reward > best else fails + 1
            if s.budget.patience is not None and fails >= s.budget.patience:
                return "patience"
        return "candidates"

    def _next(self, ops: list[Mutator], i: int, state: SearchState) -> tuple[Mutator, Proposal] | None:
        """The first proposal of the mutators in turn from the i-th (one with nothing to propose is skipped)."""
        for k in range(len(ops)):
            op = ops[(i + k) % len(ops)]
            proposal = op.propose(state)
            if proposal is not None:
                return op, proposal
        return None

    def _step(self, op: Mutator, proposal: Proposal, batch: list[Task]) -> Candidate:
        """Make the proposed child and try it: crash, discard on the minibatch, or keep and score on dev."""
        parents = list(proposal.parents)
        row = Candidate(
            run_id=self.bench.run_id,
            round=self.bench.round,
            hcp_id="",
            parents=parents,
            mutator=op.name,
            status="crash",
        )
        parent = self.configs[parents[0]]
        scored = {p: self._rollouts(self.configs[p], batch) for p in parents}
        self.evidence.minibatch = scored[parents[0]]
        try:
            child = keep_frozen(parent, self._make(op, proposal), self.settings.frozen)
        except ValueError as exc:
            why = f"failed proposal: {exc}" if isinstance(exc, ProposalError) else str(exc)
            return self._crash(row, why, getattr(exc, "reply", ""))
        if child.id in self.configs:
            return self._crash(row, f"proposed an already tried config {child.id}")
        child = child.model_copy(update={"name": f"{parent.name.split('+')[0]}+{op.name}{len(self.ledger)}"})
        self.configs[child.id] = child
        self.parents[child.id] = parents
        trajs = self._rollouts(child, batch)
        per_parent = {p: _per_task(scored[p])[0] for p in parents}
        row = row.model_copy(
            update={
                "hcp_id": child.id,
                "components": [c for c in COMPONENTS if getattr(child, c) != getattr(parent, c)],
                "diff": diff(parent, child),
                "minibatch": _per_task(trajs)[0],
                "parent_minibatch": per_parent[parents[0]],
            }
        )
        failed = sum(t.error.startswith(ENDPOINT_ERROR) for t in [*trajs, *(t for p in scored.values() for t in p)])
        if failed:  # a score the endpoint made up is not ranked
            note = f"{failed} minibatch rollouts failed at the policy endpoint: not ranked"
            return self._record(row.model_copy(update={"status": "discard", "note": note}))
        beat = max(sum(scores.values()) for scores in per_parent.values())
        got = sum(row.minibatch.values())
        tokens = mean([float(t.prompt_tokens) for t in trajs])
        cap = self.settings.max_prompt_tokens
        if cap is not None and tokens > cap:
            note = f"mean prompt of {tokens:.0f} tokens is over the budget of {cap}"
            return self._record(row.model_copy(update={"status": "discard", "note": note}))
        versus = f"minibatch mean {got / len(batch):.3f} vs parent {beat / len(batch):.3f}"
        if got == beat and self.settings.keep_ties and _wins_a_task(row.minibatch, per_parent.values()):
            return self._keep(row.model_copy(update={"note": f"{versus}: a tie that wins a task the parent loses"}))
        if got <= beat:
            return self._record(row.model_copy(update={"status": "discard", "note": f"{versus}: not better"}))
        return self._keep(row.model_copy(update={"note": versus}))

    def _make(self, op: Mutator, proposal: Proposal) -> HCPConfig:
        """The proposed child, from the evidence that now holds the first parent's minibatch rollouts."""
        try:
            return proposal.make(self.evidence)
        finally:
            self.budget.optimiser_calls += op.calls

    def _crash(self, row: Candidate, why: str, reply: str = "") -> Candidate:
        """Record a proposal that failed (an optimiser's unusable reply is kept in ``diff``)."""
        crash_id = f"crash-{row.mutator}-{len(self.ledger)}"  # unique within the round's ledger
        return self._record(row.model_copy(update={"hcp_id": crash_id, "note": why, "diff": reply}))

    def _keep(self, row: Candidate) -> Candidate:
        """Score a pool member on the dev tasks (per-task mean and spread over samples) and record it."""
        trajs = self.bench.rollouts(
            self.configs[row.hcp_id], self.dev, adapter=self.adapter, stage="evolve", samples=self.settings.samples
        )
        self.budget.charge(trajs)
        scores, spreads = _per_task(trajs)
        failed = sum(t.error.startswith(ENDPOINT_ERROR) for t in trajs)
        if failed and row.parents and row.mutator not in STARTS:  # a child is not ranked by rollouts that never ran
            note = f"{failed} dev rollouts failed at the policy endpoint: not ranked"
            return self._record(row.model_copy(update={"status": "discard", "scores": scores, "note": note}))
        row = row.model_copy(
            update={"status": "keep", "scores": scores, "spreads": spreads, "mean_reward": mean(list(scores.values()))}
        )
        self.pool.append(row)
        return self._record(row)

    def _record(self, row: Candidate) -> Candidate:
        """Write a ledger row with the rollouts used so far."""
        row = row.model_copy(update={"rollouts_used": self.budget.rollouts})
        self.bench.store.put_candidate(row)
        self.ledger.append(row)
        return row

    def _rollouts(self, hcp: HCPConfig, tasks: list[Task]) -> list[Trajectory]:
        """Train rollouts of a config: charged to the budget and added to the evidence."""
        trajs = self.bench.rollouts(hcp, tasks, adapter=self.adapter, stage="evolve", samples=self.settings.samples)
        self.budget.charge(trajs)
        for t in trajs:
            if (t.hcp_id, t.task_id, t.sample) not in self._evidence_keys:
                self._evidence_keys.add((t.hcp_id, t.task_id, t.sample))
                self.evidence.trajectories.append(t)
        return trajs


def _only(tasks: dict[str, Task], reference: Any) -> Any:
    """A reference lookup that answers for the given tasks alone."""
    return lambda task: reference(task) if task.id in tasks else None


def _wins_a_task(child: dict[str, float], parents: Iterable[dict[str, float]]) -> bool:
    """Whether the child scores higher than every parent on some minibatch task."""
    return any(all(score > p.get(task, 0.0) for p in parents) for task, score in child.items())


def _per_task(trajs: list[Trajectory]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean reward and its spread (population std over samples) per task."""
    by_task: dict[str, list[float]] = {}
    for t in trajs:
        by_task.setdefault(t.task_id, []).append(t.reward)
    return (
        {k: mean(v) for k, v in by_task.items()},
        {k: statistics.pstdev(v) for k, v in by_task.items()},
    )


def _token_counter(policy: Policy) -> Any:
    """Prompt tokens by the policy's own tokenizer when it has one (LocalPolicy), else an estimate."""
    count = getattr(policy, "prompt_tokens", None)
    if count is None:
        return approx_tokens
    return lambda messages, tools=None: count(ChatRequest(messages=messages, tools=tools))
