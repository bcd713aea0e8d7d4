"""Rollout throughput, side by side in one process: batched vs one-at-a-time generation, bulk vs row-wise ingest.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/rollout_throughput.py [--requests 32] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from autoevolve.envs.life import LifeEnv
from autoevolve.hcp import HCPConfig
from autoevolve.policy import ChatRequest
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Message, ToolCall, Trajectory
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]


def generation(policy: LocalPolicy, n: int, tokens: int, repeats: int) -> list[tuple[str, float, float]]:
    """Median generated tokens/s for the same requests batched and one by one."""
    env, hcp = LifeEnv(tiers=(1,)), HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    requests = [ChatRequest(messages=hcp.render(t)[0], max_new_tokens=tokens) for t in env.tasks("dev")[:n]]
    rows = []
    for label, batch in (("batched", policy.batch_size), ("one at a time", 1)):
        rates = []
        for _ in range(repeats):
            policy.batch_size = batch
            started = time.perf_counter()
            out = policy.generate(requests)
            rates.append(sum(c.completion_tokens for c in out) / (time.perf_counter() - started))
        rows.append((label, statistics.median(rates), 0.0))
    return rows


def synthetic(n: int) -> list[Trajectory]:
    """n trajectories shaped like real ones: request, tool call, tool result, reply."""
    call = ToolCall.make("call_1", "book_table", {"restaurant_id": "R-101", "party_size": 2, "time": "19:00"})
    messages = [
        Message(role="user", content="Book a table for 2 at Sunny Table (R-101) at 19:00."),
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", content='{"booking_id": "B-1", "restaurant_id": "R-101"}', tool_call_id="call_1"),
        Message(role="assistant", content="Done: table for 2 at Sunny Table at 19:00."),
    ]
    return [
        Trajectory(run_id="bench", task_id=f"t{i:06d}", split="train", hcp_id="h", messages=messages, reward=1.0)
        for i in range(n)
    ]


def ingest(n_bulk: int, n_rows: int) -> list[tuple[str, float, float]]:
    """Trajectories/s through the bulk path and through one INSERT per row."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, n, method in (
            ("bulk (Arrow)", n_bulk, "put_trajectories"),
            ("row inserts", n_rows, "put_trajectories_rowwise"),
        ):
            trajs = synthetic(n)
            with Store(Path(tmp) / f"{method}.duckdb") as store:
                started = time.perf_counter()
                getattr(store, method)(trajs)
                rows.append((f"{label}, {n} rows", n / (time.perf_counter() - started), 0.0))
    return rows


def main() -> None:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bulk", type=int, default=100_000)
    parser.add_argument("--rows", type=int, default=2_000)
    args = parser.parse_args()
    policy = LocalPolicy(batch_size=args.requests)
    gen = generation(policy, args.requests, args.tokens, args.repeats)
    print(f"\nLocalPolicy, SmolLM2-135M, {args.requests} requests x {args.tokens} new tokens, median of {args.repeats}")
    print(f"{'mode':<24}{'tokens/s':>12}{'ratio':>10}")
    for label, rate, _ in gen:
        print(f"{label:<24}{rate:>12.1f}{rate / gen[-1][1]:>10.1f}")
    ing = ingest(args.bulk, args.rows)
    print("\nDuckDB store ingest")
    print(f"{'path':<30}{'trajectories/s':>16}{'ratio':>10}")
    for label, rate, _ in ing:
        print(f"{label:<30}{rate:>16.0f}{rate / ing[-1][1]:>10.1f}")


if __name__ == "__main__":
    main()
