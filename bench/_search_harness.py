"""What every search of bench/optimisers.py shares: the rollout meter, candidate configs, references as demos, and
one chat call to the in-process policy (the optimiser model of GEPA and DSPy)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import Demo, Demos, HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.policy import ChatRequest
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Message, Task, Trajectory
from autoevolve.stages.evolve.reflect import PLACEHOLDERS

DEMO_POOL = 16  # demos a search's pool holds (ours tops it up with references; GEPA is seeded with as many)


class Metered:
    """A Workbench with a hard rollout budget, counted as our search counts it: each (config, task) the search asks
    for costs one rollout the first time (whether or not the store already held it); past the budget, new ones score
    0 without running."""

    def __init__(self, bench: Workbench, budget: int) -> None:
        self.bench, self.budget, self.seen = bench, budget, set()

    @property
    def spent(self) -> int:
        """Rollouts charged so far."""
        return len(self.seen)

    def rollouts(self, hcp: HCPConfig, tasks: list[Task], stage: str) -> list[Trajectory]:
        """Rewards of ``tasks`` under ``hcp``: ones charged before free, new ones while the budget lasts."""
        new = [t.id for t in tasks if (hcp.id, t.id) not in self.seen]
        self.seen |= {(hcp.id, i) for i in new[: max(self.budget - self.spent, 0)]}
        run = [t for t in tasks if (hcp.id, t.id) in self.seen]
        made = {t.task_id: t for t in self.bench.rollouts(hcp, run, stage=stage)} if run else {}
        return [made.get(t.id) or broken(self.bench.run_id, hcp.id, t, "over budget") for t in tasks]


def broken(run_id: str, hcp_id: str, task: Task, error: str) -> Trajectory:
    """A rollout that did not run: reward 0 and the reason."""
    request = Message(role="user", content=task.request)
    return Trajectory(
        run_id=run_id, task_id=task.id, split=task.split, hcp_id=hcp_id, messages=[request], reward=0.0, error=error
    )


def candidate_config(original: HCPConfig, prompt: str, demos: list[Demo]) -> HCPConfig:
    """The original config with a system prompt and a demo pool; ValueError when the prompt breaks the rules."""
    lost = [p for p in PLACEHOLDERS if p in original.system_prompt and p not in prompt]
    if lost:
        raise ValueError(f"the system prompt drops the placeholder {lost[0]}")
    unique = list({d.task_id: d for d in demos}.values())
    pool = Demos(items=unique, select="nearest", k=2, style="first_call") if unique else Demos()
    try:
        return HCPConfig.model_validate(original.model_dump() | {"system_prompt": prompt, "demos": pool.model_dump()})
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from None


def reference_demos(env: LifeEnv, tasks: list[Task]) -> list[Demo]:
    """The labelled solutions of ``tasks`` as demos."""
    return [Demo(task_id=t.id, messages=m) for t in tasks if (m := env.reference(t))]


def chat(policy: LocalPolicy, messages: list[dict[str, Any]], temperature: float, max_tokens: int, seed: int) -> str:
    """The policy's reply to one chat request ('' when it failed)."""
    request = ChatRequest(messages=messages, temperature=temperature, max_new_tokens=max_tokens, seed=seed)
    [reply] = policy.generate([request])
    return "" if reply.error else reply.text
