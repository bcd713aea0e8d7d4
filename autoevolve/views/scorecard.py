"""Score any adapter/config pair on any environment's tasks (the ``autoevolve eval`` command).

The rollouts go to the store under their own run id (``RUN-eval`` unless told otherwise), so an evaluation never
mixes with a run's rounds and can be read like any run: mean reward with its 95% bootstrap interval, per tier,
and each task's reward in eval.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autoevolve.config import ConfigError, EnvSettings, RunConfig
from autoevolve.fleet.registry import check_adapter_folder
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.workbench import Workbench
from autoevolve.model import base_model_id
from autoevolve.records import Message, Split, Trajectory
from autoevolve.stats import bootstrap_ci, mean
from autoevolve.store import Store
from autoevolve.views.lineage import LineageError, resolve, run_candidates
from autoevolve.views.table import text_table


def env_settings(config: RunConfig, value: str | None) -> EnvSettings:
    """The run's environment, or another: a registered name, a 'module:factory' loader, or a YAML mapping of
    env settings ('{name: life, tiers: [2]}')."""
    if value is None:
        return config.env
    raw = yaml.safe_load(value) if value.lstrip().startswith("{") else {("loader" if ":" in value else "name"): value}
    try:
        return EnvSettings.model_validate(raw)
    except ValueError as exc:
        raise ConfigError(f"--env {value}: {' '.join(str(exc).split())}") from None


def pick_adapter(store: Store, config: RunConfig, value: str | None) -> tuple[str, str | None]:
    """(label, folder) of the adapter to score: 'base' (none), NAME@V from the registry, a folder, or by default
    the config's expert's live version (the base model when it has none)."""
    if value == "base":
        return "", None
    if value is None:
        live = store.promoted_adapter(config.expert)
        return (live.ref, live.path) if live else ("", None)
    if "@" in value and not Path(value).exists():
        name, _, version = value.partition("@")
        try:
            record = store.adapter(name, int(version.removeprefix("v")))
        except (KeyError, ValueError):
            raise ConfigError(
                f"--adapter {value}: no such adapter in {store.path} (see `autoevolve registry list`)"
            ) from None
        return record.ref, record.path
    folder = Path(value)
    try:
        check_adapter_folder(folder, base_model_id(config.model.name))
    except ValueError as exc:
        raise ConfigError(f"--adapter {value}: {exc}") from None
    return f"path-{folder.resolve().name}", str(folder)


def pick_hcp(store: Store, config: RunConfig, env_tools: list[dict[str, Any]], value: str) -> HCPConfig:
    """The config to score under: 'seed' (the run's original), 'best' or an id (prefix) of the run's stored
    configs, or a YAML file (its tools checked against the environment's)."""
    if value == "seed":
        return HCPConfig.from_yaml(config.hcp).with_env_tools(env_tools)
    if Path(value).is_file():
        try:
            return HCPConfig.from_yaml(value).with_env_tools(env_tools)
        except ValueError as exc:
            raise ConfigError(f"--hcp {value}: {' '.join(str(exc).split())}") from None
    try:
        hcp_id = resolve(run_candidates(store, str(config.run_id)), value)
    except LineageError as exc:
        raise ConfigError(f"--hcp {value}: {exc}") from None
    return HCPConfig.model_validate(store.get_hcp(hcp_id))


def evaluate_pair(bench: Workbench, hcp: HCPConfig, adapter: str, split: Split, n_tasks: int | None) -> dict[str, Any]:
    """Roll out the first ``n_tasks`` tasks of a split (stored rollouts reused) and summarise the rewards."""
    tasks = bench.env.tasks(split)[:n_tasks]
    if not tasks:
        raise ConfigError(f"the environment has no {split} tasks")
    trajs = bench.rollouts(hcp, tasks, adapter, stage="eval")
    rewards = {t.task_id: t.reward for t in trajs}
    tiers: dict[str, list[float]] = {}
    for task in tasks:
        tiers.setdefault(str(task.tier), []).append(rewards[task.id])
    return {
        "run_id": bench.run_id,
        "env": bench.env.name,
        "split": split,
        "n_tasks": len(tasks),
        "adapter": adapter or "base",
        "hcp": {"id": hcp.id, "name": hcp.name},
        "mean": mean(list(rewards.values())),
        "ci": list(bootstrap_ci(list(rewards.values()))),
        "tiers": {k: {"mean": mean(v), "n_tasks": len(v)} for k, v in sorted(tiers.items())},
        "failed": sum(bool(t.error) for t in trajs),
        "rewards": rewards,
        "tasks": [
            {
                "task_id": t.task_id,
                "reward": t.reward,
                "feedback": t.feedback,
                "error": t.error,
                "turns": sum(m.role == "assistant" for m in t.messages),
            }
            for t in trajs
        ],  # fmt: skip
        "trajectories": trajs,  # for --show; not written to eval.json
    }


def format_eval(result: dict[str, Any]) -> str:
    """The evaluation in a few lines: mean [95% CI], what was scored, per tier."""
    low, high = result["ci"]
    head = (
        f"mean reward {result['mean']:.3f} [{low:.3f}, {high:.3f}] on {result['n_tasks']} {result['split']} tasks "
        f"of {result['env']}: adapter {result['adapter']}, HCP {result['hcp']['id']} ({result['hcp']['name']})"
    )
    rows = [[f"  tier {k}", f"{v['mean']:.3f}", f"on {v['n_tasks']} tasks"] for k, v in result["tiers"].items()]
    failed = [f"  {result['failed']} rollouts failed (reward 0; see the store)"] if result["failed"] else []
    return "\n".join([head, *([text_table(None, rows, right={1})] if rows else []), *failed])


def write_eval(result: dict[str, Any], path: Path) -> Path:
    """eval.json: the summary, and per task its reward, the environment's feedback, error and model turns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "trajectories"}, indent=2) + "\n")
    return path


def format_failures(trajs: list[Trajectory], k: int, last: int = 3) -> str:
    """Up to ``k`` rollouts that did not reach a full reward: the task, its reward and the environment's feedback,
    and the conversation's last messages (tool results included)."""
    if not trajs:
        return "no rollouts to show: nothing was scored on test yet"
    failed = [t for t in trajs if t.reward < 1.0][:k]
    if not failed:
        return "no failed rollout to show: every task reached a full reward"
    blocks = []
    for t in failed:
        head = f"{t.task_id} (reward {t.reward:.2f}, {sum(m.role == 'assistant' for m in t.messages)} model turns)"
        why = t.error or t.feedback or "-"
        shown = [f"    {m.role}: {_said(m)}" for m in t.messages[-last:]]
        blocks.append("\n".join([head, f"  why: {why}", "  last messages:", *shown]))
    more = sum(t.reward < 1.0 for t in trajs) - len(failed)
    return "\n\n".join(blocks) + (f"\n\n({more} more failed)" if more > 0 else "")


def _said(message: Message) -> str:
    """A message in one line: its text, or its calls."""
    calls = "; ".join(f"{c.name}({c.function.get('arguments', '')})" for c in message.tool_calls)
    text = " ".join((message.content or calls or "(empty)").split())
    return text[:300] + ("..." if len(text) > 300 else "")
