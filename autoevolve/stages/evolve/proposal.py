"""What the search and its mutators share: the state a mutator reads, the proposal it returns, the evidence.

As in GEPA, every proposer answers one ``propose(state)``: the parents it chose from the pool and how to make
their child, or None when it has nothing to propose. The search treats every proposal alike: it rolls the
parents out on a train minibatch, makes the child, and keeps it only if it beats every parent there.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import Candidate, Message, Task, Trajectory
from autoevolve.stages.evolve.pareto import sample_parent

TokenCounter = Callable[[list[dict[str, Any]], "list[dict] | None"], int]


def approx_tokens(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> int:
    """A tokenizer-free estimate: about four characters a token."""
    return (sum(len(str(m.get("content") or "")) for m in messages) + len(json.dumps(tools or []))) // 4


def unlabelled(task: Task) -> list[Message] | None:
    """No labelled solution for any task: what a deployment with rewards but no labels has."""
    return None


@dataclass
class Evidence:
    """What a mutator may read: train rollouts so far, the parent's minibatch rollouts, train tasks, solutions.

    Only train rollouts are ever evidence: dev tasks score candidates and must not leak into demos or reflection.
    """

    trajectories: list[Trajectory]
    tasks: dict[str, Task]
    reference: Callable[[Task], list[Message] | None] = field(default=unlabelled)
    labelled: dict[str, Task] | None = None  # the tasks whose references may be shown; None: any of ``tasks``
    minibatch: list[Trajectory] = field(default_factory=list)
    count_tokens: TokenCounter = approx_tokens


class ProposalError(ValueError):
    """A mutator could not propose a valid child; ``reply`` keeps an optimiser's raw output for the ledger."""

    def __init__(self, why: str, reply: str = "") -> None:
        super().__init__(why)
        self.reply = reply


@dataclass
class SearchState:
    """What the search shows a mutator: the dev-scored pool, every config tried, their lineage, the search's rng.

    These are the search's own containers, not copies: a mutator reads them and changes none.
    """

    pool: list[Candidate]
    configs: dict[str, HCPConfig]
    lineage: dict[str, list[str]]  # HCP id -> its parents' ids
    rng: random.Random


@dataclass(frozen=True)
class Proposal:
    """Parents a mutator chose (their ids, the first one the child is diffed against) and how to make the child.

    The search calls ``make`` once it has rolled every parent out on the minibatch, with the first parent's
    rollouts in ``evidence.minibatch``; a ValueError from it (ProposalError for an optimiser's reply) is a crash.
    """

    parents: tuple[str, ...]
    make: Callable[[Evidence], HCPConfig]


Mutation = Callable[[HCPConfig, Evidence, random.Random], HCPConfig]


class Mutator(Protocol):
    """Proposes a child config from the search state; None when it has nothing to propose."""

    name: str
    calls: int  # optimiser-LLM calls one proposal makes (budgeted by the search)

    def propose(self, state: SearchState) -> Proposal | None:
        """The parents this mutator chose and how to make their child."""
        ...


def from_frontier(state: SearchState, mutate: Mutation) -> Proposal:
    """One parent drawn from the Pareto frontier; its child is ``mutate(parent, evidence, rng)``."""
    parent = sample_parent(state.pool, state.rng)
    return Proposal((parent,), lambda evidence: mutate(state.configs[parent], evidence, state.rng))
