"""The stage settings of a run config: stage 1's search (budgets, reflection, mutators), the curriculum, stage 2's
selection and stage 3's training. Every section forbids unknown keys (see ``Section``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from autoevolve.harness.hcp import COMPONENTS, CallSyntax, ToolFormat
from autoevolve.stages.distill.training import TRAINER_SETTINGS, DPOSettings, GRPOSettings, SFTSettings, TrainSettings

META_PROMPTS = Path(__file__).resolve().parent / "evolve" / "meta_prompts.yaml"  # ships inside the package


class Section(BaseModel):
    """A config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


MutatorName = Literal["demos", "tool_format", "scaffold", "decoding", "reflective", "merge"]
Component = Literal["system_prompt", "tools", "routing", "memory", "sampling", "scaffold"]


class BudgetSettings(Section):
    """Stage 1 stops at the first limit spent (None: no limit), or after ``patience`` children in a row fail."""

    rollouts: int | None = Field(
        default=None, gt=0, description="Rollouts (task x sample x config); a step that could exceed it is not begun."
    )
    generated_tokens: int | None = Field(default=None, gt=0, description="Tokens the policy generated in rollouts.")
    optimiser_calls: int | None = Field(default=None, gt=0, description="Calls to the reflective optimiser LLM.")
    seconds: float | None = Field(default=None, gt=0, description="Wall-clock seconds of the search.")
    patience: int | None = Field(
        default=None, gt=0, description="Stop after this many children in a row that do not raise the best dev score."
    )


class ReflectionSettings(Section):
    """The optimiser LLM behind the reflective mutator: the policy itself, or any OpenAI-compatible endpoint."""

    model: str = Field(default="policy", description="'policy': the model being evolved; else a served model name.")
    base_url: str | None = Field(default=None, description="OpenAI-compatible endpoint of ``model``; None: local.")
    api_key_env: str = Field(default="OPENAI_API_KEY", description="Environment variable holding the key.")
    components: list[Component] = Field(
        default=["system_prompt", "tools"], description="Components it may rewrite; one is drawn per proposal."
    )
    examples: int = Field(default=4, gt=0, description="Minibatch trajectories shown per proposal (failures first).")
    meta_prompts: Path = Field(default=META_PROMPTS, description="YAML file of meta-prompts.")
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    max_new_tokens: int = Field(default=512, gt=0)


class EvolveSettings(Section):
    """Stage 1: a Pareto search over HCP configs; children are tried on a train minibatch, kept ones scored on dev."""

    train_tasks: int = Field(default=32, gt=0, description="Train tasks minibatches are drawn from.")
    minibatch: int = Field(default=8, gt=0, description="Train tasks a child must beat its parent on.")
    keep_ties: bool = Field(
        default=False,
        description="Also keep a child that ties its parent's minibatch sum while winning a task the parent loses "
        "(neither dominates: a per-task Pareto member, e.g. the first demos that open a new tier).",
    )
    dev_tasks: int = Field(default=24, gt=0, description="Dev tasks every kept candidate is scored on per task.")
    samples: int = Field(default=1, gt=0, description="Rollouts per task (more where rewards are noisy).")
    candidates: int = Field(default=4, ge=0, description="Children proposed at most after the seed config.")
    mutators: list[MutatorName] = Field(default=["demos", "tool_format"], description="Used in turn, in this order.")
    demo_pool: int = Field(default=12, gt=0, description="Demos a bootstrapped demo set holds.")
    demo_k: list[int] = Field(default=[2, 3], description="Demos shown per task; a demo set draws one of these.")
    demo_styles: list[Literal["full", "first_call"]] = Field(
        default=["full", "first_call"], description="How demos are shown; a demo set draws one of these."
    )
    demo_orders: list[Literal["nearest_last", "nearest_first"]] = Field(
        default=["nearest_last"],
        description="Where the most similar demo goes; a demo set draws one (nearest_first scored 0/8 vs 4/8 at 135M).",
    )
    presentations: list[tuple[ToolFormat, CallSyntax]] = Field(
        default=[
            ("json", "json"),
            ("compact", "json"),
            ("python", "python"),
            ("python", "json"),
            ("compact", "python"),
        ],
        description="The [tool_format, call_syntax] pairs the tool_format mutator draws from (BFCL prompts models with "
        "[json, python_list]: functions as JSON, calls as [func(arg=value)]).",
    )
    demo_matches: list[Literal["request", "request_and_tools"]] = Field(
        default=["request"],
        description="What a demo set retrieves demos by: request words, or also function schemas (a function-calling "
        "task's tool and parameter names); a demo set draws one when several are listed.",
    )
    references: bool = Field(
        default=True,
        description="Let the demos mutator top up with the environment's labelled solutions of train tasks; false: "
        "demos only from the model's own full-reward rollouts (a deployment with rewards but no labels).",
    )
    frozen: list[str] = Field(default_factory=list, description="HCP components no mutator may change.")
    max_prompt_tokens: int | None = Field(
        default=None, gt=0, description="Children whose mean first prompt is longer are discarded."
    )
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    reflection: ReflectionSettings = Field(default_factory=ReflectionSettings)

    @field_validator("frozen")
    @classmethod
    def _known_components(cls, value: list[str]) -> list[str]:
        """Frozen names must be HCP components."""
        unknown = [v for v in value if v not in COMPONENTS]
        if unknown:
            raise ValueError(f"unknown component {unknown[0]!r} (components: {', '.join(COMPONENTS)})")
        return value


class LabelSettings(Section):
    """The labelled set (``autoevolve.stages.labels``): how many train tasks carry reference solutions, and what the
    loop does with them. Without this section every train task's reference may be shown as a demo and none is trained
    on."""

    budget: int = Field(
        ge=0,
        description="Train tasks whose references the run may read, drawn seeded (the run's seed) and balanced over "
        "tiers and task kinds; a smaller budget's set lies inside a larger one's. Stage 1 shows only these as demos; "
        "stages 1 and 2 work on the other, unlabelled train tasks. 0: no labels (rewards only).",
    )
    train: bool = Field(
        default=True,
        description="Stage 3 also trains on the labelled references, one per task, re-rendered under the original "
        "config beside the kept wins (trainer sft only).",
    )
    warm_start: bool = Field(
        default=False,
        description="Round 0 of an expert with no live version starts from LoRA SFT on the labelled references (its "
        "length chosen on dev with distill.epoch_grid), registered and promoted if the dev gate says so: the loop then "
        "contains 'SFT on the labels, then rejection sampling' as a special case.",
    )


class CurriculumSettings(Section):
    """Which tasks a round works on: the live adapter's frontier, over tiers that enter play as earlier ones pass."""

    tiers: list[int] = Field(default=[1, 2, 3], description="Tiers in the order they enter play; the first starts.")
    unlock_at: float = Field(
        default=0.7,
        ge=0.0,
        le=1.0,
        description="The next tier enters play once the live adapter's dev score (original config) on the last "
        "tier in play reaches this.",
    )
    dev_tasks: int = Field(default=12, gt=0, description="Dev tasks per tier in play that measure the unlock score.")
    pool: int = Field(
        default=64, gt=0, description="Train tasks (balanced over the tiers in play) the frontier is measured on."
    )
    frontier_share: float = Field(
        default=0.75, ge=0.0, le=1.0, description="Share of each round's train tasks drawn from the frontier."
    )


class SelectSettings(Section):
    """Stage 2: paired comparison against the original config."""

    train_tasks: int = Field(default=96, gt=0, description="Train tasks rolled out under both configs.")
    margin: float = Field(default=0.0, ge=0.0, description="Evolved reward must beat the original's by more.")
    min_reward: float = Field(default=1.0, ge=0.0, le=1.0, description="Kept rollouts must also reach this reward.")
    samples: int = Field(default=1, gt=0, description="Rollouts per task under both configs; their means are compared.")
    max_per_task: int = Field(default=1, gt=0, description="Distinct winning rollouts kept per task at most.")
    tier_ratio: float | None = Field(
        default=2.0,
        ge=1.0,
        description="No tier keeps more than this x the items of a harder tier (the fewest); None: off.",
    )
    best_of: int = Field(
        default=1,
        ge=1,
        description="Also sample the best evolved config this many times per task at ``temperature`` (rejection "
        "sampling): any sample beating the original's rollouts can be kept. Later rounds draw new samples.",
    )
    temperature: float = Field(
        default=0.7, gt=0.0, le=2.0, description="Sampling temperature of the best_of samples and harvest passes."
    )
    rollouts: int | None = Field(
        default=None,
        gt=0,
        le=50_000,
        description="The stage's rollout budget under evolved configs, plus what stage 1 left of its own: after the "
        "best config's pass over every task (and best_of's samples), harvest passes sample it on the tasks not won "
        "yet until the budget is spent. None: no harvest passes.",
    )
    own_demos: bool = Field(
        default=False,
        description="Harvest passes show the rollouts won so far as demos (a config picking demos by nearness): the "
        "teacher grows with its own wins.",
    )
    unpaired_after: int | None = Field(
        default=None,
        gt=0,
        description="On a tier where the original's stored train and dev rollouts (stage 1's dev scores) already "
        "cover this many tasks and reach min_reward on none, wins are kept without rolling the original out beside "
        "each (they beat its rate on the tier), which saves those rollouts. Their baseline sample is -1, so they make "
        "no preference pair (not with trainer dpo). None: every win is paired with the original on its own task.",
    )
    new_tier_demos: int = Field(
        default=0,
        ge=0,
        description="A tier in play on which no kept config beats the original on dev (or none scores) is sampled "
        "under the original config with "
        "this many of its own train tasks' labelled solutions as full demos (the nearest, never the task's own); "
        "0 or evolve.references false: off.",
    )


class DistillSettings(TrainSettings):
    """Stage 3: the settings every trainer shares (``TrainSettings``: LoRA, optimiser, batches), the trainer and its
    own section (``distill: {trainer: grpo, grpo: {generations: 4}}``), and where, on what and from which adapter
    the stage trains. Only the selected trainer's section may be set."""

    trainer: Literal["sft", "dpo", "grpo"] = Field(
        default="sft",
        description="sft: the kept rollouts; dpo: (kept rollout, original's failed rollout) pairs; "
        "grpo: RL on the selected tasks with the environment's reward.",
    )
    sft: SFTSettings | None = Field(default=None, description="SFT's own settings; only with trainer: sft.")
    dpo: DPOSettings | None = Field(default=None, description="DPO's own settings (beta); only with trainer: dpo.")
    grpo: GRPOSettings | None = Field(
        default=None, description="GRPO's own settings (the group, its sampling, kl); only with trainer: grpo."
    )
    deployment: str | None = Field(
        default=None,
        description="Run stage 3 as a flow run of this Prefect deployment ('flow-name/deployment-name', e.g. "
        "'autoevolve-distill/gpu' on the GPU pool); None: in the round's own process.",
    )
    dev_tasks: int = Field(
        default=24,
        gt=0,
        description="With epoch_grid: how many dev tasks of the tiers in play the training length is chosen on, "
        "the split's last ones (stage 1 reads its first ones; the gate its first ones other than these).",
    )
    replay: bool = Field(
        default=True,
        description="Train on this round's selection and on those that trained the live adapter's lineage (a task "
        "kept in several: its newest win), so a later round does not forget what earlier rounds taught.",
    )
    init: Literal["live", "base"] = Field(
        default="live", description="live: continue training the live adapter A_r; base: a fresh LoRA on the base."
    )
    rehearse: bool = Field(
        default=False,
        description="SFT also trains on the live adapter's own full-reward rollouts under the original config on the "
        "round's pool tasks that no trained selection holds (what it already does), so the new wins do not overwrite "
        "it; needs a curriculum (the pool) and trainer: sft.",
    )
    rehearse_from_round: int = Field(
        default=0,
        ge=0,
        description="With rehearse: the first round that rehearses (0: every round). In the measured loop runs "
        "rehearsing from the start cut round 1's gain; from round 2 on it held tier 1 (README, loop section).",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_flat_trainer_settings(cls, data: Any) -> Any:
        """A trainer's own setting written beside the shared ones (``distill.beta``) names the section it goes in."""
        if isinstance(data, dict):
            for trainer, section in TRAINER_SETTINGS.items():
                for key in section.model_fields:
                    if key in data:
                        raise ValueError(
                            f"distill.{key} is {trainer}'s own setting: set distill.{trainer}.{key}, "
                            f"with distill.trainer: {trainer}"
                        )
        return data

    @field_validator("sft", "dpo", "grpo")
    @classmethod
    def _selected_trainer_only(cls, section: Any, info: ValidationInfo) -> Any:
        """Only the selected trainer's section is read, so another's is an error rather than silently ignored."""
        trainer = info.data.get("trainer")  # absent when the trainer itself is invalid: that error is reported
        if section is not None and trainer is not None and trainer != info.field_name:
            raise ValueError(f"set only with distill.trainer: {info.field_name} (the trainer is {trainer})")
        return section

    @field_validator("rehearse")
    @classmethod
    def _sft_rehearses(cls, rehearse: bool, info: ValidationInfo) -> bool:
        """Only SFT trains on the rehearsed rollouts."""
        trainer = info.data.get("trainer")
        if rehearse and trainer is not None and trainer != "sft":
            raise ValueError(f"only trainer sft rehearses (the trainer is {trainer}); set rehearse: false")
        return rehearse

    @model_validator(mode="after")
    def _trainer_section(self) -> DistillSettings:
        """Fill in the selected trainer's section (its defaults where left out), so a dumped config records it;
        GRPO generates whole groups: the completions per optimiser step must be a multiple of the group."""
        if getattr(self, self.trainer) is None:
            setattr(self, self.trainer, TRAINER_SETTINGS[self.trainer]())
        per_step = self.batch_size * self.grad_accum
        if self.grpo is not None and per_step % self.grpo.generations:
            raise ValueError(
                f"distill.batch_size x distill.grad_accum ({per_step}) must be a multiple of "
                f"distill.grpo.generations ({self.grpo.generations}): each grpo step trains on whole groups of replies"
            )
        return self
