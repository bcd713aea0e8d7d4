"""KV reuse across a LoRA switch: how the expert the router chose takes the turn over, side by side.

SmolLM2-135M serves two experts on one copy of the weights: L0-chat (the entry: the router harness with four
routing demos, an untrained adapter) and L1-life (LoRA SFT on 16 tier-1 references under the life environment's
original harness). Each life test task is sent to the router as a user would send it (model ``router``, the life
tools, the task's metadata), the bench playing the client that runs the tool calls; the three ways the chosen
expert takes the turn over (``Fleet.switch``) run on the same tasks in turn:

- ``own``: the expert renders the conversation under its own harness (the tokens it was trained on), computed anew
  under its adapter;
- ``shared``: it continues the entry expert's context (the router harness, the routing call), computed anew;
- ``shared_kv``: it continues that context from the keys and values the entry expert's adapter computed, so only the
  routing result is prefilled.

Printed per switch: tasks routed to L1-life, the life score with its 95% interval and the paired difference from
``own``, and the expert's first call after the switch: prompt tokens computed and reused, prefill seconds and the whole
call's (medians). PASS when ``shared_kv`` computes fewer tokens than ``shared`` at the switch and prefills faster;
the score columns say what it costs, for a user to choose.

    python bench/router_kv.py [--tasks 16] [--out bench/results/router_kv.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench._shared import paired_gain, write_json  # noqa: E402

SWITCHES = ("own", "shared", "shared_kv")


def experts(work: Path) -> Path:
    """A registry with L0-chat (router harness, demos, untrained adapter) and L1-life (SFT on references)."""
    from autoevolve.config import load_config
    from autoevolve.envs.life import LifeEnv
    from autoevolve.envs.routing import EXPERTS, RouterEnv
    from autoevolve.fleet.registry import add_expert, promote, register, write_harness
    from autoevolve.harness.hcp import Demo, Demos, HCPConfig
    from autoevolve.model import EMBEDDED, base_model_id
    from autoevolve.stages.distill.dataset import native_tools
    from autoevolve.stages.distill.sft import train_sft
    from autoevolve.store import Store
    from tests.fleet.test_router import _fresh_adapter

    base = base_model_id(EMBEDDED)
    router_env, life = RouterEnv(), LifeEnv(tiers=(1,))
    shown = [t for t in router_env.tasks("train") if t.goal["expert"] != "L2-code"][:4]
    demos = Demos(items=[Demo(task_id=t.id, messages=router_env.reference(t)) for t in shown], style="first_call")
    router = HCPConfig.from_yaml(ROOT / "prompts/router.yaml").model_copy(update={"demos": demos})
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    train = life.tasks("train")[:16]
    examples = [original.render(t, life.reference(t))[0] for t in train]
    settings = load_config(ROOT / "configs/quickstart.yaml").distill
    started = time.perf_counter()
    trained = train_sft(examples, EMBEDDED, work / "L1-life", settings, tools=native_tools(original))
    print(f"L1-life: SFT on {len(examples)} references, {trained.steps} steps, {time.perf_counter() - started:.0f} s")
    folders = {"L0-chat": (_fresh_adapter(work / "L0-chat", 0), router), "L1-life": (trained.path, original)}
    with Store(work / "registry.duckdb") as store:
        for e in EXPERTS[:2]:
            path, hcp = folders[e.name]
            add_expert(store, e.name, base, e.tier, e.routing_rule)
            write_harness(path, hcp)
            record = register(
                store,
                name=e.name,
                path=path,
                base_model=base,
                parent_version=None,
                run_id="bench",
                round=0,
                hcp_id=hcp.id,
                evolved_hcp_id=hcp.id,
                selection_id="",
            )
            promote(store, e.name, record.version)
    return work / "registry.duckdb"


class Calls:
    """Every generate call of the policy: its adapter, seconds, and the decoder's prompt tokens computed and reused."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.rows, self._generate = policy, [], policy.generate
        policy.generate = self._wrapped

    def _wrapped(self, requests: list[Any], adapter: str | None = None) -> list[Any]:
        stats = self.policy.decoder.stats
        before, started = (stats.prefill_tokens, stats.reused_tokens, stats.prefill_s), time.perf_counter()
        out = self._generate(requests, adapter)
        computed, reused, prefill_s = stats.prefill_tokens, stats.reused_tokens, stats.prefill_s
        self.rows.append(
            {
                "adapter": adapter or "",
                "seconds": time.perf_counter() - started,
                "prefill_s": prefill_s - before[2],
                "computed": computed - before[0],
                "reused": reused - before[1],
            }
        )
        return out


def converse(fleet: Any, task: Any, env: Any, tools: list[dict], calls: Calls) -> dict[str, Any]:
    """One routed conversation, the bench running the tool calls: the score, the answering expert, and the expert's
    first call after the switch."""
    from autoevolve.fleet.serving.wire import ChatBody, WireError, conversation

    episode, messages = env.start(task), [{"role": "user", "content": task.request}]
    first_model, switch, error = "", None, ""
    for step in range(4):
        mark = len(calls.rows)
        try:
            reply = fleet.reply(
                ChatBody(model="router", messages=messages, tools=tools, metadata=task.metadata, temperature=0)
            )
        except WireError as exc:
            error = str(exc)
            break
        if step == 0:
            first_model = reply.model
            switch = next((r for r in calls.rows[mark:] if r["adapter"].startswith("L1-life")), None)
        messages.append(reply.message())
        if not reply.calls:
            break
        for c in reply.calls:
            try:
                result = episode.call(c.name, c.arguments)
            except KeyError:
                error = f"unknown tool {c.name}"
                break
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        if error or episode.finished:
            break
    score = 0.0 if error else episode.score(conversation(messages)[0])[0]
    return {"score": score, "model": first_model, "switch": switch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16, help="life tier-1 test tasks (default 16)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/router_kv.json"))
    args = parser.parse_args()

    from autoevolve.envs.life import LifeEnv
    from autoevolve.fleet.serving.startup import open_fleet
    from autoevolve.harness.hcp import HCPConfig
    from autoevolve.model import EMBEDDED
    from autoevolve.policy.local import LocalPolicy

    work = Path(tempfile.mkdtemp(prefix="router-kv-"))
    store = experts(work)
    policy = LocalPolicy(EMBEDDED, batch_size=16)
    fleet = open_fleet(store, policy, say=lambda _: None)
    calls = Calls(policy)
    env = LifeEnv(tiers=(1,))
    tools = HCPConfig.from_yaml(ROOT / "prompts/life.yaml").tools
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SWITCHES}
    tasks = env.tasks("test")[: args.tasks]
    for i, task in enumerate(tasks):
        for s in SWITCHES:  # in turn on each task: the machine's drift falls on every switch alike
            fleet.switch = s
            results[s].append(converse(fleet, task, env, tools, calls))
        print(f"\r{i + 1}/{len(tasks)} tasks", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    rows = []
    own = [r["score"] for r in results["own"]]
    for s in SWITCHES:
        scores = [r["score"] for r in results[s]]
        switched = [r["switch"] for r in results[s] if r["switch"]]
        gain, ci = paired_gain(scores, own)
        rows.append(
            {
                "switch": s,
                "routed": sum(r["model"].startswith("L1-life") for r in results[s]),
                "score": statistics.fmean(scores),
                "vs_own": gain,
                "vs_own_ci": list(ci),
                "switch_computed": statistics.median(r["computed"] for r in switched) if switched else None,
                "switch_reused": statistics.median(r["reused"] for r in switched) if switched else None,
                "switch_prefill_s": statistics.median(r["prefill_s"] for r in switched) if switched else None,
                "switch_s": statistics.median(r["seconds"] for r in switched) if switched else None,
            }
        )
    print(f"\n{len(tasks)} life tier-1 test tasks through the router; the expert's first call after the switch:\n")
    head = f"{'switch':<11}{'routed':>7}{'score':>7}{'vs own [95% CI]':>26}"
    print(f"{head}{'computed':>10}{'reused':>8}{'prefill s':>10}{'call s':>8}")
    for r in rows:
        ci = f"{r['vs_own']:+.3f} [{r['vs_own_ci'][0]:+.3f}, {r['vs_own_ci'][1]:+.3f}]"
        print(
            f"{r['switch']:<11}{r['routed']:>7}{r['score']:>7.3f}{ci:>26}{_num(r['switch_computed']):>10}"
            f"{_num(r['switch_reused']):>8}{_num(r['switch_prefill_s'], '.3f'):>10}{_num(r['switch_s'], '.2f'):>8}"
        )
    by = {r["switch"]: r for r in rows}
    shared, reused = by["shared"], by["shared_kv"]
    ok = None not in (shared["switch_prefill_s"], reused["switch_prefill_s"])
    ok = ok and reused["switch_computed"] < shared["switch_computed"]
    ok = ok and reused["switch_prefill_s"] < shared["switch_prefill_s"]
    ratio = shared["switch_prefill_s"] / reused["switch_prefill_s"] if reused["switch_prefill_s"] else float("nan")
    print(
        f"\n{'PASS' if ok else 'FAIL'}: shared_kv computes {_num(reused['switch_computed'])} prompt tokens at the "
        f"switch against {_num(shared['switch_computed'])} re-prefilled, its prefill {ratio:.1f}x faster; its score "
        f"{reused['score']:.3f} against {shared['score']:.3f} (shared) and {by['own']['score']:.3f} (own)"
    )
    write_json(Path(args.out), {"tasks": len(tasks), "rows": rows})


def _num(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
