"""Stage 1 (our evolve) vs GEPA's optimize, side by side in one run: same split, models and rollout budget.

Both search around prompts/life.yaml on life tier 1 with one SmolLM2-135M LocalPolicy as the policy and as the
reflection model. GEPA evolves the system prompt through its reflective loop; ours searches every HCP component
with demos, tool_format, reflective, scaffold and merge. Each row reports the best config's dev score, its test
score, the rollouts used, the rollouts spent when a dev score of at least GEPA's final one was first known (that
candidate's dev scoring included, for both), the best config's mean first-prompt tokens on test, and wall seconds.

Run: HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false .venv/bin/python bench/evolution_vs_gepa.py [--budget 160]
(about 20 minutes on 2 CPU cores at the defaults; --budget 80 about half that.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gepa
from _shared import write_json
from gepa.core.adapter import EvaluationBatch
from gepa.core.result import GEPAResult

from autoevolve.config import BudgetSettings, EvolveSettings, ReflectionSettings
from autoevolve.envs.life import LifeEnv
from autoevolve.evolve import EvolveResult, evolve, make_mutators, train_tasks
from autoevolve.hcp import COMPONENTS, HCPConfig
from autoevolve.policy import ChatRequest
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Message, Task, Trajectory
from autoevolve.store import Store
from autoevolve.workbench import Workbench, mean

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = ("{tools}", "{call_format}", "{memory}")  # those prompts/life.yaml's system prompt uses


@dataclass
class Outcome:
    """One system's numbers."""

    system: str
    best_dev: float
    test: float
    prompt_tokens: float  # mean first-prompt tokens of the best config on the test tasks
    rollouts: int
    reached: int | None  # rollouts spent when GEPA's final dev score was first reached; None: never
    seconds: float
    best_id: str


class LifeAdapter:
    """GEPA adapter: a candidate's system prompt on the original config, rolled out through a Workbench."""

    propose_new_texts = None  # GEPA reads this attribute: None selects its own reflective proposer

    def __init__(self, bench: Workbench, original: HCPConfig) -> None:
        self.bench, self.original = bench, original

    def config(self, candidate: Mapping[str, str]) -> HCPConfig:
        """The original config with the candidate's system prompt."""
        return self.original.model_copy(update={"system_prompt": candidate["system_prompt"]})

    def evaluate(
        self, batch: list[Task], candidate: dict[str, str], capture_traces: bool = False
    ) -> EvaluationBatch[Trajectory, Trajectory]:
        """Rewards of the tasks under the candidate; a batch that breaks scores 0 with the error kept."""
        hcp = self.config(candidate)
        try:
            trajs = self.bench.rollouts(hcp, batch, stage="gepa")
        except Exception as exc:  # noqa: BLE001 - failures are data: GEPA gets zeros, not an exception
            trajs = [_broken(self.bench.run_id, hcp.id, t, f"{type(exc).__name__}: {exc}") for t in batch]
        return EvaluationBatch(
            outputs=trajs, scores=[t.reward for t in trajs], trajectories=trajs if capture_traces else None
        )

    def make_reflective_dataset(
        self, candidate: dict[str, str], eval_batch: EvaluationBatch, components_to_update: list[str]
    ) -> dict[str, list[dict[str, Any]]]:
        """Per component: the request, what the assistant did, and the env's feedback with the reward."""
        records = [
            {
                "Inputs": t.messages[0].content,
                "Generated Outputs": _turns(t.messages[1:]) or "(nothing)",
                "Feedback": f"Score {t.reward:.2f}. {t.feedback or 'The task was fully solved.'}"
                + (f" Error: {t.error}" if t.error else ""),
            }
            for t in eval_batch.trajectories or []
        ]
        return {name: records for name in components_to_update}


def _broken(run_id: str, hcp_id: str, task: Task, error: str) -> Trajectory:
    """A rollout that broke: reward 0 and the reason."""
    request = Message(role="user", content=task.request)
    return Trajectory(
        run_id=run_id, task_id=task.id, split=task.split, hcp_id=hcp_id, messages=[request], reward=0.0, error=error
    )


def _turns(messages: list[Message]) -> str:
    """The assistant's turns, its calls and the tool results as text."""
    lines = []
    for m in messages:
        for c in m.tool_calls:
            lines.append(f"Assistant called {c.name}({json.dumps(c.arguments)})")
        if m.content:
            lines.append(f"{'Tool result' if m.role == 'tool' else m.role.capitalize()}: {m.content}")
    return "\n".join(lines)


def reflection_lm(policy: LocalPolicy, max_new_tokens: int, replies: list[str]) -> Callable[[Any], str]:
    """GEPA's reflection model: one sampled chat request to the policy per prompt; replies are kept."""

    def call(prompt: str | list[dict[str, Any]]) -> str:
        """The policy's reply to a prompt (a string, or chat messages)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        request = ChatRequest(messages=messages, temperature=0.7, max_new_tokens=max_new_tokens, seed=len(replies))
        [reply] = policy.generate([request])
        replies.append(reply.text if not reply.error else "")
        return replies[-1]

    return call


def test_score(bench: Workbench, hcp: HCPConfig, test: list[Task]) -> tuple[float, float]:
    """Mean test reward and mean first-prompt tokens of a config (base model, no adapter)."""
    trajs = bench.rollouts(hcp, test, stage="report")
    return mean([t.reward for t in trajs]), mean([float(t.prompt_tokens) for t in trajs])


def run_ours(
    bench: Workbench, original: HCPConfig, args: argparse.Namespace, split: dict[str, list[Task]]
) -> EvolveResult:
    """Our stage 1 with settings after configs/quickstart.yaml; the budget is what stops it."""
    settings = EvolveSettings(
        train_tasks=args.train,
        minibatch=args.minibatch,
        dev_tasks=args.dev,
        candidates=10_000,
        mutators=["demos", "tool_format", "reflective", "scaffold", "merge"],
        demo_pool=16,
        demo_k=[2],
        demo_styles=["first_call"],
        max_prompt_tokens=700,
        budget=BudgetSettings(rollouts=args.budget),
        reflection=ReflectionSettings(temperature=0.7, max_new_tokens=args.reflect_tokens),
    )
    ops = make_mutators(settings, reflector=bench.policy)
    return evolve(bench, original, settings, train=split["train"], dev=split["dev"], mutators=ops)


def run_gepa(
    adapter: LifeAdapter,
    original: HCPConfig,
    args: argparse.Namespace,
    split: dict[str, list[Task]],
    replies: list[str],
) -> GEPAResult:
    """GEPA's optimize over the system prompt, with its defaults but our minibatch size and budget."""
    return gepa.optimize(
        seed_candidate={"system_prompt": original.system_prompt},
        trainset=split["train"],
        valset=split["dev"],
        adapter=adapter,
        reflection_lm=reflection_lm(adapter.bench.policy, args.reflect_tokens, replies),
        reflection_minibatch_size=args.minibatch,
        max_metric_calls=args.budget,
        seed=args.seed,
    )


def compare(args: argparse.Namespace) -> tuple[list[Outcome], dict[str, Any]]:
    """Run both searches on one policy and store, score their best configs on test; the rows and notes."""
    env = LifeEnv(tiers=(1,), n_train=256, n_dev=64, n_test=96)  # the quickstart's split sizes
    split = {"train": train_tasks(env, args.train, args.seed), "dev": env.tasks("dev")[: args.dev]}
    test = env.tasks("test")[: args.test]
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    policy = LocalPolicy(batch_size=64)
    replies: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "bench.duckdb") as store:
        adapter = LifeAdapter(Workbench(policy, env, store, "bench-gepa", seed=args.seed, progress=None), original)
        started = time.perf_counter()
        found = run_gepa(adapter, original, args, split, replies)
        gepa_seconds = time.perf_counter() - started
        bench = Workbench(policy, env, store, "bench-ours", seed=args.seed, progress=None)
        started = time.perf_counter()
        ours = run_ours(bench, original, args, split)
        ours_seconds = time.perf_counter() - started
        gepa_best, gepa_dev = adapter.config(found.best_candidate), found.val_aggregate_scores[found.best_idx]
        kept = [c for c in ours.candidates if c.status == "keep"]
        reached = [c.rollouts_used for c in kept if c.mean_reward >= gepa_dev - 1e-9]
        # GEPA's discovery count is taken before a candidate's dev scoring, ours after it: add the dev tasks.
        gepa_reached = found.discovery_eval_counts[found.best_idx] + len(split["dev"])
        rows = [
            Outcome(
                "ours (evolve)", ours.best_dev, *test_score(bench, ours.best, test),
                ours.budget["rollouts"], min(reached, default=None), ours_seconds, ours.best.id,
            ),
            Outcome(
                "GEPA optimize", gepa_dev, *test_score(adapter.bench, gepa_best, test),
                found.total_metric_calls or 0, gepa_reached, gepa_seconds, gepa_best.id,
            ),
        ]  # fmt: skip
    notes = summary(ours, found, replies)
    return rows, notes


def summary(ours: EvolveResult, found: GEPAResult, replies: list[str]) -> dict[str, Any]:
    """What each search did: ours by mutator and status, GEPA's candidates and what its reflection replies kept."""
    changed = [c for c in COMPONENTS if getattr(ours.best, c) != getattr(ours.original, c)]
    by_op: dict[str, dict[str, int]] = {}
    for c in ours.candidates:
        by_op.setdefault(c.mutator, {}).setdefault(c.status, 0)
        by_op[c.mutator][c.status] += 1
    return {
        "ours: ledger by mutator": by_op,
        "ours: stop": ours.budget["stop"],
        "ours: best config's changed components": changed,
        "ours: reflective notes": [c.note for c in ours.candidates if c.mutator == "reflective"],
        "gepa: candidates' dev scores": [round(s, 3) for s in found.val_aggregate_scores],
        "gepa: reflection replies": len(replies),
        "gepa: replies with a ``` block": sum("```" in r for r in replies),
        "gepa: replies keeping every placeholder": sum(all(p in r for p in PLACEHOLDERS) for r in replies),
        "gepa: first reply": _clip(replies[0]) if replies else "",
        "gepa: best system prompt": _clip(found.best_candidate["system_prompt"]),
    }


def _clip(text: str, limit: int = 300) -> str:
    """One line of at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def main() -> None:
    """Parse the flags, compare, print the table and notes, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=160, help="Rollouts each search may spend.")
    parser.add_argument("--train", type=int, default=24, help="Train tasks (minibatches are drawn from them).")
    parser.add_argument("--dev", type=int, default=16, help="Dev tasks every kept candidate is scored on.")
    parser.add_argument("--test", type=int, default=32, help="Test tasks the best configs are scored on.")
    parser.add_argument("--minibatch", type=int, default=4, help="Train tasks per proposal, both systems.")
    parser.add_argument("--reflect-tokens", type=int, default=256, help="Max new tokens of a reflection reply.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/evolution_vs_gepa.json"))
    args = parser.parse_args()
    rows, notes = compare(args)
    print(f"\nlife tier 1, SmolLM2-135M as policy and reflection model, gepa {version('gepa')}, budget {args.budget}")
    print(f"train {args.train}, dev {args.dev}, test {args.test}, minibatch {args.minibatch}, seed {args.seed}\n")
    print("| system | best dev | test of best | rollouts used | rollouts to reach GEPA's dev | prompt tok | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        reach = "never" if r.reached is None else r.reached
        print(
            f"| {r.system} | {r.best_dev:.3f} | {r.test:.3f} | {r.rollouts} | {reach} | {r.prompt_tokens:.0f} "
            f"| {r.seconds:.0f} |"
        )
    print("\n" + "\n".join(f"- {k}: {v}" for k, v in notes.items()))
    report = {"gepa": version("gepa"), "args": vars(args) | {"out": str(args.out)}, "rows": [asdict(r) for r in rows]}
    write_json(args.out, report | {"notes": notes})


if __name__ == "__main__":
    main()
