"""The per-task Pareto frontier, parent sampling and merge partners."""

from __future__ import annotations

import random
from collections import Counter

from autoevolve.records import Candidate
from autoevolve.stages.evolve.pareto import ancestors, frontier, merge_pairs, sample_parent


def _c(hcp_id: str, **scores: float) -> Candidate:
    return Candidate(run_id="r", hcp_id=hcp_id, status="keep", scores=scores)


POOL = [
    _c("seed", t1=0.0, t2=0.0, t3=0.5),
    _c("a", t1=1.0, t2=0.0, t3=0.5),  # leads t1 and t3 (tie)
    _c("b", t1=0.0, t2=1.0, t3=0.5),  # leads t2 and t3
    _c("c", t1=1.0, t2=0.0, t3=0.0),  # dominated by a
]


def test_frontier_counts_led_tasks_and_drops_dominated_members() -> None:
    assert frontier(POOL) == {"a": 2, "b": 2}
    assert frontier(POOL[:1]) == {"seed": 3}


def test_parents_are_drawn_from_the_frontier_by_weight() -> None:
    rng = random.Random(0)
    drawn = Counter(sample_parent(POOL, rng) for _ in range(400))
    assert set(drawn) == {"a", "b"} and 150 < drawn["a"] < 250
    assert sample_parent(POOL, random.Random(5)) == sample_parent(POOL, random.Random(5))


def test_merge_pairs_need_a_common_ancestor_and_no_descent() -> None:
    parents = {"a": ["seed"], "b": ["seed"], "c": ["a"]}
    assert ancestors("c", parents) == ["a", "seed"]
    assert merge_pairs(POOL, parents) == [("a", "b", "seed")]
    assert merge_pairs(POOL, {"a": ["seed"], "b": ["a"]}) == []  # b descends from a
    assert merge_pairs(POOL, {}) == []
