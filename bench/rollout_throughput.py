"""Rollout throughput, side by side in one process: one request at a time, batching, prefix sharing, the decoder.

On the quickstart's real prompts (the life environment's original config, and an evolved one with two
first-call demos per task, as stage 1 finds them), greedy:

- ``sequential``: ``model.generate`` one request at a time, fp32;
- ``batched``: ``model.generate`` on padded batches, fp32 (batching alone; every row waits for the slowest);
- ``lock-step``: the same batches with their shared prompt prefix computed once, fp32 (batching plus prefix
  sharing: the path before the decoder);
- ``decoder fp32``: ``autoevolve.policy.decode`` at fp32 (its tokens, and batched ones, must equal lock-step's);
- ``decoder auto``: the decoder in the default dtype (bf16 on CPUs with native bf16, else fp32).

Rows give generated tokens/s (medians of ``--repeats``, modes interleaved after a warm-up), the ratio to
lock-step, and two bounds: memory bandwidth (a decode step reads every weight once, so a batch of B rows cannot
beat B x (copy rate / weight bytes) tokens/s, with the copy rate measured here) and compute (a token costs two
FLOPs per weight of the matrix products, which run at most at the rate measured here for the decoder's own
product at B rows). Then whole multi-step episodes (rollouts/s, what a round pays for), and DuckDB ingest as a
round writes it: chunks of 64 trajectories of a round's shape into a growing store, median seconds per chunk.
Last, what constrained decoding costs per token: the fncall sample's first calls decoded free and under the
tool-call grammar (decoder, default dtype), decode milliseconds per generated token from the decoder's own
counters, and the grammar's mask and advance alone per token.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/rollout_throughput.py [--requests 64] [--repeats 3] [--json out.json]
     (--grammar-only: the constrained-decoding table alone, a few minutes)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _shared import write_json

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import Demo, Demos, HCPConfig
from autoevolve.harness.rollout import rollout
from autoevolve.policy import ChatRequest
from autoevolve.policy.local import LocalPolicy
from autoevolve.policy.weights import pack
from autoevolve.records import Message, Trajectory
from autoevolve.store import Store

ROOT = Path(__file__).resolve().parents[1]
TARGET = 3.0  # the decoder's tokens/s over lock-step batching, on the quickstart's prompts


def configs(env: LifeEnv) -> dict[str, HCPConfig]:
    """The original config, and an evolved one with two nearest first-call demos from 16 labelled train tasks."""
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    items = [Demo(task_id=t.id, messages=env.reference(t)) for t in env.tasks("train")[:16]]
    demos = Demos(items=items, select="nearest", k=2, style="first_call")
    return {"original": original, "evolved": original.model_copy(update={"name": "evolved", "demos": demos})}


def first_calls(env: LifeEnv, hcp: HCPConfig, n: int) -> list[ChatRequest]:
    """The first model call of n dev episodes, as a rollout makes it."""
    requests = []
    for task in env.tasks("dev")[:n]:
        messages, tools = hcp.render(task, [Message(role="user", content=task.request)])
        requests.append(ChatRequest(messages=messages, tools=tools, max_new_tokens=hcp.sampling.max_new_tokens))
    return requests


def copy_rate() -> float:
    """Bytes read and written per second by a large tensor copy (median of 5): the machine's memory bandwidth."""
    src = torch.ones(256 * 2**20 // 4)  # 256 MiB, far beyond any cache
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def gemm_rate(rows: int, dtype: torch.dtype) -> float:
    """FLOP/s of the decoder's widest projection (SmolLM2's gate and up, 576 -> 3072) at ``rows`` rows, median of 9."""
    weight = torch.randn(3072, 576, dtype=dtype)
    proj, x = pack(weight), torch.randn(rows, 576, dtype=dtype)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        proj(x)
        times.append(time.perf_counter() - started)
    return 2 * rows * weight.numel() / statistics.median(times[1:])


def matmul_flops(policy: LocalPolicy) -> int:
    """FLOPs of the matrix products per generated token: two per weight of every linear layer and the head."""
    return 2 * sum(m.weight.numel() for m in policy.base.modules() if isinstance(m, torch.nn.Linear))


def weight_bytes(policy: LocalPolicy) -> int:
    """Bytes of every weight a decode step reads (tied embeddings counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in policy.base.parameters()}
    return sum(seen.values())


class Mode:
    """A way to generate: a policy, its batch size, and whether the decoder serves it."""

    def __init__(self, label: str, policy: LocalPolicy, batch: int, decoder: bool, share_prefix: bool = True) -> None:
        self.label, self.policy, self.batch, self.decoder = label, policy, batch, decoder
        self.share_prefix = share_prefix

    def run(self, fn: Callable[[LocalPolicy], object]) -> tuple[object, float]:
        """Call fn with the policy set up for this mode; its result and seconds."""
        saved = self.policy.batch_size, self.policy.decoder
        self.policy.batch_size, self.policy.share_prefix = self.batch, self.share_prefix
        if not self.decoder:
            self.policy.decoder = None
        try:
            started = time.perf_counter()
            out = fn(self.policy)
            return out, time.perf_counter() - started
        finally:
            self.policy.batch_size, self.policy.decoder = saved
            self.policy.share_prefix = True


def generation(modes: list[Mode], requests: dict[str, list[ChatRequest]], sequential_n: int, repeats: int) -> dict:
    """Median tokens/s of each mode on each config's requests, and each mode's completions."""
    rates: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], list[str]] = {}
    work: dict[tuple[str, str], tuple[int, int]] = {}  # decoder modes: (tokens generated, tokens run through)
    for repeat in range(repeats + 1):  # the first pass warms up on a few requests and is not counted
        for name, reqs in requests.items():
            for mode in modes:
                subset = reqs[:sequential_n] if mode.batch == 1 or not repeat else reqs
                stats = mode.policy.decoder.stats if mode.decoder and mode.policy.decoder else None
                before = stats.prefill_tokens + stats.decode_tokens if stats else 0
                out, seconds = mode.run(lambda p, subset=subset: p.generate(subset))
                assert not any(c.error for c in out), [c.error for c in out if c.error][:1]
                texts[(mode.label, name)] = [c.text for c in out]
                generated = sum(c.completion_tokens for c in out)
                if repeat:
                    rates.setdefault((mode.label, name), []).append(generated / seconds)
                    if stats:
                        work[(mode.label, name)] = (generated, stats.prefill_tokens + stats.decode_tokens - before)
    return {"rates": {k: statistics.median(v) for k, v in rates.items()}, "texts": texts, "work": work}


def episodes(modes: list[Mode], env: LifeEnv, hcps: dict[str, HCPConfig], n: int, repeats: int) -> dict:
    """Median whole episodes per second (every step of n dev tasks, batched) and the mean reward, per mode."""
    tasks = env.tasks("dev")[:n]
    result: dict[tuple[str, str], tuple[float, float]] = {}
    for name, hcp in hcps.items():
        for mode in modes:
            rates, reward = [], 0.0
            for _ in range(repeats):
                trajs, seconds = mode.run(lambda p, hcp=hcp: rollout(p, env, hcp, tasks, run_id="bench"))
                rates.append(len(trajs) / seconds)
                reward = sum(t.reward for t in trajs) / len(trajs)
            result[(mode.label, name)] = (statistics.median(rates), reward)
    return result


def grammar_cost(policy: LocalPolicy, n: int, repeats: int) -> dict[str, float]:
    """Decode ms per generated token on the fncall sample's first calls, free and under the tool-call grammar
    (medians of ``repeats`` after a warm-up), and the grammar's own mask-and-advance µs per token."""
    from autoevolve.envs.fncall import SAMPLE, FncallEnv
    from autoevolve.harness.rollout import constraint
    from autoevolve.policy.grammar import Guide

    env = FncallEnv(SAMPLE)
    tasks = [t for s in ("train", "dev", "test") for t in env.tasks(s)][:n]
    free = HCPConfig.from_yaml(ROOT / "prompts/bfcl.yaml")
    constrained = free.model_copy(update={"decoding": free.decoding.model_copy(update={"constrain": "tool_call"})})
    spent = {"mask": 0.0, "tokens": 0}
    mask, take = Guide.mask, Guide.take

    def timed(fn: Callable, count: bool) -> Callable:
        def wrapper(self: Guide, arg: object) -> None:
            started = time.perf_counter()
            fn(self, arg)
            spent["mask"] += time.perf_counter() - started
            spent["tokens"] += count

        return wrapper

    out: dict[str, float] = {}
    for name, hcp in (("free", free), ("grammar", constrained)):
        requests = []
        for task in tasks:
            messages, tools = hcp.render(task)
            limit = hcp.sampling.max_new_tokens
            requests.append(
                ChatRequest(messages=messages, tools=tools, max_new_tokens=limit, constrain=constraint(hcp, task))
            )
        per_token = []
        for repeat in range(repeats + 1):
            stats = policy.decoder.stats
            before = (stats.decode_s, stats.decode_tokens)
            Guide.mask, Guide.take = timed(mask, True), timed(take, False)
            try:
                policy.generate(requests)
            finally:
                Guide.mask, Guide.take = mask, take
            if repeat:
                per_token.append((stats.decode_s - before[0]) * 1e3 / max(stats.decode_tokens - before[1], 1))
        out[f"{name}_ms_per_token"] = statistics.median(per_token)
    out["grammar_us_per_token"] = spent["mask"] * 1e6 / max(spent["tokens"], 1)
    return out


def print_grammar(policy: LocalPolicy, n: int, repeats: int) -> dict[str, float]:
    """The constrained-decoding table."""
    cost = grammar_cost(policy, n, repeats)
    print(f"\nConstrained decoding, {n} fncall first calls, decoder ({str(policy.base.dtype).removeprefix('torch.')}), "
          f"median of {repeats}")  # fmt: skip
    print(f"{'decoding':<12}{'decode ms/token':>16}")
    for name in ("free", "grammar"):
        print(f"{name:<12}{cost[f'{name}_ms_per_token']:>16.2f}")
    ratio = cost["grammar_ms_per_token"] / cost["free_ms_per_token"]
    print(f"grammar / free: {ratio:.2f}x per decoded token (the grammar turns prompt-lookup guessing off); its mask "
          f"and advance alone: {cost['grammar_us_per_token']:.0f} µs per token")  # fmt: skip
    return cost | {"ratio": ratio}


def round_shaped(n: int) -> list[Trajectory]:
    """n trajectories of a round's shape: the life environment's reference conversations over tiers 1-3 (one to
    three tool calls), with the fields a rollout fills."""
    env = LifeEnv(tiers=(1, 2, 3), n_train=256)
    tasks = env.tasks("train")
    references = [env.reference(t) for t in tasks]
    filled = {"run_id": "bench", "split": "train", "hcp_id": "h", "adapter": "L1-life@v1", "stage": "select"}
    filled |= {"reward": 1.0, "feedback": "Booked as asked.", "prompt_tokens": 420, "completion_tokens": 60}
    out = []
    for i in range(n):
        task, messages = tasks[i % len(tasks)], references[i % len(tasks)]
        out.append(Trajectory(task_id=f"{task.id}-{i}", messages=messages, sample=i % 4, **filled))
    return out


def ingest(chunks: int, chunk: int = 64) -> list[tuple[str, float]]:
    """Trajectories/s of each store path writing the same chunks into a growing store, chunk by chunk in turn
    (median over chunks): the bulk path every stage uses, and one INSERT per row."""
    trajs = round_shaped(chunks * chunk)
    paths = (("bulk (Arrow)", "put_trajectories"), ("row inserts", "put_trajectories_rowwise"))
    seconds: dict[str, list[float]] = {label: [] for label, _ in paths}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {label: Store(Path(tmp) / f"{method}.duckdb") for label, method in paths}
        try:
            for start in range(0, len(trajs), chunk):
                for label, method in paths:
                    started = time.perf_counter()
                    getattr(stores[label], method)(trajs[start : start + chunk])
                    seconds[label].append(time.perf_counter() - started)
        finally:
            for store in stores.values():
                store.close()
    return [(f"{label}, {chunks} x {chunk}", chunk / statistics.median(seconds[label])) for label, _ in paths]


def print_ingest(chunks: int) -> dict[str, float]:
    """Print the ingest table; trajectories/s by path."""
    ing = ingest(chunks)
    print("\nDuckDB store ingest")
    print(f"{'path':<30}{'trajectories/s':>16}{'ratio':>10}")
    for label, per_s in ing:
        print(f"{label:<30}{per_s:>16.0f}{per_s / ing[-1][1]:>10.1f}")
    return dict(ing)


def main() -> None:
    """Print the tables and the check of the generation target."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="first calls per config (one batch)")
    parser.add_argument("--sequential", type=int, default=8, help="of them, how many the one-at-a-time mode runs")
    parser.add_argument("--episodes", type=int, default=16, help="dev tasks rolled out whole per mode and config")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32, help="chunks of 64 trajectories written per store path")
    parser.add_argument("--json", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--ingest-only", action="store_true", help="only the store ingest table")
    parser.add_argument("--grammar-only", action="store_true", help="only the constrained-decoding table")
    args = parser.parse_args()
    if args.grammar_only:
        cost = print_grammar(LocalPolicy(batch_size=args.requests), 32, args.repeats)
        if args.json:
            write_json(args.json, {"grammar": cost})
        return
    if args.ingest_only:
        ing = print_ingest(args.chunks)
        if args.json:
            write_json(args.json, {"ingest": ing})
        return
    torch.manual_seed(0)
    env = LifeEnv(tiers=(1,))
    hcps = configs(env)
    fp32 = LocalPolicy(batch_size=args.requests, dtype="float32")
    auto = LocalPolicy(batch_size=args.requests, dtype="auto")
    modes = [
        Mode("sequential", fp32, 1, decoder=False),
        Mode("batched", fp32, args.requests, decoder=False, share_prefix=False),
        Mode("lock-step", fp32, args.requests, decoder=False),
        Mode("decoder fp32", fp32, args.requests, decoder=True),
        Mode(f"decoder auto ({str(auto.base.dtype).removeprefix('torch.')})", auto, args.requests, decoder=True),
    ]
    rate = copy_rate()
    requests = {name: first_calls(env, hcp, args.requests) for name, hcp in hcps.items()}
    gen = generation(modes, requests, args.sequential, args.repeats)
    lock = modes[2].label
    same = {name: all(gen["texts"][(m.label, name)] == gen["texts"][(lock, name)] for m in (modes[1], modes[3]))
            for name in hcps}  # fmt: skip

    flops = {mode.label: gemm_rate(mode.batch, mode.policy.base.dtype) for mode in modes}
    fp32, default = flops[modes[3].label] / 1e9, flops[modes[4].label] / 1e9
    print(f"\nSmolLM2-135M, first calls of {args.requests} dev tasks (sequential: {args.sequential}), greedy, "
          f"median of {args.repeats}; memory copy rate {rate / 1e9:.1f} GB/s; matrix products at {args.requests} "
          f"rows {fp32:.0f} GFLOP/s (fp32), {default:.0f} (default dtype)")  # fmt: skip
    print(f"{'mode':<24}{'config':<10}{'tokens/s':>10}{'vs lock-step':>14}{'memory bound':>14}{'ceiling':>10}"
          f"{'of ceiling':>12}")  # fmt: skip
    table = []
    for mode in modes:
        memory = mode.batch * rate / weight_bytes(mode.policy)
        for name in hcps:
            tps = gen["rates"][(mode.label, name)]
            ratio = tps / gen["rates"][(modes[2].label, name)]
            ceiling = None  # the decoder's own work (prompt and generated tokens) at the measured product rate
            if (mode.label, name) in gen["work"]:
                generated, computed = gen["work"][(mode.label, name)]
                ceiling = generated * flops[mode.label] / (computed * matmul_flops(mode.policy))
            table.append({"mode": mode.label, "config": name, "tokens_s": tps, "ratio": ratio,
                          "memory_bound": memory, "compute_ceiling": ceiling})  # fmt: skip
            shown = f"{ceiling:>10.0f}{tps / ceiling:>12.1%}" if ceiling else f"{'-':>10}{'-':>12}"
            print(f"{mode.label:<24}{name:<10}{tps:>10.1f}{ratio:>13.2f}x{memory:>14.0f}{shown}")
    print(f"batched and decoder fp32 tokens equal lock-step's: {same}")

    eps = episodes(modes[1:], env, hcps, args.episodes, args.repeats)
    print(f"\nWhole episodes ({args.episodes} dev tasks, every step batched), median of {args.repeats}")
    print(f"{'mode':<24}{'config':<10}{'rollouts/s':>12}{'vs lock-step':>14}{'reward':>9}")
    episode_rows = []
    for (label, name), (per_s, reward) in eps.items():
        ratio = per_s / eps[(modes[2].label, name)][0]
        episode_rows.append({"mode": label, "config": name, "rollouts_s": per_s, "ratio": ratio, "reward": reward})
        print(f"{label:<24}{name:<10}{per_s:>12.2f}{ratio:>13.2f}x{reward:>9.3f}")

    ing = print_ingest(args.chunks)
    grammar = print_grammar(auto, 32, args.repeats)

    best = min(row["ratio"] for row in table if row["mode"] == modes[4].label)
    ok = best >= TARGET and all(same.values())
    verdict = "PASS" if ok else "FAIL"
    reach = min(row["compute_ceiling"] / gen["rates"][(modes[2].label, row["config"])]
                for row in table if row["mode"] == modes[4].label)  # fmt: skip
    print(f"\n{verdict}: decoder (default dtype) {best:.2f}x lock-step tokens/s, the lower of the two configs "
          f"(target >= {TARGET:.0f}x); batched and fp32 decoder tokens equal lock-step's: {all(same.values())}; "
          f"its work at the measured product rate alone would be {reach:.2f}x")  # fmt: skip
    if args.json:
        write_json(args.json, {"copy_rate_gbs": rate / 1e9, "gflops": {k: v / 1e9 for k, v in flops.items()},
                               "generation": table, "episodes": episode_rows,
                               "ingest": ing, "grammar": grammar, "same_tokens": same, "pass": ok})  # fmt: skip


if __name__ == "__main__":
    main()
