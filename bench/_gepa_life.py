"""GEPA on the life harness, for bench/optimisers.py: candidates {system_prompt, demos} on the original config,
references in every feedback record, our placeholder rule in its reflection template, our patience as a stopper."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import gepa
import yaml
from _search_harness import DEMO_POOL, Metered, broken, candidate_config, chat, reference_demos
from gepa.core.adapter import EvaluationBatch

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import Task, Trajectory
from autoevolve.stages.evolve.reflect import PLACEHOLDERS, format_examples

RULE = (
    "\n\nThe instruction is a template: keep each of these placeholders exactly as written, the harness fills them "
    "in: {placeholders}. Keep it short."
)
DEMOS_TEMPLATE = """The assistant is shown solved examples of these train tasks (a YAML list of task ids):
```
<curr_param>
```

Here are tasks it attempted with that list, its responses, feedback and a correct solution of each:
```
<side_info>
```

Write a new YAML list of train task ids whose solved examples should be shown, chosen from: {ids}.
Provide the list within ``` blocks."""


SOLVED = {"reward": 1.0, "feedback": "", "error": ""}  # how a reference solution reads in a feedback record


class GepaLife:
    """GEPA adapter: candidates {system_prompt, demos} on the original config, rolled out through the meter."""

    propose_new_texts = None  # GEPA reads this attribute: None selects its own reflective proposer

    def __init__(self, meter: Metered, original: HCPConfig, env: LifeEnv, train: list[Task]) -> None:
        self.meter, self.original, self.env = meter, original, env
        self.tasks = {t.id: t for t in train}
        self.solutions = {d.task_id: d for d in reference_demos(env, train)}

    def config(self, candidate: Mapping[str, str]) -> HCPConfig:
        """The candidate as an HCP config; ValueError when it breaks a rule or its demo list does not parse."""
        try:
            ids = yaml.safe_load(candidate["demos"]) or []
        except yaml.YAMLError:
            raise ValueError("the demo list is not YAML") from None
        if not isinstance(ids, list):
            raise ValueError("the demo list is not a list")
        demos = [self.solutions[str(i)] for i in ids if str(i) in self.solutions]
        return candidate_config(self.original, candidate["system_prompt"], demos)

    def evaluate(
        self, batch: list[Task], candidate: dict[str, str], capture_traces: bool = False
    ) -> EvaluationBatch[Trajectory, Trajectory]:
        """Rewards of the tasks under the candidate; a candidate that breaks the rules scores 0 without rollouts."""
        try:
            hcp = self.config(candidate)
            trajs = self.meter.rollouts(hcp, batch, stage="gepa")
        except ValueError as exc:
            trajs = [broken(self.meter.bench.run_id, "refused", t, str(exc)) for t in batch]
        return EvaluationBatch(
            outputs=trajs, scores=[t.reward for t in trajs], trajectories=trajs if capture_traces else None
        )

    def make_reflective_dataset(
        self, candidate: dict[str, str], eval_batch: EvaluationBatch, components_to_update: list[str]
    ) -> dict[str, list[dict[str, Any]]]:
        """Per component: the request, what the assistant did, feedback with the reward, and the reference."""
        records = []
        for t in eval_batch.trajectories or []:
            solution = self.env.reference(self.tasks[t.task_id])
            records.append(
                {
                    "Inputs": t.messages[0].content,
                    "Generated Outputs": format_examples([t]),
                    "Feedback": f"Score {t.reward:.2f}. {t.feedback or 'The task was fully solved.'}"
                    + (f" Error: {t.error}" if t.error else ""),
                    "Correct solution": format_examples([t.model_copy(update=dict(messages=solution or [], **SOLVED))]),
                }
            )
        return {name: records for name in components_to_update}


class Patience:
    """A GEPA stopper with our search's patience: stop after ``n`` iterations in a row (proposals, broken ones
    included) that did not raise the best dev score."""

    def __init__(self, n: int) -> None:
        self.n, self.best, self.iteration, self.since = n, -1.0, None, 0

    def __call__(self, state: Any) -> bool:
        """True once ``n`` iterations passed without a better best dev score."""
        best = max(state.get_program_average_val_subset(i)[0] for i in range(len(state.program_candidates)))
        if best > self.best:
            self.best, self.since = best, 0
        elif state.i != self.iteration:
            self.since += 1
        self.iteration = state.i
        return self.since >= self.n


def gepa_templates(original: HCPConfig, train: list[Task]) -> dict[str, str]:
    """GEPA's own reflection template with our placeholder rule, and one for the demo list."""
    from gepa.strategies.instruction_proposal import InstructionProposalSignature

    kept = ", ".join(p for p in PLACEHOLDERS if p in original.system_prompt)
    return {
        "system_prompt": InstructionProposalSignature.default_prompt_template + RULE.replace("{placeholders}", kept),
        "demos": DEMOS_TEMPLATE.replace("{ids}", ", ".join(t.id for t in train)),
    }


def run_gepa(meter: Metered, original: HCPConfig, env: LifeEnv, split: dict[str, list[Task]], args) -> HCPConfig:
    """GEPA's optimize from the original prompt and 16 references as demos, stopped by the rollout meter."""
    adapter = GepaLife(meter, original, env, split["train"])
    pool = random.Random(args.seed_now).sample(sorted(adapter.solutions), min(DEMO_POOL, len(adapter.solutions)))
    policy = meter.bench.policy
    calls = [0]

    def reflect(prompt: str | list[dict[str, Any]]) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        calls[0] += 1
        return chat(policy, messages, 0.7, args.reflect_tokens, seed=calls[0])

    found = gepa.optimize(
        seed_candidate={"system_prompt": original.system_prompt, "demos": yaml.safe_dump(sorted(pool))},
        trainset=split["train"],
        valset=split["dev"],
        adapter=adapter,
        reflection_lm=reflect,
        reflection_minibatch_size=args.minibatch,
        reflection_prompt_template=gepa_templates(original, split["train"]),
        use_merge=True,
        cache_evaluation=True,
        max_metric_calls=10 * args.budget,  # the meter's refusals count as calls too
        stop_callbacks=[lambda state: meter.spent >= meter.budget, Patience(args.patience)],
        seed=args.seed_now,
    )
    return adapter.config(found.best_candidate)
