"""The loop flow: ``rounds`` rounds one after another, each starting from the adapter the last one promoted.

Run: autoevolve run configs/quickstart.yaml   (a config with rounds: 3 runs three rounds)
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from autoevolve import loop
from autoevolve.config import RunConfig, load_config
from flows.round import round_flow


@flow(name="autoevolve-loop")
def loop_flow(config: RunConfig) -> list[dict[str, Any]]:
    """Run the rounds; round r+1's baseline is the promoted adapter (A_r again after a rejection)."""
    reports = [round_flow(config)]
    for _ in range(config.rounds - 1):
        reports.append(round_flow(config, round=reports[-1]["round"] + 1))
    path = loop.write_rounds(config, reports)
    if len(reports) > 1:
        print(loop.format_rounds(reports))
        print(f"rounds: {path}")
    return reports


if __name__ == "__main__":
    loop_flow(load_config(sys.argv[1]))
