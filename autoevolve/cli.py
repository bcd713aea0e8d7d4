"""The ``autoevolve`` command.

autoevolve run configs/quickstart.yaml    one self-evolution round (a Prefect flow, no server needed)
autoevolve check configs/quickstart.yaml  validate a run config and its HCP file, do nothing else
"""

from __future__ import annotations

import argparse
import os
import sys

from autoevolve.config import ConfigError, RunConfig, load_config


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a bad config, with one line on stderr)."""
    parser = argparse.ArgumentParser(prog="autoevolve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one self-evolution round from a run config", description=_RUN_HELP)
    run.add_argument("config", help="run config YAML, e.g. configs/quickstart.yaml")
    check = sub.add_parser("check", help="validate a run config and its HCP file")
    check.add_argument("config", help="run config YAML")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"autoevolve: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(f"{args.config}: ok (run {config.run_id}, original HCP {config.original_hcp().id})")
        return 0
    return _run(config)


_RUN_HELP = (
    "Run one round: prompt evolution on train tasks, selection of the rollouts the best config unlocked, "
    "LoRA distillation under the original config, the dev gate, and the 2x2 report on test tasks. "
    "Writes report.json under run_dir/run_id."
)


def _run(config: RunConfig) -> int:
    """Run the round flow (imported here: the library itself never imports Prefect)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry writes racing the flow
    from flows.round import round_flow

    round_flow(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
