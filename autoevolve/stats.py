"""Statistics over per-task rewards, with no engine behind them: means, bootstrap intervals, the paired sign-flip
test the gate decides with. Read-only modules (reports, inspection, benches) import these without the rollout engine.
"""

from __future__ import annotations

import random
from collections import defaultdict


def mean(values: list[float]) -> float:
    """Arithmetic mean; 0.0 for no values."""
    return sum(values) / len(values) if values else 0.0


BOOTSTRAP = 2000  # resamples; the interval's ends move by well under 0.01 between seeds at this count
ALPHA = 0.025  # the gate's one-sided level
EXACT_SUMS = 200_000  # distinct sums the exact test may track; past that it draws sign flips instead
FLIPS = 20_000  # sign-flip draws when it does


def bootstrap_ci(values: list[float], seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean (tasks resampled with replacement)."""
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(BOOTSTRAP))
    return (round(means[int(0.025 * BOOTSTRAP)], 4), round(means[int(0.975 * BOOTSTRAP) - 1], 4))


def sign_flip_p(diffs: list[float], seed: int = 0) -> float:
    """One-sided p-value of a paired gain: the share of the 2^n ways of flipping the signs of the per-task
    differences whose sum reaches the observed sum. Exact, by counting the sums each flip reaches (rewards on few
    levels reach few sums); zero differences flip to themselves. Past ``EXACT_SUMS`` distinct sums, ``FLIPS`` seeded
    random flips estimate it instead, (1 + hits) / (1 + draws)."""
    micro = [round(d * 1e6) for d in diffs]  # integer micro-units: exact sums
    steps = [abs(m) for m in micro if m]
    observed = sum(micro)  # of the rounded differences: the flips' sums are of those too
    sums: dict[int, int] = {0: 1}
    for step in steps:
        reached: dict[int, int] = defaultdict(int)
        for total, ways in sums.items():
            reached[total + step] += ways
            reached[total - step] += ways
        sums = reached
        if len(sums) > EXACT_SUMS:
            rng = random.Random(seed)
            hits = sum(sum(s if rng.random() < 0.5 else -s for s in steps) >= observed for _ in range(FLIPS))
            return (1 + hits) / (1 + FLIPS)
    return sum(ways for total, ways in sums.items() if total >= observed) / 2 ** len(steps)


def hierarchical_ci(groups: list[list[float]], seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean over groups (e.g. seeds) of each group's mean over its values
    (e.g. test tasks): groups resampled with replacement, then values within each drawn group, so the interval
    carries both the spread between seeds and the noise of a finite task set."""
    groups = [g for g in groups if g]
    if not groups:
        return (0.0, 0.0)
    rng = random.Random(seed)
    means = []
    for _ in range(BOOTSTRAP):
        drawn = rng.choices(groups, k=len(groups))
        means.append(sum(sum(rng.choices(g, k=len(g))) / len(g) for g in drawn) / len(drawn))
    means.sort()
    return (round(means[int(0.025 * BOOTSTRAP)], 4), round(means[int(0.975 * BOOTSTRAP) - 1], 4))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values for testing them together (each is compared with alpha as is)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
