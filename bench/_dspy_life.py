"""DSPy on the life harness, for bench/optimisers.py: an in-process engine over the policy, an adapter that takes a
one-field reply whole, and a predictor whose step is one whole episode (instructions = system prompt, demos = the
demo pool)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import dspy
from _search_harness import DEMO_POOL, Metered, broken, candidate_config, chat
from dspy.lm15 import Message as LMMessage
from dspy.lm15 import Response, TextPart, Usage, response_to_events

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import Demo, HCPConfig
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Task, without_failed_calls


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
