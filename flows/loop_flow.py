"""The loop flow: ``rounds`` rounds one after another, each starting from the adapter the last one promoted.

Run: autoevolve run configs/quickstart.yaml   (a config with rounds: 3 runs three rounds)
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prefect import flow

from autoevolve import loop
from autoevolve.config import RunConfig, load_config
from autoevolve.stages.report import format_rounds, write_rounds
from autoevolve.views.narration import say
from autoevolve_flows.round import round_flow

ROUND_RETRIES = 1  # a round that failed on a transient error runs again once, resuming from the store
RETRY_DELAY_S = 60.0


@flow(name="autoevolve-loop")
def loop_flow(config: RunConfig) -> list[dict[str, Any]]:
    """Run rounds 0..rounds-1; round r+1's baseline is the promoted adapter (A_r again after a rejection).

    Re-running a crashed run resumes it: finished rounds are read back, the interrupted one continues. A round that
    fails on a transient error (endpoint down, store busy) is run again once after RETRY_DELAY_S; any other error
    (config, data, code) stops the loop at once, as it would fail the same way again.
    """
    reports = [_round(config, r) for r in range(config.rounds)]
    path = write_rounds(config, reports)
    if len(reports) > 1:
        say(format_rounds(reports))
        say(f"rounds: {path}")
    return reports


def _round(config: RunConfig, r: int) -> dict[str, Any]:
    """Round r, run again (it resumes from the store) after a transient failure."""
    for attempt in range(ROUND_RETRIES + 1):
        try:
            return round_flow(config, round=r)
        except Exception as exc:
            if attempt == ROUND_RETRIES or not loop.transient(exc):
                raise
            say(f"round {r} failed on a transient error ({exc}); running it again in {RETRY_DELAY_S:.0f} s")
            time.sleep(RETRY_DELAY_S)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    loop_flow(load_config(sys.argv[1]))
