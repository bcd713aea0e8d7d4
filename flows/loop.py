"""The loop flow: ``rounds`` rounds one after another, each starting from the adapter the last one promoted.

Run: autoevolve run configs/quickstart.yaml   (a config with rounds: 3 runs three rounds)
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from autoevolve.config import RunConfig, load_config
from autoevolve.report import format_rounds, write_rounds
from flows.round import round_flow


@flow(name="autoevolve-loop")
def loop_flow(config: RunConfig) -> list[dict[str, Any]]:
    """Run rounds 0..rounds-1; round r+1's baseline is the promoted adapter (A_r again after a rejection).

    Re-running a crashed run resumes it: finished rounds are read back, the interrupted one continues.
    """
    reports = [round_flow(config, round=r) for r in range(config.rounds)]
    path = write_rounds(config, reports)
    if len(reports) > 1:
        print(format_rounds(reports))
        print(f"rounds: {path}")
    return reports


if __name__ == "__main__":
    loop_flow(load_config(sys.argv[1]))
