"""Where are a tier's wins? Adapters x (original config, + reference demos of that tier) x (greedy, k samples).

For each adapter (the base model and the loop's versions), on the first N train tasks of a tier: the original
config greedy and sampled k times, then the same with three other tasks' references of that tier shown as full
demos. Per cell the mean reward and the tasks solved at least once. This is the headroom a round can distil on
that tier: if no cell solves a task, no search or sampling of these configs finds a win there.

The check: the best cell solves at least the loop's bar for the tier (tier 2: 0.40 of the tasks), else FAIL with
the measured ceiling. ``--retry-bad-calls N`` runs every cell with ``scaffold.retry_bad_calls`` N (a bad call is
answered with its error, N times per rollout at most): does telling the model why its call failed find more wins?

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/tier_headroom.py --adapter v1=trajectories/runs/loop/adapters/L1-life-v1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import write_json  # noqa: E402

BARS = {2: 0.40, 3: 0.40}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "loop.yaml")
    parser.add_argument("--adapter", action="append", default=[], help="NAME=PATH of an adapter folder (repeat)")
    parser.add_argument("--tier", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--demos", type=int, default=3)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--retry-bad-calls", type=int, default=0, help="scaffold.retry_bad_calls of every cell")
    parser.add_argument("--skip-base", action="store_true", help="roll out the given adapters only")
    parser.add_argument("--store", type=Path, default=ROOT / "trajectories" / "headroom.duckdb")
    parser.add_argument("--run-id", default="headroom", help="the store's run id (stored rollouts are reused)")
    parser.add_argument("--json", type=Path, default=ROOT / "trajectories" / "headroom.json")
    args = parser.parse_args()

    from autoevolve.config import load_config
    from autoevolve.harness.hcp import Demo, Demos
    from autoevolve.harness.workbench import Workbench
    from autoevolve.loop import make_policy
    from autoevolve.stats import mean
    from autoevolve.store import Store

    config = load_config(args.config)
    policy = make_policy(config)
    env = config.env.make()
    tier = [t for t in env.tasks("train") if t.tier == args.tier]
    probe, refs = tier[: args.tasks], tier[args.tasks : args.tasks + args.demos]
    original = config.original_hcp().retrying(args.retry_bad_calls)
    demos = Demos(items=[Demo(task_id=t.id, messages=env.reference(t)) for t in refs])
    configs = {"original": original, f"+{len(refs)} demos": original.model_copy(update={"demos": demos})}
    adapters = {} if args.skip_base else {"base": ""}
    for spec in args.adapter:
        name, _, path = spec.partition("=")
        policy.add_adapter(name, path)
        adapters[name] = name
    rows = []
    with Store(args.store) as store:
        bench = Workbench(policy, env, store, args.run_id, seed=config.seed)
        for name, adapter in adapters.items():
            for label, hcp in configs.items():
                for temperature, k in ((0.0, 1), (args.temperature, args.samples)):
                    started = time.perf_counter()
                    used = hcp.sampled(temperature) if temperature else hcp
                    trajs = bench.rollouts(used, probe, adapter, stage="select", samples=k)
                    solved = len({t.task_id for t in trajs if t.reward >= 1.0})
                    rows.append(
                        {
                            "adapter": name,
                            "config": label,
                            "temperature": temperature,
                            "samples": k,
                            "mean": round(mean([t.reward for t in trajs]), 3),
                            "solved": solved,
                            "tasks": len(probe),
                            "seconds": round(time.perf_counter() - started, 1),
                        }
                    )
                    r = rows[-1]
                    print(
                        f"{name:>8} {label:>10} T={temperature:.1f} k={k}: mean {r['mean']:.3f}, "
                        f"solved {solved}/{len(probe)} ({r['seconds']:.0f} s)",
                        flush=True,
                    )
    best = max(rows, key=lambda r: r["solved"])
    bar = BARS.get(args.tier, 0.0)
    share = best["solved"] / len(probe)
    verdict = "PASS" if share >= bar else "FAIL"
    print(
        f"tier {args.tier}: best cell {best['adapter']} {best['config']} k={best['samples']} solves "
        f"{best['solved']}/{len(probe)} = {share:.2f}  >= {bar:.2f}: {verdict}"
    )
    body = {"tier": args.tier, "retry_bad_calls": args.retry_bad_calls, "rows": rows, "best": best, "bar": bar}
    write_json(args.json, body | {"verdict": verdict})


if __name__ == "__main__":
    main()
