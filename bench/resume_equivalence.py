"""Does a killed and resumed round end where an uninterrupted one does? One real round on SmolLM2-135M, twice.

Run A goes through uninterrupted. Run B is killed with SIGKILL during stage 1 and again during training, and
started again each time with the same run id. The table compares what they left: rollouts, ledger, selection,
adapter weights, decisions and the test 2x2; the wall time of each attempt shows what the resumes saved.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/resume_equivalence.py [--workdir /tmp/resume-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
run_id: resume
seed: 0
hcp: {root}/prompts/life.yaml
store: {dir}/store.duckdb
run_dir: {dir}/runs
env: {{tiers: [1], n_train: 96, n_dev: 16, n_test: 16}}
evolve: {{train_tasks: 12, candidates: 2, mutators: [demos, tool_format], demo_pool: 12}}
select: {{train_tasks: 24}}
distill: {{epochs: 2, batch_size: 4}}
gate: {{dev_tasks: 8, test_tasks: 8}}
"""


def start(config: Path, kill_after: str | None = None, count: int = 1) -> tuple[int, float]:
    """Run ``autoevolve run``; SIGKILL it when ``kill_after`` has appeared ``count`` times. (exit code, seconds)"""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoevolve.cli", "run", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the kill takes Prefect's ephemeral API server down too
    )
    assert proc.stdout is not None
    seen, buffer = 0, b""
    while chunk := proc.stdout.read1(4096):
        buffer += chunk
        *lines, buffer = re.split(rb"[\r\n]", buffer)
        seen += sum(kill_after is not None and kill_after.encode() in line for line in lines)
        if kill_after and seen >= count and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole machine's view of a crash: every process at once
    return proc.wait(), time.perf_counter() - started


def state(folder: Path) -> dict:
    """What a run left behind, minus wall-clock numbers."""
    import torch
    from safetensors.torch import load_file

    from autoevolve.store import Store

    with Store.snapshot(folder / "store.duckdb") as store:
        rows = {t.key: t.model_dump(exclude={"latency_s"}) for t in store.trajectories("resume")}
        ledger = [c.model_dump() for c in store.candidates("resume")]
        selections = [s.id for s in store.selections("resume")]
        adapters = [(a.version, a.status) for a in store.adapters()]
    report = json.loads((folder / "runs" / "resume" / "report.json").read_text())
    report.pop("seconds")
    report["evolve"]["budget"].pop("seconds")
    report.pop("adapter_path", None)  # under each run's own folder
    if report.get("train"):
        report["train"] = {k: v for k, v in report["train"].items() if k not in ("path", "seconds")}
    weights = {}
    for path in sorted((folder / "runs" / "resume" / "adapters").glob("*/adapter_model.safetensors")):
        weights[path.parent.name] = {k: v.to(torch.float64) for k, v in load_file(path).items()}
    return {
        "rows": rows,
        "ledger": ledger,
        "selections": selections,
        "adapters": adapters,
        "report": report,
        "weights": weights,
    }


def same_weights(a: dict, b: dict) -> bool:
    """Whether two runs saved bit-identical adapters."""
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(bool((a[n][k] == b[n][k]).all()) for k in a[n]) for n in a
    )


def main() -> None:
    """Run A, then B with two kills, and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/autoevolve-resume-bench"))
    parser.add_argument("--keep-a", action="store_true", help="reuse a finished uninterrupted run in the workdir")
    args = parser.parse_args()
    keep = args.keep_a and (args.workdir / "a" / "runs" / "resume" / "report.json").exists()
    for name in ("b",) if keep else ("a", "b"):
        shutil.rmtree(args.workdir / name, ignore_errors=True)
    configs = {}
    for name in ("a", "b"):
        (args.workdir / name).mkdir(parents=True, exist_ok=True)
        configs[name] = args.workdir / name / "run.yaml"
        configs[name].write_text(CONFIG.format(root=ROOT, dir=args.workdir / name))

    code, seconds_a = (0, float("nan")) if keep else start(configs["a"])
    assert code == 0, "the uninterrupted run failed"
    steps = []
    for kill_after, count in ((" evolve ", 4), (" train (loss", 3), (None, 0)):
        code, seconds = start(configs["b"], kill_after, count)
        steps.append((kill_after or "-", code, seconds))
    assert steps[-1][1] == 0, "the resumed run failed"
    a, b = state(args.workdir / "a"), state(args.workdir / "b")
    print(f"uninterrupted: {seconds_a:.0f} s")
    for kill_after, code, seconds in steps:
        print(f"killed at {kill_after!r}: exit {code}, {seconds:.0f} s")
    print(f"total for the killed run: {sum(s for _, _, s in steps):.0f} s")
    print("| what | uninterrupted | killed twice, resumed | equal |")
    print("| --- | ---: | ---: | --- |")
    for label, key, size in (
        ("trajectories", "rows", len),
        ("ledger rows", "ledger", len),
        ("selections", "selections", len),
        ("adapter versions", "adapters", len),
    ):
        print(f"| {label} | {size(a[key])} | {size(b[key])} | {a[key] == b[key]} |")
    equal = same_weights(a["weights"], b["weights"])
    print(f"| adapter weights | {len(a['weights'])} | {len(b['weights'])} | {equal} |")
    decision = lambda r: r.get("gate", {}).get("decision", "nothing selected")  # noqa: E731
    print(f"| decision | {decision(a['report'])} | {decision(b['report'])} | {a['report'] == b['report']} |")
    if "eval" in a["report"]:
        cells = " / ".join(f"{v:.3f}" for k, v in a["report"]["eval"].items() if k != "n_tasks" and k != "split")
        other = " / ".join(f"{v:.3f}" for k, v in b["report"]["eval"].items() if k != "n_tasks" and k != "split")
        print(f"| test 2x2 | {cells} | {other} | {a['report']['eval'] == b['report']['eval']} |")


if __name__ == "__main__":
    main()
