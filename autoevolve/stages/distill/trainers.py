"""Stage 3's trainers behind one protocol: each turns a round's selection into the expert's next adapter version.

- ``sft``: the kept rollouts re-rendered under the original config; loss on assistant tokens only.
- ``dpo``: (kept rollout, the original config's failed rollout on the same task), both under the original config.
- ``grpo``: on-policy RL on the selected tasks under the original config, the environment's score as the reward.

Every trainer continues from the live adapter A_r when there is one (unless ``distill.init`` is ``base``), trains on
the round's selection and the replayed ones that trained A_r's lineage (a task in several: its newest win), and
returns a ``TrainResult``. SFT with ``distill.rehearse`` also trains on A_r's own wins on tasks it already solves, and
with a labelled budget on the labelled references, one per task. With ``distill.epoch_grid`` the job's judge scores
the adapter on dev after each epoch of the grid and the best epoch is kept.
Each reads the settings every trainer shares and its own section of them (``distill.sft``, ``.dpo``, ``.grpo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from autoevolve.envs import Environment
from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import Message, Selection, Task, TrainResult, Trajectory
from autoevolve.stages.distill.dataset import native_tools, render_examples
from autoevolve.stages.distill.dpo import preference_examples, train_dpo
from autoevolve.stages.distill.fit import Judge
from autoevolve.stages.distill.grpo import train_grpo
from autoevolve.stages.distill.sft import train_sft
from autoevolve.stages.settings import DistillSettings
from autoevolve.store import Store


@dataclass(frozen=True)
class DistillJob:
    """What every trainer gets: the round's store, environment and selection, the original config, where to start and
    save."""

    store: Store
    env: Environment
    selection: Selection
    original: HCPConfig
    model_name: str
    out_dir: Path
    init_adapter: str | None = None  # A_r's folder; None: a fresh LoRA
    replay: list[Selection] = field(default_factory=list)  # earlier rounds' selections, newest first
    rehearsal: list[Trajectory] = field(default_factory=list)  # A_r's own wins on tasks it already solves
    references: dict[str, list[Message]] = field(default_factory=dict)  # task id -> its labelled solution
    judge: Judge | None = None  # (adapter folder, epoch) -> dev score; needed by distill.epoch_grid

    def tasks(self) -> dict[str, Task]:
        """The environment's train tasks by id (every selection item is one of them)."""
        return {t.id: t for t in self.env.tasks("train")}

    def selections(self) -> list[Selection]:
        """What to train on: the round's selection, then the replayed ones with the tasks it already holds removed."""
        out, seen, train = [], set(), self.tasks()
        for sel in [self.selection, *self.replay]:
            items = [i for i in sel.items if i.task_id not in seen and i.task_id in train]
            seen |= {i.task_id for i in items}
            out.append(sel.model_copy(update={"items": items}))
        return out


class Trainer(Protocol):
    """Trains the expert's next adapter version from a job and saves it to ``job.out_dir``."""

    def __call__(self, job: DistillJob, settings: DistillSettings) -> TrainResult: ...


def sft(job: DistillJob, settings: DistillSettings) -> TrainResult:
    """LoRA SFT on the kept rollouts and the labelled references (a labelled task: its reference alone)."""
    kept = [t for sel in job.selections() for t in job.store.kept_rollouts(sel)]
    held = {t.task_id for t in kept}
    kept += [t for t in job.rehearsal if t.task_id not in held]
    kept = [t for t in kept if t.task_id not in job.references]
    tasks = job.tasks()
    examples = render_examples(kept, tasks, job.original)
    examples += [job.original.render(tasks[i], refs)[0] for i, refs in sorted(job.references.items())]
    tools = native_tools(job.original)
    return train_sft(
        examples,
        job.model_name,
        job.out_dir,
        settings,
        init_adapter=job.init_adapter,
        tools=tools,
        sft=settings.sft,
        judge=job.judge,
    )


def dpo(job: DistillJob, settings: DistillSettings) -> TrainResult:
    """LoRA DPO on (kept rollout, the original's failed rollout) pairs."""
    pairs = [
        (chosen, rejected)
        for sel in job.selections()
        for item, chosen, rejected in zip(
            sel.items, job.store.kept_rollouts(sel), job.store.beaten_rollouts(sel), strict=True
        )
        if item.pairs_with_baseline
    ]  # (chosen, rejected): a kept rollout and the original's failed one on its task
    rows = preference_examples(pairs, job.tasks(), job.original)
    init, judge = job.init_adapter, job.judge
    return train_dpo(rows, job.model_name, job.out_dir, settings, init_adapter=init, dpo=settings.dpo, judge=judge)


def grpo(job: DistillJob, settings: DistillSettings) -> TrainResult:
    """LoRA GRPO on the tasks the evolved configs won: where the original config still has most to learn."""
    by_id = job.tasks()
    won = dict.fromkeys(item.task_id for sel in job.selections() for item in sel.items)
    tasks = [by_id[task_id] for task_id in won]
    env, init = job.env, job.init_adapter
    return train_grpo(
        tasks, env, job.original, job.model_name, job.out_dir, settings, init, grpo=settings.grpo, judge=job.judge
    )


TRAINERS: dict[str, Trainer] = {"sft": sft, "dpo": dpo, "grpo": grpo}
