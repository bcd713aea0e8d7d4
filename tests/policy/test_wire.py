"""What goes on the wire is valid chat completions, as a strict server reads the spec.

The strict server refuses (HTTP 400, as the OpenAI API does) every request the spec refuses: unknown fields, a tool
message that answers no ``tool_calls`` entry of the assistant message before it, an assistant's call left
unanswered, arguments that are not a JSON string. A request it accepts is answered from the environment's
reference conversation of the task, so rollouts run every step (search, book, answer) through it and each later
request carries tool results to be checked.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import Demo, Demos, HCPConfig, format_call
from autoevolve.harness.rollout import apply, rollout
from autoevolve.model import chat_text
from autoevolve.policy import Completion
from autoevolve.policy.openai import OpenAIPolicy
from autoevolve.records import Message, ToolCall
from tests.policy.fake_http import JSONHandler, chat_completion, serving

ROOT = Path(__file__).resolve().parents[2]
ENV = LifeEnv(tiers=(1, 2), n_train=24, n_dev=8, n_test=4)  # the round test's environment, scripted by reference
FORMATS = ["compact", "json", "python", "native"]
BY_REQUEST = {t.request: t for split in ("train", "dev", "test") for t in ENV.tasks(split)}

BODY_KEYS = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "tools"}
BODY_KEYS |= {"tool_choice", "parallel_tool_calls", "n", "stop", "stream", "user", "frequency_penalty"}
MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}


def spec_errors(body: dict[str, Any]) -> list[str]:
    """Why the chat-completions spec refuses a request body (empty when it is valid)."""
    errors = [f"unrecognized request argument: {k}" for k in body if k not in BODY_KEYS]
    messages = body.get("messages")
    if not isinstance(body.get("model"), str) or not isinstance(messages, list) or not messages:
        return errors + ["model must be a string and messages a non-empty list"]
    if not 0 <= body.get("temperature", 1) <= 2 or not 0 <= body.get("top_p", 1) <= 1:
        errors.append("temperature must be in [0, 2] and top_p in [0, 1]")
    for tool in body.get("tools") or []:
        fn = tool.get("function", {})
        if tool.get("type") != "function" or set(tool) - {"type", "function"}:
            errors.append(f"tools: each entry is {{type: function, function: ...}}, got {sorted(tool)}")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(fn.get("name"))) or set(fn) - {
            "name",
            "description",
            "parameters",
            "strict",
        }:
            errors.append(f"tools: bad function entry {sorted(fn)}")
    open_calls: set[str] = set()  # ids of the last assistant's calls not answered yet
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in MESSAGE_KEYS:
            errors.append(f"messages[{i}].role: {role!r} is not a role")
            continue
        errors += [f"messages[{i}]: unrecognized field {k!r}" for k in m if k not in MESSAGE_KEYS[role]]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                errors.append(f"messages[{i}]: a tool message needs a tool_call_id")
            elif m["tool_call_id"] not in open_calls:
                errors.append(
                    f"messages[{i}]: messages with role 'tool' must be a response to a preceding message with "
                    f"'tool_calls' (no open call {m['tool_call_id']!r})"
                )
            open_calls.discard(m.get("tool_call_id"))
            if not isinstance(m.get("content"), str):
                errors.append(f"messages[{i}].content: a tool result is a string")
            continue
        if open_calls:
            errors.append(
                f"messages[{i}]: an assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'; unanswered: {sorted(open_calls)}"
            )
            open_calls = set()
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            if not isinstance(calls, list) or not calls:
                errors.append(f"messages[{i}].tool_calls: a non-empty list or absent")
                continue
            for call in calls:
                fn = call.get("function", {})
                if (
                    set(call) != {"id", "type", "function"}
                    or call["type"] != "function"
                    or set(fn)
                    != {
                        "name",
                        "arguments",
                    }
                ):
                    errors.append(f"messages[{i}].tool_calls: bad entry {json.dumps(call)}")
                elif not isinstance(fn["arguments"], str):
                    errors.append(f"messages[{i}].tool_calls: arguments must be a JSON string")
                open_calls.add(call.get("id"))
        elif not isinstance(m.get("content"), str):
            errors.append(f"messages[{i}].content: expected a string")
    if open_calls:
        errors.append(f"the last assistant message's calls {sorted(open_calls)} were never answered")
    return errors


def _reply(body: dict[str, Any]) -> dict[str, Any]:
    """The task's next reference turn: the task is the last user request the environment knows; its step is the
    number of assistant turns since. Native requests get native tool_calls, text ones the call as text."""
    messages = body["messages"]
    at = max(i for i, m in enumerate(messages) if m["role"] == "user" and _task_of(m["content"]))
    task = _task_of(messages[at]["content"])
    step = sum(m["role"] == "assistant" for m in messages[at:])
    gold = ENV.reference(task.model_copy(update={"split": "train"}))  # the oracle knows every split's answer
    turn = [m for m in gold if m.role == "assistant"][step]
    if not turn.tool_calls:
        return {"role": "assistant", "content": turn.content}
    if body.get("tools"):
        calls = [c.model_dump() | {"id": f"srv_{step}"} for c in turn.tool_calls]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    return {"role": "assistant", "content": format_call(turn.tool_calls[0], "json")}


def _task_of(content: str):  # noqa: ANN202
    """The task whose request a user message ends with (memory may come before it), else None."""
    return next((t for request, t in BY_REQUEST.items() if content.endswith(request)), None)


class Strict:
    """What the strict server saw: accepted bodies and refusals (status 400, the spec's reason)."""

    def __init__(self) -> None:
        self.accepted: list[dict] = []
        self.refused: list[tuple[dict, list[str]]] = []
        self.lock = threading.Lock()


@pytest.fixture(scope="module")
def strict():
    """A ThreadingHTTPServer that refuses invalid chat completions and answers valid ones by reference."""
    state = Strict()

    class Handler(JSONHandler):
        def do_POST(self) -> None:
            body = self.read_json()
            errors = spec_errors(body)
            with state.lock:
                (state.refused.append((body, errors)) if errors else state.accepted.append(body))
            if errors:
                error = {"message": "; ".join(errors), "type": "invalid_request_error", "param": "messages"}
                return self._send(400, {"error": error})
            self._send(200, chat_completion(body["model"], _reply(body), 9, 4))

    with serving(Handler) as url:
        yield url, state


def _config(tool_format: str, result_role: str = "tool") -> HCPConfig:
    """The life config in a tool format, with three full tier-2 reference demos (tool results in every prompt)."""
    original = HCPConfig.from_yaml(ROOT / "prompts" / "life.yaml")
    refs = [t for t in ENV.tasks("train") if t.tier == 2][:3]
    demos = Demos(items=[Demo(task_id=t.id, messages=ENV.reference(t)) for t in refs], style="full")
    scaffold = original.scaffold.model_copy(update={"tool_result_role": result_role})
    return original.model_copy(update={"tool_format": tool_format, "demos": demos, "scaffold": scaffold})


def test_the_strict_server_refuses_a_tool_result_that_answers_no_call() -> None:
    old_text_rendering = [
        {"role": "user", "content": "Book R-7."},
        {"role": "assistant", "content": 'book_table(restaurant_id="R-7")'},
        {"role": "tool", "content": '{"ok": true}'},
    ]
    assert spec_errors({"model": "m", "messages": old_text_rendering}) == [
        "messages[2]: a tool message needs a tool_call_id"
    ]
    dict_arguments = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    unanswered = [{"role": "assistant", "content": "", "tool_calls": dict_arguments}, {"role": "user", "content": "?"}]
    errors = spec_errors({"model": "m", "messages": unanswered, "cache_key": "k"})
    assert errors[0] == "unrecognized request argument: cache_key"
    assert "arguments must be a JSON string" in errors[1] and "responding to each 'tool_call_id'" in errors[2]


@pytest.mark.parametrize("result_role", ["tool", "user"])
@pytest.mark.parametrize("tool_format", FORMATS)
def test_every_step_of_a_rollout_is_valid_on_the_wire(strict, tool_format: str, result_role: str) -> None:
    url, state = strict
    before, refused = len(state.accepted), len(state.refused)
    tasks = [t for t in ENV.tasks("dev") if t.tier == 2][:3]
    policy = OpenAIPolicy("base-model", url, max_retries=0, timeout_s=10)
    trajs = rollout(policy, ENV, _config(tool_format, result_role), tasks, run_id="wire")
    assert [t.error for t in trajs] == ["", "", ""] and [t.reward for t in trajs] == [1.0, 1.0, 1.0]
    assert [errors for _, errors in state.refused[refused:]] == []
    sent = state.accepted[before:]
    assert len(sent) == 9  # search, book, answer for each task
    roles = {m["role"] for body in sent for m in body["messages"]}
    assert ("tool" in roles) == (tool_format == "native" or result_role == "tool")


@pytest.mark.parametrize("tool_format", FORMATS)
def test_a_whole_round_runs_through_the_strict_server(tmp_path, prefect_harness, strict, tool_format: str) -> None:
    from autoevolve_flows.round import round_flow

    url, state = strict
    before, refused = len(state.accepted), len(state.refused)
    hcp = tmp_path / "hcp.yaml"
    hcp.write_text(
        HCPConfig.from_yaml(ROOT / "prompts" / "life.yaml").model_copy(update={"tool_format": tool_format}).to_yaml()
    )
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_id: wire\nhcp: {hcp}\nstore: {tmp_path}/s.duckdb\nrun_dir: {tmp_path}/runs\n"
        f"model: {{name: base-model, backend: openai, openai: {{base_url: '{url}', max_retries: 0}}}}\n"
        "env: {tiers: [1, 2], n_train: 24, n_dev: 8, n_test: 4}\n"
        "evolve: {train_tasks: 4, dev_tasks: 4, candidates: 1, mutators: [demos], demo_styles: [full]}\n"
        "select: {train_tasks: 4}\n"
    )
    from autoevolve.config import load_config

    report = round_flow(load_config(path))
    assert [errors for _, errors in state.refused[refused:]] == []
    assert report["failed_rollouts"] == 0 and report["rollouts"] > 0
    sent = state.accepted[before:]
    with_results = [b for b in sent if any(m["role"] == "tool" for m in b["messages"])]
    assert len(with_results) >= len(sent) // 2  # every step after the first carries a tool result


def test_parallel_native_calls_each_get_their_own_result_in_order() -> None:
    hcp = HCPConfig.from_yaml(ROOT / "prompts" / "life.yaml").model_copy(update={"tool_format": "native"})
    task = ENV.tasks("dev")[0]
    calls = [
        ToolCall.make("srv_a", "search_restaurants", {"city": "Lisbon"}),
        ToolCall.make("srv_b", "search_restaurants", {"city": "Porto", "cuisine": "Italian"}),
    ]
    messages = [Message(role="user", content=task.request)]
    done, error = apply(Completion(tool_calls=calls), hcp, task, ENV.start(task), messages, call_id="call_1")
    assert (done, error) == (False, "")
    said, first, second = messages[1:]
    assert [c.id for c in said.tool_calls] == ["call_1", "call_1_2"]
    assert [c.arguments["city"] for c in said.tool_calls] == ["Lisbon", "Porto"]
    assert (first.tool_call_id, second.tool_call_id) == ("call_1", "call_1_2")
    fresh = ENV.start(task)
    assert [first.content, second.content] == [fresh.call(c.name, c.arguments) for c in calls]  # in order
    wire, _ = hcp.render(task, messages)
    assert spec_errors({"model": "m", "messages": wire}) == []


def test_a_bad_native_call_answered_with_its_error_stays_on_spec() -> None:
    hcp = HCPConfig.from_yaml(ROOT / "prompts" / "life.yaml").model_copy(update={"tool_format": "native"})
    task = ENV.tasks("dev")[0]
    bad = [ToolCall.make("srv_a", "search_restaurants", {"town": "Lisbon"})]
    messages = [Message(role="user", content=task.request)]
    done, error = apply(Completion(tool_calls=bad), hcp, task, ENV.start(task), messages, retry=True)
    assert (done, error) == (False, "")
    said, told = messages[1:]
    # No call ran, so the reply goes back as the text of the call, not as a tool_calls entry a tool message must answer.
    assert said.tool_calls == [] and json.loads(said.content) == {
        "name": "search_restaurants",
        "arguments": '{"town": "Lisbon"}',
    }
    assert "missing required argument(s) city" in said.call_error and told.role == "user" and "city" in told.content
    wire, _ = hcp.render(task, messages)
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "user"] and "tool_calls" not in wire[2]
    assert spec_errors({"model": "m", "messages": wire}) == []


def test_chat_templates_get_arguments_as_dicts(tokenizer) -> None:
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }} {{ c.function.arguments | tojson }}\n{% endfor %}{% endfor %}"
    )
    call = ToolCall.make("call_1", "book_table", {"restaurant_id": "R-1", "party_size": 2})
    messages = [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}]
    saved, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        text = chat_text(tokenizer, messages, None, generation_prompt=False)
    finally:
        tokenizer.chat_template = saved
    assert json.loads(text.split(" ", 1)[1]) == {"restaurant_id": "R-1", "party_size": 2}  # a dict, not encoded twice
    assert isinstance(messages[0]["tool_calls"][0]["function"]["arguments"], str)  # the wire message is untouched
