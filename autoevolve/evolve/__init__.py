"""Stage 1, prompt evolution: mutate HCP configs around the frozen weights and keep the ones that score better."""

from __future__ import annotations

import random
from dataclasses import dataclass

from autoevolve.envs import Environment
from autoevolve.evolve.mutators import Evidence, Mutator, keep_frozen, make_mutators
from autoevolve.hcp import HCPConfig
from autoevolve.records import Candidate, Task, Trajectory
from autoevolve.workbench import Workbench, mean

__all__ = ["EvolveResult", "evolve", "train_tasks"]


@dataclass
class EvolveResult:
    """The search's outcome: the best config, every candidate, and the train tasks they were scored on."""

    best: HCPConfig
    original: HCPConfig
    candidates: list[Candidate]
    configs: dict[str, HCPConfig]
    tasks: list[Task]


def train_tasks(env: Environment, n: int, seed: int) -> list[Task]:
    """The first n train tasks of a seeded shuffle: a smaller n gives a subset of a larger one's tasks."""
    pool = list(env.tasks("train"))
    random.Random(seed).shuffle(pool)
    return sorted(pool[:n], key=lambda t: t.id)


def evolve(
    bench: Workbench,
    original: HCPConfig,
    *,
    tasks: list[Task],
    candidates: int,
    mutators: list[str],
    demo_pool: int = 12,
    demo_k: tuple[int, ...] = (2, 3),
    demo_styles: tuple[str, ...] = ("full", "first_call"),
    frozen: list[str] = (),
    adapter: str = "",
    max_prompt_tokens: int | None = None,
) -> EvolveResult:
    """Greedy search from the original config: each child is built from the best config so far.

    A child is kept when its mean train reward beats the best so far and its mean prompt stays within
    ``max_prompt_tokens`` (long prompts cost every later rollout); a mutator that raises yields a crashed
    candidate, recorded with the reason, never an aborted search.
    """
    rng = random.Random(bench.seed)
    ops = make_mutators(mutators, demo_pool, demo_k, demo_styles)
    by_id = {t.id: t for t in tasks}
    evidence = Evidence(trajectories=[], tasks=by_id, reference=bench.env.reference)
    configs = {original.id: original}
    seed = _score(bench, original, tasks, adapter, evidence)
    pool = [_candidate(bench, original, None, "seed", "keep", seed)]
    best = pool[0]
    for i in range(candidates):
        op: Mutator = ops[i % len(ops)]
        parent = configs[best.hcp_id]
        try:
            child = keep_frozen(parent, op.propose(parent, evidence, rng), list(frozen))
        except ValueError as exc:
            pool.append(_crash(bench, parent, op, str(exc)))
            continue
        if child.id in configs:
            pool.append(_crash(bench, parent, op, f"proposed an already tried config {child.id}"))
            continue
        configs[child.id] = child.model_copy(update={"name": f"{original.name}+{op.name}{i + 1}"})
        trajs = _score(bench, configs[child.id], tasks, adapter, evidence)
        tokens = mean([float(t.prompt_tokens) for t in trajs])
        over = max_prompt_tokens is not None and tokens > max_prompt_tokens
        status = "keep" if mean([t.reward for t in trajs]) > best.mean_reward and not over else "discard"
        note = f"mean prompt of {tokens:.0f} tokens is over the budget of {max_prompt_tokens}" if over else ""
        pool.append(_candidate(bench, configs[child.id], parent.id, op.name, status, trajs, note))
        if status == "keep":
            best = pool[-1]
    return EvolveResult(configs[best.hcp_id], original, pool, configs, tasks)


def _score(bench: Workbench, hcp: HCPConfig, tasks: list[Task], adapter: str, evidence: Evidence) -> list[Trajectory]:
    """Roll a config out on the train tasks and add the rollouts to the evidence."""
    trajs = bench.rollouts(hcp, tasks, adapter=adapter, stage="evolve")
    evidence.trajectories.extend(trajs)
    return trajs


def _candidate(
    bench: Workbench,
    hcp: HCPConfig,
    parent: str | None,
    mutator: str,
    status: str,
    trajs: list[Trajectory],
    note: str = "",
) -> Candidate:
    """Record a scored candidate in the store."""
    scores = {t.task_id: t.reward for t in trajs}
    c = Candidate(
        run_id=bench.run_id,
        round=bench.round,
        hcp_id=hcp.id,
        parent_id=parent,
        mutator=mutator,
        status=status,
        scores=scores,
        mean_reward=mean(list(scores.values())),
        note=note,
    )
    bench.store.put_candidate(c)
    return c


def _crash(bench: Workbench, parent: HCPConfig, op: Mutator, why: str) -> Candidate:
    """Record a proposal that failed, with why."""
    c = Candidate(
        run_id=bench.run_id,
        round=bench.round,
        hcp_id=f"crash-{op.name}-{parent.id}",
        parent_id=parent.id,
        mutator=op.name,
        status="crash",
        note=why,
    )
    bench.store.put_candidate(c)
    return c
