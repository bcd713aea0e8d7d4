"""The per-task Pareto frontier of the candidate pool, parent sampling from it, and merge partners.

As in GEPA: a candidate is on the frontier when it has the best score on at least one dev task and no other
candidate is at least as good on every task and better on one. Parents are drawn in proportion to the number
of tasks they lead, so a config that solves tasks nobody else solves keeps being explored.
"""

from __future__ import annotations

import random

from autoevolve.records import Candidate


def frontier(pool: list[Candidate]) -> dict[str, int]:
    """Frontier members (HCP id) and how many dev tasks each leads (ties lead together)."""
    tasks = sorted({task for c in pool for task in c.scores})
    leads: dict[str, int] = {}
    for task in tasks:
        best = max(c.scores.get(task, 0.0) for c in pool)
        for c in pool:
            if c.scores.get(task, 0.0) == best:
                leads[c.hcp_id] = leads.get(c.hcp_id, 0) + 1
    members = [c for c in pool if c.hcp_id in leads]
    return {c.hcp_id: leads[c.hcp_id] for c in members if not any(_dominates(o, c, tasks) for o in members)}


def _dominates(a: Candidate, b: Candidate, tasks: list[str]) -> bool:
    """a is at least as good as b on every task and better on one."""
    pairs = [(a.scores.get(t, 0.0), b.scores.get(t, 0.0)) for t in tasks]
    return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)


def sample_parent(pool: list[Candidate], rng: random.Random) -> str:
    """A frontier member, drawn with weight = tasks it leads; the seed when nothing has scores yet."""
    front = frontier(pool)
    if not front:
        return pool[0].hcp_id
    ids = sorted(front)
    return rng.choices(ids, weights=[front[i] for i in ids])[0]


def ancestors(hcp_id: str, parents: dict[str, list[str]]) -> list[str]:
    """Every ancestor of a config, nearest first (breadth-first over the lineage)."""
    seen: list[str] = []
    queue = list(parents.get(hcp_id, []))
    while queue:
        node = queue.pop(0)
        if node not in seen:
            seen.append(node)
            queue.extend(parents.get(node, []))
    return seen


def merge_pairs(pool: list[Candidate], parents: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """Frontier pairs (a, b, nearest common ancestor) where neither descends from the other."""
    front = sorted(frontier(pool))
    pairs = []
    for i, a in enumerate(front):
        for b in front[i + 1 :]:
            up_a, up_b = ancestors(a, parents), ancestors(b, parents)
            if a in up_b or b in up_a:
                continue
            common = [x for x in up_a if x in up_b]
            if common:
                pairs.append((a, b, common[0]))
    return pairs
