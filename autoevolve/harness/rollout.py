"""The rollout engine: run the tool loop for a batch of tasks under one HCP config and one adapter.

All episodes advance in lock step so every model call of a step is one batched request. A failure of any kind
(backend error, unparseable call, unknown tool, bad arguments, step limit) ends that episode with reward 0 and
the reason; it never aborts the batch. Under ``scaffold.retry_bad_calls`` a bad call is instead answered with its
error (a user message) up to that many times per episode, and the model writes the call again.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from autoevolve.envs import Environment, Episode, guard
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.toolcall import PARALLEL_CALLS, CallError, check_arguments, parse, parse_all
from autoevolve.policy import CallConstraint, ChatRequest, Completion, Policy
from autoevolve.records import Message, Task, ToolCall, Trajectory

ENDPOINT_ERROR = "backend error: "  # how a rollout that failed at the policy endpoint begins its error
BAD_CALL_REPLY = "That call could not be run: {error}. Write the tool call again, corrected."


@dataclass
class _Run:
    """One episode in flight."""

    task: Task
    sample: int
    episode: Episode
    messages: list[Message]
    error: str = ""
    done: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    steps: int = 0


def rollout(
    policy: Policy,
    env: Environment,
    hcp: HCPConfig,
    tasks: list[Task],
    *,
    run_id: str,
    adapter: str = "",
    samples: int = 1,
    stage: str = "evolve",
    round: int = 0,
    seed: int = 0,
    first_sample: int = 0,
) -> list[Trajectory]:
    """Roll out every task ``samples`` times (sample indices from ``first_sample``); one trajectory per (task,
    sample), in input order."""
    runs = [
        _Run(task=t, sample=s, episode=guard.start(env, t), messages=[Message(role="user", content=t.request)])
        for t in tasks
        for s in range(first_sample, first_sample + samples)
    ]
    cache_key = uuid.uuid4().hex  # this batch's episodes may reuse each other's computed prompts, nothing else
    for step in range(hcp.scaffold.max_steps):
        active = [r for r in runs if not r.done]
        if not active:
            break
        # Each sample of a task decodes with its own seed so samples differ when temperature > 0.
        requests = [model_call(hcp, r.task, r.messages, (seed + step) * 1000 + r.sample, cache_key) for r in active]
        completions = policy.generate(requests, adapter or None)
        for r, completion in zip(active, completions, strict=True):
            _advance(r, completion, hcp)
    for r in runs:
        if not r.done:
            r.error = f"step limit: no final reply after {hcp.scaffold.max_steps} model calls"
    return [_finish(r, hcp, run_id, adapter, stage, round) for r in runs]


def score_reply(env: Environment, hcp: HCPConfig, task: Task, text: str) -> float:
    """The environment's reward for an episode of one reply: its tool call run (else the final answer), then scored."""
    episode, messages = guard.start(env, task), [Message(role="user", content=task.request)]
    _, error = apply(Completion(text=text), hcp, task, episode, messages)
    return 0.0 if error else episode.score(messages)[0]


def model_call(
    hcp: HCPConfig, task: Task, history: list[Message], seed: int, cache_key: str | None = None
) -> ChatRequest:
    """The next model call of an episode under the config: rendered, sampled and constrained as it says."""
    messages, tools = hcp.render(task, history)
    s = hcp.sampling
    return ChatRequest(
        messages=messages,
        tools=tools,
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        seed=seed,
        constrain=constraint(hcp, task),
        cache_key=cache_key,
    )


def constraint(hcp: HCPConfig, task: Task) -> CallConstraint | None:
    """The tool-call constraint of a task's replies under ``decoding.constrain: tool_call`` (None when off); calls
    through native tools are constrained as JSON call objects."""
    if hcp.decoding.constrain != "tool_call":
        return None
    return CallConstraint(
        tools=hcp.tools_for(task),
        syntax="json" if hcp.tool_format == "native" else hcp.call_syntax,
        parallel=bool(task.metadata.get(PARALLEL_CALLS)),
        plan_line=hcp.scaffold.plan_first,
    )


def _advance(run: _Run, completion: Completion, hcp: HCPConfig) -> None:
    """Apply one model reply to an episode in flight and count its tokens and time."""
    run.steps += 1
    run.prompt_tokens = run.prompt_tokens or completion.prompt_tokens
    run.completion_tokens += completion.completion_tokens
    run.latency_s += completion.latency_s
    retry = sum(m.call_error is not None for m in run.messages) < hcp.scaffold.retry_bad_calls
    run.done, run.error = apply(
        completion, hcp, run.task, run.episode, run.messages, call_id=f"call_{run.steps}", retry=retry
    )


def apply(
    completion: Completion,
    hcp: HCPConfig,
    task: Task,
    episode: Episode,
    messages: list[Message],
    call_id: str = "call_1",
    adapter: str | None = None,
    retry: bool = False,
) -> tuple[bool, str]:
    """Apply one model reply: run its tool calls, or take it as the final answer, or say why it failed.

    Appends the reply (and one tool result per call, in order) to ``messages``, the assistant message tagged with
    ``adapter`` when given; returns (done, error): done once the episode needs no further model call, error '' unless
    it failed. A reply may hold several native calls (parallel calls); a text reply is read for its first call, or
    for all its calls when the task allows parallel calls (``Task.metadata[PARALLEL_CALLS]``).
    With ``retry`` a call that cannot be run is kept as the text the model wrote, marked with its ``call_error``, and
    answered by a user message with the error (no tool message: no call ran); the episode goes on.
    """
    if completion.error:
        return True, f"{ENDPOINT_ERROR}{completion.error}"
    try:
        calls = calls_in(completion, hcp, task)
        if not calls:
            messages.append(Message(role="assistant", content=completion.text.strip(), adapter=adapter))
            return True, ""
        tools = hcp.tools_for(task)
        tool_calls = []
        for i, (name, arguments) in enumerate(calls):
            spec = next((t for t in tools if t["function"]["name"] == name), None)
            if spec is None:
                raise CallError(f"unknown tool {name!r} (known: {', '.join(_names(tools))})")
            # The first call keeps the step's id (stored conversations read the same); more get a suffix.
            tool_calls.append(
                ToolCall.make(call_id if i == 0 else f"{call_id}_{i + 1}", name, check_arguments(spec, arguments))
            )
        messages.append(Message(role="assistant", content="", tool_calls=tool_calls, adapter=adapter))
        for call in tool_calls:
            messages.append(Message(role="tool", content=episode.call(call.name, call.arguments), tool_call_id=call.id))
        return episode.finished, ""  # e.g. a function-calling question ends with its expected calls
    except CallError as exc:
        if not retry:
            messages.append(Message(role="assistant", content=completion.text, adapter=adapter))
            return True, str(exc)
        written = _as_written(completion)
        messages.append(Message(role="assistant", content=written, adapter=adapter, call_error=str(exc)))
        messages.append(Message(role="user", content=BAD_CALL_REPLY.format(error=exc)))
        return False, ""
    except KeyError as exc:  # the environment does not know the tool
        return True, f"unknown tool: {exc}"


def calls_in(completion: Completion, hcp: HCPConfig, task: Task) -> list[tuple[str, dict]]:
    """The tool calls in a completion: the native ones if the backend parsed any, else the first parsed from text
    (all of them on a task that allows parallel calls)."""
    if completion.tool_calls:
        calls = []
        for call in completion.tool_calls:
            try:
                calls.append((call.name, call.arguments))
            except ValueError as exc:
                raise CallError(f"arguments of {call.name!r} are not valid JSON: {exc}") from None
        return calls
    names = _names(hcp.tools_for(task))
    if task.metadata.get(PARALLEL_CALLS):
        return parse_all(completion.text, names)
    call = parse(completion.text, names)
    return [call] if call else []


def _as_written(completion: Completion) -> str:
    """A reply's text, or its native calls written out as JSON when it has no text (an assistant turn needs one)."""
    if completion.text.strip() or not completion.tool_calls:
        return completion.text
    calls = completion.tool_calls
    return "\n".join(json.dumps({"name": c.name, "arguments": c.function.get("arguments", "")}) for c in calls)


def _names(tools: list[dict]) -> list[str]:
    """Function names of tool specs."""
    return [t["function"]["name"] for t in tools]


def _finish(run: _Run, hcp: HCPConfig, run_id: str, adapter: str, stage: str, round: int) -> Trajectory:
    """Score an episode (0 with the reason when it failed) and make its trajectory."""
    if run.error:
        reward, feedback = 0.0, f"The rollout failed: {run.error}."
    else:
        reward, feedback = run.episode.score(run.messages)
    return Trajectory(
        run_id=run_id,
        task_id=run.task.id,
        split=run.task.split,
        tier=run.task.tier,
        hcp_id=hcp.id,
        adapter=adapter,
        sample=run.sample,
        round=round,
        stage=stage,
        messages=run.messages,
        reward=reward,
        feedback=feedback,
        error=run.error,
        prompt_tokens=run.prompt_tokens,
        completion_tokens=run.completion_tokens,
        latency_s=round_latency(run.latency_s),
    )


def round_latency(seconds: float) -> float:
    """Latency to the millisecond: stored rows stay readable."""
    return float(f"{seconds:.3f}")
