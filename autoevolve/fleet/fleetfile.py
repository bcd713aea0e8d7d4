"""A fleet file: several experts evolving at once, each its own run config on its own schedule, all writing one
store and one registry, with a limit on how many distil at once.

    training_limit: 1            # distillations at once, over every expert (the GPU pool's concurrency limit)
    experts:
      - config: configs/quickstart.yaml
      - config: configs/bfcl.yaml
        cron: "30 3 * * *"       # replaces that config's deploy.cron

A config path is read as given, else beside the fleet file. The experts must be distinct, their run ids distinct,
and their store one and the same; with more than one expert it must be a store many processes can write (a
PostgreSQL URL): one DuckDB file takes one writer.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from autoevolve.config import ConfigError, DeploySettings, RunConfig, _first_error, load_config
from autoevolve.stages.settings import Section
from autoevolve.store.postgres import is_url


class FleetExpert(Section):
    """One expert of the fleet: its run config, and the schedule that replaces the config's own."""

    config: Path = Field(description="The expert's run config (as given, else beside the fleet file).")
    cron: str | None = Field(default=None, description="Five-field cron replacing the config's deploy.cron.")


class FleetFile(Section):
    """The experts evolving at once (see the module docstring)."""

    training_limit: int = Field(default=1, gt=0, description="Distillations running at once over every expert.")
    experts: list[FleetExpert] = Field(min_length=1, description="Each expert's run config and schedule.")


def is_fleet_file(path: str | Path) -> bool:
    """Whether a YAML file is a fleet file (a mapping with ``experts``) rather than a run config."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and "experts" in raw


def load_fleet(path: str | Path) -> tuple[FleetFile, list[tuple[str, RunConfig]]]:
    """The fleet file and each expert's (config path, run config, its cron applied); ConfigError naming the file
    and the field or expert at fault."""
    path = Path(path)
    try:
        fleet = FleetFile.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_first_error(exc)}") from None
    configs = []
    for i, expert in enumerate(fleet.experts):
        found = expert.config if expert.config.is_file() else path.parent / expert.config
        config = load_config(found)
        if expert.cron is not None:
            try:
                config.deploy = DeploySettings.model_validate(config.deploy.model_dump() | {"cron": expert.cron})
            except ValidationError as exc:
                raise ConfigError(f"{path}: experts[{i}].cron: {_first_error(exc)}") from None
        configs.append((str(found), config))
    _check(path, configs)
    return fleet, configs


def _check(path: Path, configs: list[tuple[str, RunConfig]]) -> None:
    """Distinct experts and run ids, one store, and one that several processes can write when there are several."""
    for field in ("expert", "run_id"):
        seen: dict[str, str] = {}
        for where, config in configs:
            value = str(getattr(config, field))
            if value in seen:
                raise ConfigError(f"{path}: {seen[value]} and {where} both have {field} {value!r}; each needs its own")
            seen[value] = where
    stores = {str(config.store): where for where, config in configs}
    if len(stores) > 1:
        (a, first), (b, second) = list(stores.items())[:2]
        raise ConfigError(f"{path}: {first} writes store {a} but {second} writes {b}: the fleet shares one store")
    store = next(iter(stores))
    if len(configs) > 1 and not is_url(store):
        raise ConfigError(
            f"{path}: {len(configs)} experts would write the DuckDB file {store} at once, and it takes one writer: "
            "set store: postgresql://USER@HOST/DB in every expert's config"
        )
