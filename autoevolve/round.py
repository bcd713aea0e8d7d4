"""The round record: what one round's stages share (``Round``) and hand each other (``Distilled``, ``Decided``), and
the shape of a stage (``Stage``). Low in the import graph: the report reads a round without the stages' code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoevolve.config import RunConfig
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.records import AdapterRecord, EvalReport, Task, TrainResult


@dataclass
class Round:
    """Everything one round shares: the config, the workbench, the original config and the live adapter."""

    config: RunConfig
    bench: Workbench
    original: HCPConfig
    base_adapter: AdapterRecord | None
    labelled: list[Task] | None = None  # the train tasks whose references the run may read; None: any (no budget)
    seconds: dict[str, float] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)  # finished stages' results, loaded or computed

    @property
    def trained_labels(self) -> list[Task]:
        """The labelled tasks stage 3 trains on (their references): none without ``labels.train``."""
        return list(self.labelled or []) if self.config.labels and self.config.labels.train else []

    @property
    def warm_start_due(self) -> bool:
        """Whether this round starts from SFT on the labels (``labels.warm_start``): round 0, no live version."""
        warm = self.config.labels is not None and self.config.labels.warm_start
        return warm and self.bench.round == 0 and self.base_adapter is None and bool(self.trained_labels)

    @property
    def base_ref(self) -> str:
        """Adapter name of A_r ('' when the bare base model serves the expert)."""
        return self.base_adapter.ref if self.base_adapter else ""

    @property
    def evolved_before(self) -> HCPConfig | None:
        """The evolved config whose rollouts trained A_r (None for the bare base, or if it was the original)."""
        a = self.base_adapter
        if a is None or not a.evolved_hcp_id or a.evolved_hcp_id == self.original.id:
            return None
        return HCPConfig.model_validate(self.bench.store.get_hcp(a.evolved_hcp_id))

    @property
    def run_dir(self) -> Path:
        """Folder of this run's report and adapters."""
        return Path(self.config.run_dir) / str(self.config.run_id)


@dataclass(frozen=True)
class Distilled:
    """What stage 3 hands on: the registered adapter A_{r+1} and how its training went."""

    adapter: AdapterRecord
    train: TrainResult


@dataclass(frozen=True)
class Decided:
    """What the decision hands on: the adapter decided on and the (approved) dev report it was decided by."""

    adapter: AdapterRecord
    dev: EvalReport


@dataclass(frozen=True)
class Stage:
    """A stage: how to run it, the JSON it leaves in the store when it finishes, and how to load that back."""

    run: Callable[..., Any]
    dump: Callable[[Any], dict[str, Any]]
    load: Callable[[Round, dict[str, Any]], Any]
