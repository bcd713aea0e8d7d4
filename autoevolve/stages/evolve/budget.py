"""The search's budget: rollouts, generated tokens, optimiser-LLM calls and wall-clock, counted exactly.

A rollout is counted once per (config, task, sample) the search asks for, whether generated now or read back
from the store, so a resumed search spends (and stops) exactly as the first attempt did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from autoevolve.records import Task, Trajectory
from autoevolve.stages.settings import BudgetSettings


@dataclass
class Budget:
    """What the search has spent against its limits."""

    limits: BudgetSettings
    samples: int = 1
    rollouts: int = 0
    generated_tokens: int = 0
    optimiser_calls: int = 0
    started: float = field(default_factory=time.monotonic)
    _seen: set[tuple[str, str, int]] = field(default_factory=set)

    def cost(self, hcp_id: str, tasks: list[Task]) -> int:
        """Rollouts that scoring a config on these tasks would add."""
        return sum((hcp_id, t.id, s) not in self._seen for t in tasks for s in range(self.samples))

    def charge(self, trajectories: list[Trajectory]) -> None:
        """Count rollouts (and their generated tokens) not counted before."""
        for t in trajectories:
            key = (t.hcp_id, t.task_id, t.sample)
            if key not in self._seen:
                self._seen.add(key)
                self.rollouts += 1
                self.generated_tokens += t.completion_tokens

    @property
    def seconds(self) -> float:
        """Wall-clock seconds since the search started."""
        return time.monotonic() - self.started

    def spent(self, next_rollouts: int = 0, next_calls: int = 0) -> str | None:
        """The first limit spent or that the next step (its rollouts, its optimiser calls) could exceed; else None."""
        lim = self.limits
        if lim.rollouts is not None and self.rollouts + next_rollouts > lim.rollouts:
            return "rollouts"
        if lim.generated_tokens is not None and self.generated_tokens >= lim.generated_tokens:
            return "generated_tokens"
        calls = self.optimiser_calls + max(next_calls, 1)  # a spent call budget stops even a step that makes none
        if lim.optimiser_calls is not None and calls > lim.optimiser_calls:
            return "optimiser_calls"
        if lim.seconds is not None and self.seconds >= lim.seconds:
            return "seconds"
        return None

    def report(self, stop: str) -> dict[str, Any]:
        """What was spent, the limits, and why the search stopped."""
        return {
            "rollouts": self.rollouts,
            "generated_tokens": self.generated_tokens,
            "optimiser_calls": self.optimiser_calls,
            "seconds": round(self.seconds, 1),
            "stop": stop,
            "limits": self.limits.model_dump(),
        }
