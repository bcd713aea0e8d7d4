"""Stage 1 beside GEPA and DSPy over seeds: the same split, model, labelled references and rollout budget for each.

Every system searches around prompts/life.yaml on life tier 1 with one SmolLM2-135M LocalPolicy, which is also the
optimiser model of every system that asks one (reflection, instruction proposals). Per seed the train tasks are
another subset; dev and test stay fixed. The harness is the same for all: a candidate's system prompt and demo pool
go into the HCP config, and each task is shown its 2 nearest demos (request and first call), as ours does. A
candidate whose system prompt drops one of the original's placeholders is refused before any rollout, for every
system. The budget unit is a rollout, each (config, task) a search asks for counted once, as our search counts it
(so a re-run that finds them stored counts the same); once a system has spent its budget, further rollouts it asks
for score 0 without running, so no system overshoots.

Systems (the `inputs` line of each row in the JSON says what it had):
- ours: stage 1 with demos, tool_format, reflective, scaffold and merge; references top up the demo pool. It stops
  on the budget or after 8 children in a row without a better dev score (--patience).
- ours-no-demos: the ablation, reflective, tool_format, scaffold and merge; no references.
- gepa: GEPA's optimize over two components, the system prompt and the demo pool (a YAML list of train task ids),
  seeded with 16 references as demos; references in every feedback record; our placeholder rule in its reflection
  template; evaluation cache and merge on; the same patience as ours (iterations in a row without a better dev
  score).
- dspy-bootstrap: DSPy's BootstrapFewShotWithRandomSearch; references as labelled demos, bootstrapped demos from
  the model's own full-reward rollouts.
- dspy-mipro: DSPy's MIPROv2 (instructions proposed by the same model, demos as above), full dev set per trial.
  DSPy's proposers read their answers through a ChatAdapter whose one-field replies are taken whole when the model
  leaves out DSPy's field markers (it always does); without that MIPROv2 stops at its first proposal.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/optimisers.py [--seeds 0 1 2] [--budget 160]   (make bench-optimisers)
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import dspy
import gepa
import yaml
from _shared import ROOT, paired_gain, write_json
from dspy.lm15 import Message as LMMessage
from dspy.lm15 import Response, TextPart, Usage, response_to_events
from gepa.core.adapter import EvaluationBatch
from pydantic import ValidationError

from autoevolve.config import BudgetSettings, EvolveSettings, ReflectionSettings
from autoevolve.envs.life import LifeEnv
from autoevolve.evaluate import bootstrap_ci
from autoevolve.evolve import evolve, make_mutators, train_tasks
from autoevolve.evolve.reflect import PLACEHOLDERS, format_examples
from autoevolve.hcp import Demo, Demos, HCPConfig
from autoevolve.policy import ChatRequest
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Message, Task, Trajectory, without_failed_calls
from autoevolve.store import Store
from autoevolve.workbench import Workbench, mean

SYSTEMS = ("ours", "ours-no-demos", "gepa", "dspy-bootstrap", "dspy-mipro")
INPUTS = {
    "ours": "references (topping up the demo pool), rewards, feedback; edits every HCP component",
    "ours-no-demos": "rewards, feedback, no references; edits prompt, tool rendering, scaffold, sampling",
    "gepa": "references (seed demo pool and in each feedback record), rewards, feedback, placeholder rule; "
    "edits the system prompt and the demo pool",
    "dspy-bootstrap": "references (labelled demos), rewards as its metric; picks the demo pool",
    "dspy-mipro": "references (labelled demos), rewards as its metric; proposes the instruction, picks demos",
}
DEMO_POOL = 16


@dataclass
class Row:
    """One system's numbers on one seed."""

    seed: int
    system: str
    best_dev: float
    test: float
    test_ci: tuple[float, float]
    rollouts: int
    seconds: float
    best_id: str
    changed: list[str]  # components of the best config that differ from the original
    test_rewards: list[float]


class Metered:
    """A Workbench with a hard rollout budget, counted as our search counts it: each (config, task) the search asks
    for costs one rollout the first time (whether or not the store already held it); past the budget, new ones score
    0 without running."""

    def __init__(self, bench: Workbench, budget: int) -> None:
        self.bench, self.budget, self.seen = bench, budget, set()

    @property
    def spent(self) -> int:
        """Rollouts charged so far."""
        return len(self.seen)

    def rollouts(self, hcp: HCPConfig, tasks: list[Task], stage: str) -> list[Trajectory]:
        """Rewards of ``tasks`` under ``hcp``: ones charged before free, new ones while the budget lasts."""
        new = [t.id for t in tasks if (hcp.id, t.id) not in self.seen]
        self.seen |= {(hcp.id, i) for i in new[: max(self.budget - self.spent, 0)]}
        run = [t for t in tasks if (hcp.id, t.id) in self.seen]
        made = {t.task_id: t for t in self.bench.rollouts(hcp, run, stage=stage)} if run else {}
        return [made.get(t.id) or broken(self.bench.run_id, hcp.id, t, "over budget") for t in tasks]


def broken(run_id: str, hcp_id: str, task: Task, error: str) -> Trajectory:
    """A rollout that did not run: reward 0 and the reason."""
    request = Message(role="user", content=task.request)
    return Trajectory(
        run_id=run_id, task_id=task.id, split=task.split, hcp_id=hcp_id, messages=[request], reward=0.0, error=error
    )


def candidate_config(original: HCPConfig, prompt: str, demos: list[Demo]) -> HCPConfig:
    """The original config with a system prompt and a demo pool; ValueError when the prompt breaks the rules."""
    lost = [p for p in PLACEHOLDERS if p in original.system_prompt and p not in prompt]
    if lost:
        raise ValueError(f"the system prompt drops the placeholder {lost[0]}")
    unique = list({d.task_id: d for d in demos}.values())
    pool = Demos(items=unique, select="nearest", k=2, style="first_call") if unique else Demos()
    try:
        return HCPConfig.model_validate(original.model_dump() | {"system_prompt": prompt, "demos": pool.model_dump()})
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from None


def reference_demos(env: LifeEnv, tasks: list[Task]) -> list[Demo]:
    """The labelled solutions of ``tasks`` as demos."""
    return [Demo(task_id=t.id, messages=m) for t in tasks if (m := env.reference(t))]


def chat(policy: LocalPolicy, messages: list[dict[str, Any]], temperature: float, max_tokens: int, seed: int) -> str:
    """The policy's reply to one chat request ('' when it failed)."""
    request = ChatRequest(messages=messages, temperature=temperature, max_new_tokens=max_tokens, seed=seed)
    [reply] = policy.generate([request])
    return "" if reply.error else reply.text


# --- ours ---------------------------------------------------------------------------------------------------------


def run_ours(
    bench: Workbench, original: HCPConfig, split: dict[str, list[Task]], args, demos: bool
) -> tuple[HCPConfig, int]:
    """Our stage 1 with the quickstart's settings; the budget is what stops it."""
    mutators = ["demos", "tool_format", "reflective", "scaffold", "merge"]
    settings = EvolveSettings(
        train_tasks=len(split["train"]),
        minibatch=args.minibatch,
        dev_tasks=len(split["dev"]),
        candidates=10_000,
        mutators=mutators if demos else mutators[1:],
        references=demos,
        demo_pool=DEMO_POOL,
        demo_k=[2],
        demo_styles=["first_call"],
        max_prompt_tokens=700,
        budget=BudgetSettings(rollouts=args.budget, patience=args.patience),
        reflection=ReflectionSettings(temperature=0.7, max_new_tokens=args.reflect_tokens),
    )
    ops = make_mutators(settings, reflector=bench.policy)
    found = evolve(bench, original, settings, train=split["train"], dev=split["dev"], mutators=ops)
    return found.best, found.budget["rollouts"]


# --- GEPA ---------------------------------------------------------------------------------------------------------

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


# --- DSPy ---------------------------------------------------------------------------------------------------------


class PolicyEngine:
    """A DSPy engine over the in-process policy: one chat request per call."""

    def __init__(self, policy: LocalPolicy, max_tokens: int) -> None:
        self.policy, self.max_tokens, self.calls = policy, max_tokens, 0

    def complete(self, request: Any) -> Response:
        """The policy's reply to a DSPy request."""
        messages = []
        if request.system is not None:
            system = request.system if isinstance(request.system, str) else "".join(p.text for p in request.system)
            messages.append({"role": "system", "content": system})
        messages += [
            {"role": "user" if m.role == "developer" else m.role, "content": m.text or ""} for m in request.messages
        ]
        config = request.config
        self.calls += 1
        text = chat(
            self.policy,
            messages,
            config.temperature or 0.0,
            min(config.max_tokens or self.max_tokens, self.max_tokens),
            self.calls,
        )
        usage = Usage(input_tokens=0, output_tokens=0)
        return Response(
            id=None, model="local", message=LMMessage.assistant([TextPart(text)]), finish_reason="stop", usage=usage
        )

    def stream(self, request: Any):
        return response_to_events(self.complete(request))

    def close(self) -> None:
        pass


class PlainReplyAdapter(dspy.ChatAdapter):
    """DSPy's ChatAdapter, except that a reply to a one-output signature without the field markers is taken whole,
    as our reflective mutator takes a reply (a 135M model never writes the markers, and DSPy would stop)."""

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        """The fields of a reply; the whole reply as the only output field when the markers are missing."""
        try:
            return super().parse(signature, completion)
        except dspy.utils.exceptions.AdapterParseError:
            if len(signature.output_fields) != 1:
                raise
            return {next(iter(signature.output_fields)): completion.strip()}


@dataclass
class Harness:
    """What a DSPy agent step needs; module-level, so DSPy's deep copies of programs never copy the policy."""

    meter: Metered
    original: HCPConfig
    tasks: dict[str, Task]
    dev_ids: set[str]


HARNESS: Harness | None = None


class HarnessPredict(dspy.Predict):
    """A DSPy predictor whose step is one whole episode in our harness: its instructions are the system prompt,
    its demos the demo pool; the output is the transcript and the reward."""

    def forward(self, **kwargs: Any) -> dspy.Prediction:
        _, _, signature, demos, inputs = self._forward_preprocess(**kwargs)
        h = HARNESS
        task = h.tasks[inputs["task_id"]]
        pool = demo_pool(demos)
        try:
            hcp = candidate_config(h.original, signature.instructions, pool)
        except ValueError as exc:
            traj = broken(h.meter.bench.run_id, "refused", task, str(exc))
        else:
            batch = [h.tasks[i] for i in sorted(h.dev_ids)] if task.id in h.dev_ids else [task]
            traj = {t.task_id: t for t in h.meter.rollouts(hcp, batch, stage="dspy")}[task.id]
        messages = [m.model_dump(mode="json") for m in without_failed_calls(traj.messages)]
        completion = {"transcript": json.dumps(messages), "reward": traj.reward}
        return self._forward_postprocess([completion], signature, **inputs)


def demo_pool(demos: list[Any]) -> list[Demo]:
    """A DSPy predictor's demos (labelled or bootstrapped examples carrying a transcript) as our demos."""
    return [Demo(task_id=d["task_id"], messages=json.loads(d["transcript"])) for d in demos if d.get("transcript")]


class Agent(dspy.Module):
    """The DSPy program: one harness step."""

    def __init__(self, instructions: str) -> None:
        super().__init__()
        signature = dspy.Signature("task_id, request -> transcript, reward", instructions)
        self.act = HarnessPredict(signature)

    def forward(self, task_id: str, request: str) -> dspy.Prediction:
        return self.act(task_id=task_id, request=request)


def reward_metric(example: dspy.Example, pred: dspy.Prediction, trace: Any = None) -> float | bool:
    """The episode's reward; when bootstrapping demos (a trace), only a full-reward episode counts."""
    reward = float(pred.reward)
    return reward >= 1.0 if trace is not None else reward


def dspy_examples(env: LifeEnv, tasks: list[Task], labelled: bool) -> list[dspy.Example]:
    """Tasks as DSPy examples; with ``labelled``, each carries its reference transcript (a labelled demo)."""
    out = []
    for t in tasks:
        solution = env.reference(t) if labelled else None
        transcript = json.dumps([m.model_dump(mode="json") for m in solution]) if solution else ""
        out.append(
            dspy.Example(task_id=t.id, request=t.request, transcript=transcript).with_inputs("task_id", "request")
        )
    return out


def run_dspy(
    meter: Metered, original: HCPConfig, env: LifeEnv, split: dict[str, list[Task]], args, optimiser: str
) -> HCPConfig:
    """One DSPy optimiser over the agent program; the best program's instructions and demos as an HCP config."""
    global HARNESS
    tasks = {t.id: t for t in split["train"] + split["dev"]}
    HARNESS = Harness(meter, original, tasks, {t.id for t in split["dev"]})
    lm = dspy.LM("local/smollm2-135m", engine=PolicyEngine(meter.bench.policy, args.reflect_tokens), cache=False)
    train = dspy_examples(env, split["train"], labelled=True)
    dev = dspy_examples(env, split["dev"], labelled=False)
    with dspy.context(lm=lm, adapter=PlainReplyAdapter(use_json_adapter_fallback=False)):
        if optimiser == "dspy-bootstrap":
            # 3 fixed programs (zero-shot, labelled only, unshuffled bootstrap) + n random ones, a dev pass each
            n = max(args.budget // len(dev) - 4, 1)
            teleprompter = dspy.BootstrapFewShotWithRandomSearch(
                metric=reward_metric, max_bootstrapped_demos=4, max_labeled_demos=DEMO_POOL,
                num_candidate_programs=n, num_threads=1,
            )  # fmt: skip
            best = teleprompter.compile(Agent(original.system_prompt), trainset=train, valset=dev)
        else:
            teleprompter = dspy.MIPROv2(
                metric=reward_metric, auto=None, num_candidates=4, max_bootstrapped_demos=4,
                max_labeled_demos=DEMO_POOL, num_threads=1, seed=args.seed_now, verbose=False,
            )  # fmt: skip
            trials = max(args.budget // len(dev) - 2, 1)
            best = teleprompter.compile(
                Agent(original.system_prompt), trainset=train, valset=dev, num_trials=trials, minibatch=False,
                requires_permission_to_run=False,
            )  # fmt: skip
    predictor = best.act
    pool = demo_pool(predictor.demos)
    return candidate_config(original, predictor.signature.instructions, pool)


# --- the comparison -----------------------------------------------------------------------------------------------


def search(system: str, bench: Workbench, original: HCPConfig, env: LifeEnv, split, args) -> tuple[HCPConfig, int]:
    """One system's best config and the rollouts its search was charged."""
    if system in ("ours", "ours-no-demos"):
        return run_ours(bench, original, split, args, demos=system == "ours")
    meter = Metered(bench, args.budget)
    if system == "gepa":
        best = run_gepa(meter, original, env, split, args)
    else:
        best = run_dspy(meter, original, env, split, args, system)
    return best, meter.spent


def dev_score(store: Store, run_id: str, hcp: HCPConfig, dev: list[Task]) -> float:
    """Mean dev reward of a config from the rollouts its search stored (0 for a task it never ran)."""
    got = {
        t.task_id: t.reward for t in store.trajectories(run_id, hcp_id=hcp.id, adapter="", task_ids=[t.id for t in dev])
    }
    return mean([got.get(t.id, 0.0) for t in dev])


def compare(args: argparse.Namespace) -> list[Row]:
    """Every system on every seed, in one process and one store; test scores under one shared run."""
    env = LifeEnv(tiers=(1,), n_train=256, n_dev=64, n_test=96)  # the quickstart's split sizes
    original = HCPConfig.from_yaml(ROOT / "prompts/life.yaml")
    dev, test = env.tasks("dev")[: args.dev], env.tasks("test")[: args.test]
    policy = LocalPolicy(batch_size=64)
    before = original.model_dump()
    rows = finished_rows(args)
    for r in rows:
        print(table_line(r), "(from the last run)", flush=True)
    with Store(args.store) as store:
        tester = Workbench(policy, env, store, "test", seed=0, progress=None)
        for seed in args.seeds:
            args.seed_now = seed
            split = {"train": train_tasks(env, args.train, seed), "dev": dev}
            for system in args.systems:
                if any((r.seed, r.system) == (seed, system) for r in rows):
                    continue
                run_id = f"s{seed}-{system}"
                bench = Workbench(policy, env, store, run_id, seed=seed, progress=None)
                started = time.perf_counter()
                best, spent = search(system, bench, original, env, split, args)
                seconds = time.perf_counter() - started
                rewards = [t.reward for t in tester.rollouts(best, test, stage="report")]
                changed = [k for k, v in best.model_dump().items() if v != before[k]]
                rows.append(
                    Row(seed, system, dev_score(store, run_id, best, dev), mean(rewards), bootstrap_ci(rewards), spent,
                        seconds, best.id, changed, rewards)
                )  # fmt: skip
                print(table_line(rows[-1]), flush=True)
                save(args, rows, complete=False)  # a stopped run keeps every row it finished
    return rows


SAME = ("budget", "patience", "train", "dev", "test", "minibatch", "reflect_tokens")  # flags a finished row must share


def finished_rows(args: argparse.Namespace) -> list[Row]:
    """Rows the JSON at ``args.out`` already holds for these flags (a stopped run goes on where it stopped)."""
    if not args.out.exists():
        return []
    last = json.loads(args.out.read_text())
    if any(last["args"].get(k) != str(getattr(args, k)) for k in SAME):
        return []
    rows = [Row(**{**r, "test_ci": tuple(r["test_ci"])}) for r in last["rows"]]
    return [r for r in rows if r.seed in args.seeds and r.system in args.systems]


def table_line(r: Row) -> str:
    """One row of the per-seed table."""
    ci = f"[{r.test_ci[0]:.2f}, {r.test_ci[1]:.2f}]"
    return (
        f"| {r.seed} | {r.system} | {r.best_dev:.3f} | {r.test:.3f} {ci} | {r.rollouts} | {r.seconds:.0f} "
        f"| {', '.join(r.changed) or '-'} |"
    )


def over_seeds(rows: list[Row], systems: list[str]) -> list[dict[str, Any]]:
    """Per system: mean test over seeds, its spread, and the paired difference to ours over every (seed, task)."""
    out = []
    for system in systems:
        mine = [r for r in rows if r.system == system]
        ours = {r.seed: r.test_rewards for r in rows if r.system == "ours"}
        paired = [r for r in mine if r.seed in ours]
        pairs = [(a, b) for r in paired for a, b in zip(ours[r.seed], r.test_rewards, strict=True)]
        lead = paired_gain([a for a, _ in pairs], [b for _, b in pairs]) if pairs else (None, None)
        tests = [r.test for r in mine]
        out.append(
            {
                "system": system,
                "inputs": INPUTS[system],
                "test_mean": mean(tests),
                "test_min": min(tests),
                "test_max": max(tests),
                "rollouts_mean": mean([float(r.rollouts) for r in mine]),
                "ours_minus_this": lead[0],
                "ours_minus_this_ci": lead[1],
            }
        )
    return out


def main() -> None:
    """Parse the flags, compare, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="Each seed: another train subset.")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--budget", type=int, default=160, help="Rollouts each search may generate.")
    parser.add_argument(
        "--patience",
        type=int,
        default=8,
        help="Ours stops after this many children in a row without a better dev "
        "score (a repeated or broken proposal counts): without it, a search that can only repeat itself never ends.",
    )
    parser.add_argument("--train", type=int, default=24, help="Train tasks (minibatches and demos come from them).")
    parser.add_argument("--dev", type=int, default=16, help="Dev tasks candidates are scored on.")
    parser.add_argument("--test", type=int, default=48, help="Test tasks the best configs are scored on.")
    parser.add_argument("--minibatch", type=int, default=4, help="Train tasks per proposal (ours, GEPA).")
    parser.add_argument("--reflect-tokens", type=int, default=256, help="Max new tokens of an optimiser reply.")
    parser.add_argument("--store", type=Path, default=Path("/tmp/optimisers.duckdb"), help="Re-runs reuse it.")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/optimisers.json")
    args = parser.parse_args()
    logging.getLogger("dspy").setLevel(logging.WARNING)
    print("| seed | system | best dev | test [95% CI] | rollouts | wall s | changed components |")
    print("| ---: | --- | ---: | --- | ---: | ---: | --- |")
    rows = compare(args)
    summary = over_seeds(rows, args.systems)
    print(f"\nOver seeds {args.seeds} ({args.test} test tasks each; budget {args.budget} rollouts):\n")
    print("| system | test mean (min-max) | rollouts | ours - this [95% CI] | inputs |")
    print("| --- | --- | ---: | --- | --- |")
    for s in summary:
        lead = (
            "-"
            if s["system"] == "ours" or s["ours_minus_this"] is None
            else (f"{s['ours_minus_this']:+.3f} [{s['ours_minus_this_ci'][0]:+.3f}, {s['ours_minus_this_ci'][1]:+.3f}]")
        )
        print(
            f"| {s['system']} | {s['test_mean']:.3f} ({s['test_min']:.3f}-{s['test_max']:.3f}) "
            f"| {s['rollouts_mean']:.0f} | {lead} | {s['inputs']} |"
        )
    save(args, rows, complete=True)


def save(args: argparse.Namespace, rows: list[Row], complete: bool) -> None:
    """The JSON: versions, flags, the summary over seeds and every row; ``complete`` false while seeds remain."""
    versions = {p: version(p) for p in ("gepa", "dspy")}
    flags = {k: str(v) for k, v in vars(args).items() if k != "seed_now"}
    summary = over_seeds(rows, [s for s in args.systems if any(r.system == s for r in rows)])
    report = {"versions": versions, "args": flags, "complete": complete, "summary": summary}
    write_json(args.out, report | {"rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
