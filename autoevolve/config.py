"""Run configs (YAML): which environment, model, backend, budgets and stage settings a run uses (the stage
sections themselves are in ``autoevolve.stages.settings``).

Every section forbids unknown keys, so a typo fails before any work with the field's dotted name.
The HCP file is looked up as given, then beside the config, then in the folder above it; store and run_dir
are relative to the working directory.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from autoevolve.envs import Environment, build_env
from autoevolve.envs.loading import EnvLoadError, factory_of, path_arguments
from autoevolve.envs.taskfile import PACKAGE_FILE
from autoevolve.fleet.registry_settings import RegistrySettings
from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import check_name
from autoevolve.stages.settings import (
    CurriculumSettings,
    DistillSettings,
    EvolveSettings,
    LabelSettings,
    Section,
    SelectSettings,
)
from autoevolve.store.postgres import is_url


class EnvSettings(Section):
    """The environment and its task splits (the protocol an environment follows: docs/environments.md)."""

    name: str = Field(
        default="life",
        description="A registered environment: the built-ins life, fncall, router and trl, or one an installed "
        "package declares in the 'autoevolve.environments' entry-point group.",
    )
    loader: str | None = Field(
        default=None,
        description="Your own environment instead of a name: 'package.module:factory' or 'path/to/file.py:factory' "
        "(a class or function that returns the environment); ``name`` is then not used.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's factory, checked by its signature."
    )
    seed: int = Field(default=0, description="World and task generation seed.")
    tiers: list[int] = Field(
        default=[1, 2, 3], description="Task tiers to use (life: 1 one call, 2 search+act, 3 choose; fncall: 1, 2)."
    )
    n_train: int = Field(default=256, gt=0)
    n_dev: int = Field(default=64, gt=0)
    n_test: int = Field(default=96, gt=0)
    _built: Any = PrivateAttr(default=None)

    @property
    def label(self) -> str:
        """The environment as the config names it: its registered name, or its loader."""
        return self.loader or self.name

    def make(self) -> Environment:
        """The environment (built once): seed, tiers and split sizes go to its factory where its signature takes
        them (one changed from its default that it does not take is an error), ``args`` always do."""
        if self._built is None:
            names = ("seed", "tiers", "n_train", "n_dev", "n_test")
            common = {n: tuple(self.tiers) if n == "tiers" else getattr(self, n) for n in names}
            changed = {n for n in names if getattr(self, n) != type(self).model_fields[n].default}
            self._built = build_env(self.name, self.loader, self.args, common, changed)
        return self._built


class OpenAISettings(Section):
    """An OpenAI-compatible server (vLLM, SGLang, llama.cpp server, OpenAI)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    api_key_env: str = Field(default="OPENAI_API_KEY", description="Environment variable holding the key.")
    concurrency: int = Field(default=8, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of a connection error, timeout, 408/409/429 or 5xx, by the openai client (backoff from "
        "0.5 s doubling to 8 s, or the server's Retry-After).",
    )
    load_adapters: bool = Field(
        default=True,
        description="Load each adapter the round uses into the server (vLLM /v1/load_lora_adapter); false: the "
        "server serves them already.",
    )


class ModelSettings(Section):
    """The base model and how it is served."""

    name: str = Field(default="smollm2-135m-instruct", description="Embedded default, an HF model id, or a path.")
    backend: Literal["local", "openai"] = "local"
    batch_size: int = Field(default=64, gt=0, description="Requests per generate call (local backend).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Weights of the local backend's rollouts. auto: bfloat16 on a CUDA device or a CPU with native "
        "bf16 arithmetic (AVX512-BF16, AMX), float32 elsewhere. Training keeps float32 master weights either way.",
    )
    openai: OpenAISettings = Field(default_factory=OpenAISettings)
    endpoint_stop: float | None = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="A stage stops when more than this share of a batch (4 rollouts or more) failed at the policy "
        "endpoint with the same error, printing the server's message and the request it refused; None: never.",
    )


class GuardSettings(Section):
    """A guard set: dev tasks of another tier or environment on which the new adapter must not get worse."""

    env: EnvSettings = Field(description="The guard's environment, e.g. {name: life, tiers: [2]}.")
    hcp: Path | None = Field(default=None, description="Its original HCP config; None: the run's own ``hcp``.")
    tasks: int = Field(default=16, gt=0, description="Dev tasks of the guard environment rolled out per adapter.")
    tolerance: float = Field(default=0.05, ge=0.0, description="Largest mean-reward drop that still promotes.")

    @property
    def label(self) -> str:
        """The guard's environment in words, e.g. 'life tiers 2'."""
        return f"{self.env.label} tiers {','.join(map(str, self.env.tiers))}"


class GateSettings(Section):
    """The promotion gate (dev split) and the report (test split)."""

    dev_tasks: int = Field(default=32, gt=0)
    test_tasks: int = Field(default=64, gt=0)
    min_gain: float = Field(default=0.0, description="Dev gain of adapter over base (original config) to promote.")
    alpha: float = Field(
        default=0.025,
        gt=0.0,
        lt=1.0,
        description="Promote only if the exact one-sided sign-flip test of the dev gain gives p below this.",
    )
    evolved_tasks: int | None = Field(
        default=None,
        gt=0,
        description="Dev and test tasks the evolved-config cells run on (the first N; retention is read on them). "
        "They decide nothing and their long prompts cost most of a table; None: all.",
    )
    tier_tolerance: float | None = Field(
        default=None,
        ge=0.0,
        description="Reject if any tier's dev mean (original config) drops by more than this; None: off.",
    )
    guard: GuardSettings | None = Field(default=None, description="Tasks the new adapter must not lose on; None: off.")


# Docker worker job variables (prefect-docker's `docker` work pool type) that give a flow run's container one GPU.
GPU_JOB_VARIABLES: dict[str, Any] = {
    "image_pull_policy": "IfNotPresent",
    "env": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    "container_create_kwargs": {
        "device_requests": [{"driver": "nvidia", "count": 1, "capabilities": [["gpu"]]}],
        "shm_size": "8g",  # torch data loaders share tensors through /dev/shm; Docker's 64 MB default is too small
    },
}


class DeploySettings(Section):
    """How ``autoevolve deploy`` puts this run on Prefect: the loop on a cron schedule, stages on work pools."""

    cron: str = Field(default="0 2 * * *", description="When the scheduled loop starts (five-field cron).")
    timezone: str = Field(default="UTC", description="IANA time zone of ``cron`` and of the date in scheduled run ids.")
    cpu_pool: str = Field(default="autoevolve-cpu", description="Work pool of the loop and the rollout stages.")
    gpu_pool: str = Field(default="autoevolve-gpu", description="Work pool of the distillation stage (type docker).")
    gpu_image: str = Field(
        default="autoevolve-gpu:latest", description="Docker image of distillation runs: CUDA torch + this project."
    )
    gpu_job_variables: dict[str, Any] = Field(
        default_factory=lambda: copy.deepcopy(GPU_JOB_VARIABLES),
        description="Docker worker job variables of the distillation deployment; keys given here replace the "
        "defaults' (one GPU, 8 GB /dev/shm, offline Hugging Face); a null value leaves that key out.",
    )
    remote_timeout_s: float | None = Field(
        default=86400.0, gt=0, description="Seconds a round waits for a remote stage's flow run; None: no limit."
    )

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, value: str) -> str:
        """Catch a malformed cron before it reaches Prefect (which checks each field)."""
        if len(value.split()) != 5:
            raise ValueError(f"{value!r} is not a five-field cron (minute hour day month weekday)")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        """The time zone must be in the IANA database."""
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r} (an IANA name such as 'UTC' or 'Europe/Berlin')") from None
        return value

    @field_validator("gpu_job_variables", mode="before")
    @classmethod
    def _over_defaults(cls, value: Any) -> Any:
        """Given keys replace the defaults', so that setting e.g. mem_limit keeps the GPU request."""
        # Nulls stay (the deployment leaves them out): a dumped config then validates to the same settings.
        return copy.deepcopy(GPU_JOB_VARIABLES) | value if isinstance(value, dict) else value


class RunConfig(Section):
    """One run of the loop."""

    run_id: str | None = Field(default=None, description="Defaults to the config file's stem.")
    seed: int = 0
    hcp: Path = Field(description="YAML file of the original HCP config.")
    expert: str = Field(default="L1-life", description="Registry name of the LoRA expert being improved.")
    rounds: int = Field(default=1, gt=0, description="Rounds run in turn, each from the last promoted adapter.")
    store: Path | str = Field(
        default=Path("trajectories/autoevolve.duckdb"),
        description="A DuckDB file, or a PostgreSQL database by URL (postgresql://...): many runs writing at once.",
    )
    run_dir: Path = Field(default=Path("trajectories/runs"), description="Reports and adapters go in run_dir/run_id.")
    env: EnvSettings = Field(default_factory=EnvSettings)
    curriculum: CurriculumSettings | None = Field(
        default=None, description="Draw each round's tasks from the live adapter's frontier; None: fixed tasks."
    )
    labels: LabelSettings | None = Field(
        default=None,
        description="A labelled budget: N train tasks with references, the rest unlabelled; None: every train task's "
        "reference may be shown as a demo, and none is trained on.",
    )
    model: ModelSettings = Field(default_factory=ModelSettings)
    evolve: EvolveSettings = Field(default_factory=EvolveSettings)
    select: SelectSettings = Field(default_factory=SelectSettings)
    distill: DistillSettings = Field(default_factory=DistillSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    deploy: DeploySettings = Field(default_factory=DeploySettings)
    _original: tuple[tuple[str, int], HCPConfig] | None = PrivateAttr(default=None)  # (hcp file, env), its config

    @field_validator("store")
    @classmethod
    def _store_kind(cls, value: Path | str) -> Path | str:
        """A PostgreSQL URL stays text; anything else is a DuckDB file's path."""
        return value if is_url(value) else Path(value)

    @field_validator("expert")
    @classmethod
    def _safe_expert(cls, name: str) -> str:
        """The expert's name becomes folder and served LoRA names."""
        return check_name(name)

    @model_validator(mode="after")
    def _pairs_for_dpo(self) -> RunConfig:
        """DPO trains on (win, the original's rollout on the same task) pairs: every win needs its pair."""
        if self.select.unpaired_after is not None and self.distill.trainer == "dpo":
            raise ValueError(
                "select.unpaired_after: trainer dpo needs each win paired with the original's rollout on its task; "
                "leave out select.unpaired_after, or train with sft"
            )
        return self

    @model_validator(mode="after")
    def _labels_fit(self) -> RunConfig:
        """A labelled budget needs the references on, and only SFT trains on references."""
        if self.labels is None:
            return self
        if not self.evolve.references and self.labels.budget:
            raise ValueError(
                "labels: with evolve.references false no label is read; set labels.budget: 0, or leave out labels"
            )
        if self.labels.train and self.labels.budget and self.distill.trainer != "sft":
            raise ValueError(
                f"labels.train: only trainer sft trains on references (the trainer is {self.distill.trainer}); "
                "set labels.train: false"
            )
        if self.labels.warm_start and self.registry.approval:
            raise ValueError(
                "labels.warm_start: the warm start is promoted when its dev gate passes, with no one asked, while "
                "registry.approval asks a person before each promotion; turn one of them off"
            )
        return self

    def original_hcp(self) -> HCPConfig:
        """The original HCP config named by ``hcp``, its tools the environment's (or checked against them); read once
        per config file and environment."""
        key = (str(self.hcp), id(self.env.make()))
        if self._original is None or self._original[0] != key:
            self._original = (key, HCPConfig.from_yaml(self.hcp).with_env_tools(self.env.make().tools()))
        return self._original[1]


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the file and field."""


# Settings a run may change between its invocations: where things go, how long it runs, who is told.
OPERATIONAL = ("rounds", "store", "run_dir", "registry", "deploy", "model.batch_size")


def changed_settings(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """'field: old -> new' for each setting that differs between two dumped run configs, operational ones aside.

    A setting only one side has (added by a newer version, with its default) is not a change.
    """
    out = []
    for key in sorted(set(before) & set(after)):
        name, old, new = f"{prefix}{key}", before[key], after[key]
        if name in OPERATIONAL:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            out += changed_settings(old, new, f"{name}.")
        elif old != new:
            out.append(f"{name}: {json.dumps(old)} -> {json.dumps(new)}")
    return out


def load_config(path: str | Path) -> RunConfig:
    """Read and check a run config and the HCP file it names; raise ConfigError with one clear line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level")
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_first_error(exc)}") from None
    config.hcp = _existing(config.hcp, path, "hcp")
    _locate_env_files(config.env, path, "env")
    if "reflective" in config.evolve.mutators:
        reflection = config.evolve.reflection
        reflection.meta_prompts = _existing(reflection.meta_prompts, path, "evolve.reflection.meta_prompts")
    if config.gate.guard is not None:
        _check_guard(config, path)
    if config.curriculum is not None and not set(config.curriculum.tiers) <= set(config.env.tiers):
        missing = sorted(set(config.curriculum.tiers) - set(config.env.tiers))
        raise ConfigError(f"{path}: curriculum.tiers: tier {missing[0]} is not in env.tiers; add it there")
    config.run_id = config.run_id or path.stem
    try:
        config.env.make()
    except EnvLoadError as exc:
        raise ConfigError(f"{path}: {_env_error(exc, 'env')}") from None
    try:
        config.original_hcp()
    except ValidationError as exc:
        raise ConfigError(f"{config.hcp}: {_first_error(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{config.hcp}: not valid YAML: {' '.join(str(exc).split())}") from None
    except ValueError as exc:  # a tool or parameter the environment lacks
        raise ConfigError(f"{config.hcp}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the environment's own bug in tools(), said in one line
        what = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ConfigError(f"{path}: env {config.env.make().name}: tools: {what}") from None
    _check_constrainable(config, path)
    return config


def _locate_env_files(env: EnvSettings, config_path: Path, field: str) -> None:
    """Find the files an environment's settings name like the hcp file: a loader's .py file, the factory's
    Path-annotated arguments, and 'file.py:Class' loader strings among its arguments."""
    if env.loader is not None:
        env.loader = _located_loader(env.loader, config_path, f"{field}.loader")
    try:
        paths = path_arguments(factory_of(env.name, env.loader))
    except EnvLoadError as exc:
        raise ConfigError(f"{config_path}: {_env_error(exc, field)}") from None
    for key, value in env.args.items():
        where = f"{field}.args.{key}"
        if key in paths and isinstance(value, list):
            env.args[key] = [_data_path(v, config_path, f"{where}[{i}]") for i, v in enumerate(value)]
        elif key in paths and isinstance(value, str | Path):
            env.args[key] = _data_path(value, config_path, where)
        elif isinstance(value, str) and LOADER_FILE.fullmatch(value):
            env.args[key] = _located_loader(value, config_path, where)


def _data_path(value: Any, config_path: Path, field: str) -> Any:
    """A path argument found like the hcp file; a dataset's name (no suffix) or a file inside an installed package
    ('package:path') as it is."""
    if not isinstance(value, str | Path) or not Path(value).suffix or PACKAGE_FILE.fullmatch(str(value)):
        return value
    return _existing(Path(value), config_path, field)


def _check_constrainable(config: RunConfig, path: Path) -> None:
    """An OpenAI-compatible server can hold replies to calls in JSON or through native tools, not in Python syntax:
    refuse a run whose decoding mutator would ask it to."""
    if config.model.backend != "openai" or "decoding" not in config.evolve.mutators:
        return
    original = config.original_hcp()
    shown = [(original.tool_format, original.call_syntax)]
    if "tool_format" in config.evolve.mutators:
        shown += config.evolve.presentations
    python = [p for p in shown if p[0] != "native" and p[1] != "json"]
    if python:
        raise ConfigError(
            f"{path}: the decoding mutator would constrain calls written as {python[0][1]} (tool_format "
            f"{python[0][0]}), which an OpenAI-compatible server cannot; use call_syntax json or native tools, or "
            "drop 'decoding' from evolve.mutators"
        )


def _env_error(exc: EnvLoadError, field: str) -> str:
    """An environment error under the dotted field of the settings it came from ('env.args.x' in a guard's)."""
    text = str(exc)
    return field + text[3:] if text.startswith(("env.", "env:")) else f"{field}: {text}"


LOADER_FILE = re.compile(r"(.+\.py):([\w.]+)")  # a loader string naming a local file


def _located_loader(spec: str, config_path: Path, field: str) -> str:
    """A 'file.py:attr' loader with its file found like the hcp file; a 'module:attr' one as it is."""
    match = LOADER_FILE.fullmatch(spec)
    if match is None:
        return spec
    return f"{_existing(Path(match[1]), config_path, field)}:{match[2]}"


def _check_guard(config: RunConfig, path: Path) -> None:
    """The guard set must be other tasks than the run's own, with the files it names present."""
    guard = config.gate.guard
    assert guard is not None
    shared = sorted(set(guard.env.tiers) & set(config.env.tiers))
    if guard.env.label == config.env.label and shared:
        raise ConfigError(
            f"{path}: gate.guard.env.tiers: tier {shared[0]} is also trained on; a guard set needs another tier "
            "or environment"
        )
    _locate_env_files(guard.env, path, "gate.guard.env")
    try:
        guard.env.make()
    except EnvLoadError as exc:
        raise ConfigError(f"{path}: {_env_error(exc, 'gate.guard.env')}") from None
    if guard.hcp is not None:
        guard.hcp = _existing(guard.hcp, path, "gate.guard.hcp")


def _existing(value: Path, config_path: Path, field: str) -> Path:
    """A file named by the config: as given, or relative to the project folder above the config's folder."""
    for candidate in (value, config_path.parent / value, config_path.parent.parent / value):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{config_path}: {field}: file {value} not found")


def _first_error(exc: ValidationError) -> str:
    """One line for the first validation error: dotted field, what is wrong, the fix where obvious."""
    err: dict[str, Any] = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; see the documented settings)"
    if err["type"] == "missing":
        return f"{where}: required setting is missing"
    if not err["loc"]:  # a check across sections names its fields itself
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {err['msg']} (got {err.get('input')!r})"
