"""Records that flow between stages: tasks, chat messages, trajectories, candidates, selections, adapters.

Every record is a pydantic model with ``schema_version`` so stored rows stay readable as the schema grows.
Messages use the OpenAI chat wire format (tool-call ``arguments`` is a JSON string).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

SCHEMA_VERSION = 1

Split = Literal["train", "dev", "test"]


class Record(BaseModel):
    """Base for stored records: unknown keys are an error, and a version travels with each row."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION


class ToolCall(BaseModel):
    """One function call as the OpenAI API writes it."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="Call id, echoed by the tool message that answers it.")
    type: Literal["function"] = "function"
    function: dict[str, str] = Field(description="{'name': ..., 'arguments': JSON string}.")

    @classmethod
    def make(cls, call_id: str, name: str, arguments: dict[str, Any]) -> ToolCall:
        """Build a call from a name and an argument dict."""
        return cls(id=call_id, function={"name": name, "arguments": json.dumps(arguments)})

    @property
    def name(self) -> str:
        """The called function's name."""
        return self.function["name"]

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments decoded from their JSON string."""
        return json.loads(self.function.get("arguments") or "{}")


class Message(BaseModel):
    """One chat message in canonical (harness-independent) form."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list, description="Calls the assistant made, if any.")
    tool_call_id: str | None = Field(default=None, description="For role 'tool': the call answered.")
    adapter: str | None = Field(
        default=None, description="For role 'assistant' in a routed conversation: the adapter that wrote it."
    )
    call_error: str | None = Field(
        default=None,
        description="For role 'assistant': why the harness could not run this reply's call; the user message after "
        "it tells the model so (``scaffold.retry_bad_calls``).",
    )

    @model_serializer(mode="wrap")
    def _without_unset_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave ``adapter`` and ``call_error`` out unless set: stored rows and HCP ids (demos hold messages) stay as
        they were."""
        data = handler(self)
        for key in ("adapter", "call_error"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


def without_failed_calls(messages: list[Message]) -> list[Message]:
    """The conversation without the calls the harness could not run and its answers to them: what was learned
    from a rollout that recovered from a bad call is the recovery, not the bad call."""
    out: list[Message] = []
    skip = False
    for message in messages:
        if skip:
            skip = False
        elif message.call_error is not None:
            skip = True  # the harness's answer follows it
        else:
            out.append(message)
    return out


class Task(Record):
    """One environment instance."""

    id: str = Field(description="Stable id, unique across splits.")
    env: str = Field(description="Name of the environment that made it.")
    split: Split = Field(description="Stages 1 and 2 use train tasks, the gate dev, the report test.")
    tier: int = Field(
        ge=1,
        description="Difficulty, 1 or more (1 = easiest); the curriculum lets a harder tier in as the easier pass.",
    )
    request: str = Field(description="The user's message that opens the episode.")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="What the harness may show the model, through the HCP config's memory template (e.g. today's "
        "date, the user's name); parallel_calls: true makes every call of a text reply run, in order.",
    )
    goal: dict[str, Any] = Field(default_factory=dict, description="Hidden: what the scorer checks.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="Tools of this task alone (OpenAI schema), offered after the config's."
    )


class Trajectory(Record):
    """One rollout. Failures are data: a broken rollout has reward 0 and an error."""

    run_id: str
    task_id: str
    split: Split
    tier: int = 1
    hcp_id: str = Field(description="Content hash of the HCP config that rendered the prompts.")
    adapter: str = Field(default="", description="LoRA adapter name; '' is the bare base model.")
    sample: int = Field(default=0, ge=0, description="Sample index when a task is rolled out several times.")
    round: int = Field(default=0, ge=0)
    stage: str = Field(default="evolve", description="Stage that produced it: evolve, select, gate, report.")
    messages: list[Message] = Field(description="Canonical conversation: user request, assistant turns, tool results.")
    reward: float = Field(ge=0.0, le=1.0)
    feedback: str = Field(default="", description="One sentence per unmet goal condition.")
    error: str = Field(default="", description="Why the rollout broke, '' if it did not.")
    prompt_tokens: int = Field(default=0, ge=0, description="Prompt tokens of the first model call.")
    completion_tokens: int = Field(default=0, ge=0, description="Generated tokens over all model calls.")
    latency_s: float = Field(default=0.0, ge=0.0)

    @property
    def key(self) -> tuple[str, str, str, str, int]:
        """Identity in the store: re-writing the same key changes nothing."""
        return (self.run_id, self.hcp_id, self.adapter, self.task_id, self.sample)


CandidateStatus = Literal["keep", "discard", "crash"]


class Candidate(Record):
    """An HCP config tried by the search, with its lineage and scores: one row of the search's ledger."""

    run_id: str
    round: int = 0
    hcp_id: str
    parents: list[str] = Field(default_factory=list, description="Parent HCP ids: none (seed), one, or two (merge).")
    mutator: str = Field(default="seed", description="Mutator that made it; 'seed' for the original config.")
    components: list[str] = Field(default_factory=list, description="Components that differ from the first parent.")
    diff: str = Field(default="", description="Per-component diff from the first parent (or the failed reply).")
    status: CandidateStatus
    minibatch: dict[str, float] = Field(default_factory=dict, description="Train minibatch: mean reward per task.")
    parent_minibatch: dict[str, float] = Field(default_factory=dict, description="The parent's, same tasks.")
    scores: dict[str, float] = Field(default_factory=dict, description="Dev split: mean reward per task id.")
    spreads: dict[str, float] = Field(default_factory=dict, description="Dev split: reward std over samples per task.")
    mean_reward: float = Field(default=0.0, description="Mean of ``scores``: the candidate's dev score.")
    rollouts_used: int = Field(default=0, ge=0, description="Rollouts the search had used when this row was written.")
    note: str = ""


class SelectedTrajectory(Record):
    """A kept evolved-config rollout and the baseline rollout it beat on the same task; a ``baseline_sample`` of -1
    means no rollout beside it: ``baseline_reward`` is then the original's mean on the task's tier
    (``select.unpaired_after``)."""

    task_id: str
    hcp_id: str
    adapter: str
    sample: int
    reward: float
    baseline_hcp_id: str
    baseline_sample: int
    baseline_reward: float

    @property
    def pairs_with_baseline(self) -> bool:
        """The baseline failed and lost: (this, baseline) is a (chosen, rejected) preference pair (a baseline sample of
        -1 is the original's rate on the tier, no rollout: no pair)."""
        return self.baseline_sample >= 0 and self.baseline_reward < 1.0 and self.baseline_reward < self.reward


class Selection(Record):
    """The trajectories kept for distillation in one round."""

    id: str
    run_id: str
    round: int
    baseline_hcp_id: str
    evolved_hcp_id: str
    adapter: str
    items: list[SelectedTrajectory]


class TaskPlan(Record):
    """The tasks a round works on: the tiers in play and its train tasks, drawn mostly from the live adapter's
    frontier (the train tasks it fails or only partly solves under the original config)."""

    run_id: str
    round: int
    adapter: str = Field(default="", description="The live adapter A_r the frontier was measured with.")
    tiers: list[int] = Field(description="Tiers in play: dev, test and train tasks come from these.")
    dev_scores: dict[str, float] = Field(
        default_factory=dict, description="A_r + original config, mean dev reward per tier, that decided the tiers."
    )
    pool: dict[str, float] = Field(
        default_factory=dict, description="Train task id -> A_r + original reward, for the pool the frontier came from."
    )
    frontier: list[str] = Field(default_factory=list, description="Pool tasks A_r did not fully solve.")
    train: list[str] = Field(
        description="Train task ids in draw order: stage 1 takes the first evolve.train_tasks, stage 2 the first "
        "select.train_tasks."
    )
    why: str = Field(default="", description="How the tiers and tasks were chosen, in words.")


class TrainResult(BaseModel):
    """What a training run of stage 3 produced (train_result.json beside the adapter)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Folder of the saved PEFT adapter.")
    steps: int = Field(description="Optimiser steps taken.")
    train_loss: float = Field(description="Mean training loss over all steps (the Trainer's train_loss).")
    first_loss: float = Field(description="Loss logged at the first step.")
    last_loss: float = Field(description="Loss logged at the last step.")
    seconds: float = Field(description="Wall time of the run, loading and saving included.")
    examples: int = Field(description="Examples trained on (those with an assistant token within max_length).")
    tokens: int = Field(default=0, description="Tokens trained on over all epochs, padding excluded.")
    train_seconds: float = Field(default=0.0, description="Seconds in the training loop (no loading or saving).")
    first_reward: float | None = Field(default=None, description="GRPO: mean reward of the first step's replies.")
    last_reward: float | None = Field(default=None, description="GRPO: mean reward of the last step's replies.")
    dev_by_epoch: dict[str, float] = Field(
        default_factory=dict, description="With epoch_grid: the dev score after each epoch judged, by epoch."
    )
    epochs: float | None = Field(default=None, description="With epoch_grid: the epoch whose adapter was kept.")


AdapterStatus = Literal["candidate", "promoted", "rejected", "retired"]


EXPERT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(name: str) -> str:
    """An expert name is also a folder name and a served LoRA name: refuse one that could escape a directory."""
    if not EXPERT_NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"expert name {name!r} is not allowed: use letters, digits, '.', '_' and '-' (no '/', no '..', "
            "at most 64 characters), e.g. 'L1-life'"
        )
    return name


class Expert(Record):
    """A LoRA expert of the Mixture of LoRA: what the router sees of it, and which version serves it."""

    name: str = Field(description="e.g. 'L1-life'; letters, digits, '.', '_' and '-' only.")
    tier: int = Field(default=1, ge=0, description="0: the entry (chat) expert; 1+: the experts it routes to.")
    routing_rule: str = Field(default="", description="One sentence the router sees: when to hand a turn here.")
    base_model: str = Field(description="Base model id every version of this expert must be trained on.")
    live_version: int | None = Field(default=None, description="The promoted version; None: the bare base serves.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        """A name that could escape a folder is refused."""
        return check_name(name)


class RegistryEvent(Record):
    """One change of an expert's live version, or a hook's failure, in the registry's history."""

    expert: str
    action: Literal["promote", "rollback", "hook_failed"]
    version: int | None = Field(description="Live version after the change (None: the bare base model).")
    previous_version: int | None = Field(description="Live version before it.")
    detail: str = ""
    at: datetime | None = Field(default=None, description="When it was recorded (set by the store).")


class AdapterRecord(Record):
    """A registry row: one version of one LoRA expert, with its lineage."""

    name: str = Field(description="Expert name, e.g. 'L1-life'.")
    version: int = Field(ge=1)
    tier: int = 1
    routing_rule: str = ""
    base_model: str
    path: str = Field(description="Folder of the adapter in PEFT format.")
    parent_version: int | None = None
    run_id: str = ""
    round: int = 0
    hcp_id: str = Field(description="The original config the adapter was trained to serve.")
    evolved_hcp_id: str = ""
    selection_id: str = ""
    eval: dict[str, Any] = Field(default_factory=dict)
    status: AdapterStatus = "candidate"
    reason: str = ""

    @property
    def ref(self) -> str:
        """Name the policy loads it under, e.g. 'L1-life@v2'."""
        return f"{self.name}@v{self.version}"


class Cell(BaseModel):
    """One cell of an evaluation table."""

    model_config = ConfigDict(extra="forbid")

    adapter: str
    hcp_id: str
    mean: float
    n: int
    ci: tuple[float, float] = Field(default=(0.0, 0.0), description="Bootstrap 95% interval of the mean over tasks.")
    prompt_tokens: float = Field(default=0.0, description="Mean prompt tokens of the first model call.")


class Guard(BaseModel):
    """Tasks of another tier or environment the new adapter must not lose more than ``tolerance`` on."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(description="Environment and tiers the guard tasks come from, e.g. 'life tiers 2'.")
    n: int = Field(description="Guard tasks rolled out under each adapter.")
    base: float = Field(description="Mean reward of the live adapter (A_r) with its original config.")
    candidate: float = Field(description="Mean reward of the new adapter (A_{r+1}) with the same config.")
    tolerance: float

    @property
    def drop(self) -> float:
        """How much the new adapter lost on the guard tasks (negative: it gained)."""
        return self.base - self.candidate

    @property
    def ok(self) -> bool:
        """The drop is within the tolerance."""
        return self.drop <= self.tolerance + 1e-9


# The 2x2's cells, '<adapter>_<config>': the adapter live at the round's start A_r ('live'; the bare base model in
# round 0) and the one the round trained, A_{r+1} ('new'), each under the original and the best evolved config.
ADAPTERS = ("live", "new")
CONFIGS = ("original", "evolved")
CELLS = tuple(f"{a}_{c}" for a in ADAPTERS for c in CONFIGS)  # live_original, live_evolved, new_original, new_evolved
GRAMMAR = "live_grammar"  # A_r under the original config, decoding under the tool-call grammar (test, when used)

# The 2x2's cell names before they said what they hold: "base" was the live adapter A_r, "adapter" the new A_r+1.
OLD_CELL_NAMES = {
    "base_original": "live_original",
    "base_evolved": "live_evolved",
    "adapter_original": "new_original",
    "adapter_evolved": "new_evolved",
    "base_grammar": "live_grammar",
}


def renamed_cells(value: Any) -> Any:
    """A JSON value (an evaluation, report.json, a rounds.json row) with the older cell names read as today's, at
    any depth; every other key and value unchanged."""
    if isinstance(value, dict):
        return {OLD_CELL_NAMES.get(k, k): renamed_cells(v) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed_cells(v) for v in value]
    return value


class EvalReport(Record):
    """The gate's decision and the held-out table."""

    run_id: str
    round: int
    split: Split
    cells: dict[str, Cell] = Field(
        description="Keys '<adapter>_<config>': live_original, live_evolved (the adapter live at the round's start, "
        "A_r: the bare base model in round 0), new_original, new_evolved (the adapter the round trained, A_{r+1}); "
        "live_grammar (A_r, the original config decoding under the tool-call grammar) when the evolved config uses it."
    )
    decision: Literal["promote", "reject", "report"]
    reason: str
    gain: float = Field(default=0.0, description="new_original - live_original: what distillation added.")
    gain_ci: tuple[float, float] = Field(default=(0.0, 0.0), description="Paired bootstrap 95% interval of the gain.")
    p_value: float | None = Field(
        default=None, description="One-sided exact sign-flip p-value of the gain (the gate promotes below its alpha)."
    )
    retention: float | None = Field(
        default=None, description="gain / (live_evolved - live_original); None when the evolved config gained nothing."
    )
    grammar_retention: float | None = Field(
        default=None,
        description="gain / (live_grammar - live_original): the share of what the tool-call grammar alone gave the "
        "live adapter that the new adapter keeps without it (test, when the evolved config decodes under it).",
    )
    guard: Guard | None = Field(default=None, description="The guard set's check (gate only, when configured).")
    tiers: dict[str, dict[str, float | int]] = Field(
        default_factory=dict,
        description="Per task tier ('1', '2', ...): each cell's mean reward over that tier's tasks, and n_tasks.",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_old_cell_names(cls, data: Any) -> Any:
        """Reports stored with the older cell names (base_*, adapter_*) load under today's."""
        if isinstance(data, dict):
            data = data | {k: renamed_cells(data[k]) for k in ("cells", "tiers") if k in data}
        return data
