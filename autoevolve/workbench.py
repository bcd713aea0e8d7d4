"""The workbench a round runs on: policy, environment, store and run id, with rollouts cached in the store.

Every rollout is written to the store as soon as its batch finishes; a rollout already stored under the same
(run, HCP id, adapter, task, sample) is read back instead of generated again, so a re-run resumes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from autoevolve.envs import Environment
from autoevolve.hcp import HCPConfig
from autoevolve.policy import Policy
from autoevolve.records import Task, Trajectory
from autoevolve.rollout import rollout
from autoevolve.store import Store

Progress = Callable[[str, int, int], None]


def print_progress(label: str, done: int, total: int, width: int = 24) -> None:
    """A progress bar on stderr, one line that updates in place."""
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    bar = "#" * filled + "." * (width - filled)
    print(f"\r  [{bar}] {done}/{total} {label}\x1b[K", end=end, file=sys.stderr, flush=True)


@dataclass
class Workbench:
    """What every stage needs to run rollouts and record them."""

    policy: Policy
    env: Environment
    store: Store
    run_id: str
    round: int = 0
    seed: int = 0
    chunk: int = 64
    progress: Progress | None = field(default=print_progress)

    def rollouts(
        self,
        hcp: HCPConfig,
        tasks: list[Task],
        adapter: str = "",
        stage: str = "evolve",
        samples: int = 1,
        first_sample: int = 0,
    ) -> list[Trajectory]:
        """Trajectories of ``tasks`` under a config and adapter: stored ones reused, missing ones generated.

        Samples are numbered from ``first_sample`` (a sample's index seeds its decoding): a later round that wants
        new samples of the same config asks for higher numbers.
        """
        wanted = range(first_sample, first_sample + samples)
        self.store.put_hcp(hcp.id, hcp.name, hcp.model_dump(mode="json"))
        stored = {
            (t.task_id, t.sample): t
            for t in self.store.trajectories(
                self.run_id, hcp_id=hcp.id, adapter=adapter, task_ids=[t.id for t in tasks]
            )
        }
        todo = [t for t in tasks if any((t.id, s) not in stored for s in wanted)]
        label = f"{stage} {hcp.id}{'+' + adapter if adapter else ''}"
        for start in range(0, len(todo), self.chunk):
            batch = todo[start : start + self.chunk]
            made = rollout(
                self.policy,
                self.env,
                hcp,
                batch,
                run_id=self.run_id,
                adapter=adapter,
                samples=samples,
                stage=stage,
                round=self.round,
                seed=self.seed,
                first_sample=first_sample,
            )
            self.store.put_trajectories(made)  # written per chunk: a crash loses at most one chunk
            stored.update({(t.task_id, t.sample): t for t in made})
            if self.progress:
                self.progress(label, min(start + self.chunk, len(todo)), len(todo))
        return [stored[(t.id, s)] for t in tasks for s in wanted]


def mean(values: list[float]) -> float:
    """Arithmetic mean; 0.0 for no values."""
    return sum(values) / len(values) if values else 0.0
