"""Does a killed and resumed round end where an uninterrupted one does? One real round on SmolLM2-135M, twice.

Run A goes through uninterrupted. Run B is killed with SIGKILL during stage 1 and again during training, and
started again each time with the same run id; each kill must have landed where it was aimed (a SIGKILL exit, inside
that stage, the stage before it finished), else the bench stops. The table compares what they left: rollouts,
ledger, selection, adapter weights, decisions and the test 2x2; the wall time of each attempt shows what the
resumes saved.

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

from _shared import write_json

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

KILLS = ((" evolve ", 4, "evolve"), (" train (loss", 3, "distill"))  # (marker, its count, the stage it lands in)


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


def landed(folder: Path, code: int, marker: str, aim: str) -> None:
    """Check that a kill landed where it was aimed: by SIGKILL, inside stage ``aim`` (the one before finished)."""
    from autoevolve.stages.pipeline import STAGES
    from autoevolve.store import Store

    if code != -signal.SIGKILL:
        raise SystemExit(f"the run to be killed in {aim} exited {code} instead: {marker!r} did not appear often enough")
    with Store.snapshot(folder / "store.duckdb") as store:
        done = {stage for _, stage in store.finished_stages("resume")}
    names = list(STAGES)
    before = names[names.index(aim) - 1]
    if aim in done or before not in done:
        raise SystemExit(f"the kill aimed at {aim} landed elsewhere: finished stages {sorted(done)}")
    print(f"killed inside {aim} ({before} had finished)")


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
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
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
    for kill_after, count, aim in KILLS:
        code, seconds = start(configs["b"], kill_after, count)
        steps.append((kill_after, code, seconds))
        landed(args.workdir / "b", code, kill_after, aim)
    code, seconds = start(configs["b"])
    steps.append(("-", code, seconds))
    assert code == 0, "the resumed run failed"
    a, b = state(args.workdir / "a"), state(args.workdir / "b")
    print(f"uninterrupted: {seconds_a:.0f} s")
    for kill_after, code, seconds in steps:
        print(f"killed at {kill_after!r}: exit {code}, {seconds:.0f} s")
    print(f"total for the killed run: {sum(s for _, _, s in steps):.0f} s")
    table = [
        (label, len(a[key]), len(b[key]), a[key] == b[key])
        for label, key in (
            ("trajectories", "rows"),
            ("ledger rows", "ledger"),
            ("selections", "selections"),
            ("adapter versions", "adapters"),
        )
    ]
    table.append(("adapter weights", len(a["weights"]), len(b["weights"]), same_weights(a["weights"], b["weights"])))
    decision = lambda r: r.get("gate", {}).get("decision", "nothing selected")  # noqa: E731
    table.append(("decision", decision(a["report"]), decision(b["report"]), a["report"] == b["report"]))
    if "eval" in a["report"]:
        shown = lambda r: " / ".join(f"{v:.3f}" for k, v in r["eval"].items() if k not in ("n_tasks", "split"))  # noqa: E731
        table.append(("test 2x2", shown(a["report"]), shown(b["report"]), a["report"]["eval"] == b["report"]["eval"]))
    print("| what | uninterrupted | killed twice, resumed | equal |")
    print("| --- | ---: | ---: | --- |")
    print("\n".join(f"| {label} | {x} | {y} | {same} |" for label, x, y, same in table))
    if args.json:
        kills = [{"marker": m, "exit": code, "seconds": s} for m, code, s in steps]
        write_json(args.json, {"uninterrupted_s": None if keep else seconds_a, "attempts": kills, "table": table})


if __name__ == "__main__":
    main()
