"""HCP config: content id, render, demos retrieval, YAML round trip, diff."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import Demo, Demos, HCPConfig, diff, render_tools
from autoevolve.records import Message, Task, ToolCall


def test_id_is_content_hash_and_ignores_name(original: HCPConfig) -> None:
    renamed = original.model_copy(update={"name": "other"})
    changed = original.model_copy(update={"routing": "Send code questions to L2-code."})
    assert renamed.id == original.id
    assert changed.id != original.id and len(changed.id) == 12


def test_yaml_round_trip(original: HCPConfig, tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(original.to_yaml())
    assert HCPConfig.from_yaml(path) == original


def test_unknown_component_is_an_error(original: HCPConfig) -> None:
    body = original.model_dump() | {"system_promt": "typo"}
    with pytest.raises(ValidationError, match="system_promt"):
        HCPConfig.model_validate(body)


def test_render_fills_tools_memory_and_request(env: LifeEnv, original: HCPConfig) -> None:
    task = env.tasks("train")[0]
    messages, tools = original.render(task)
    assert tools is None  # tools are listed in the prompt, not passed natively
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "- book_table(restaurant_id, party_size, time):" in messages[0]["content"]
    assert f"The user is {task.metadata['user']}." in messages[0]["content"]
    assert "{tools}" not in messages[0]["content"] and messages[1]["content"] == task.request


def test_render_writes_calls_in_the_call_syntax(env: LifeEnv, original: HCPConfig) -> None:
    task = env.tasks("train")[0]
    call = ToolCall.make("call_1", "book_table", {"restaurant_id": "R-101", "party_size": 2, "time": "19:00"})
    history = [
        Message(role="user", content=task.request),
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", content='{"ok": true}', tool_call_id="call_1"),
    ]
    as_json = original.render(task, history)[0]
    as_python = original.model_copy(update={"call_syntax": "python"}).render(task, history)[0]
    assert (
        as_json[2]["content"]
        == '{"name": "book_table", "arguments": {"restaurant_id": "R-101", "party_size": 2, "time": "19:00"}}'
    )
    assert as_python[2]["content"] == 'book_table(restaurant_id="R-101", party_size=2, time="19:00")'
    assert as_json[3] == {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'}
    assert as_json[2]["tool_calls"] == [call.model_dump()]  # the call the tool message answers, by id (the spec)
    as_user = original.model_copy(
        update={"scaffold": original.scaffold.model_copy(update={"tool_result_role": "user"})}
    )
    assert as_user.render(task, history)[0][2:] == [
        {"role": "assistant", "content": as_json[2]["content"]},
        {"role": "user", "content": 'Tool result: {"ok": true}'},
    ]
    native = original.model_copy(update={"tool_format": "native"}).render(task, history)
    assert native[1] is not None and native[0][2]["tool_calls"][0]["function"]["name"] == "book_table"


def test_nearest_demos_skip_the_task_itself_and_end_with_the_closest(env: LifeEnv, original: HCPConfig) -> None:
    tasks = env.tasks("train")[:12]
    demos = [Demo(task_id=t.id, messages=env.reference(t)) for t in tasks]
    config = original.model_copy(update={"demos": Demos(items=demos, select="nearest", k=2)})
    chosen = config.demos.for_task(tasks[0])
    assert len(chosen) == 2 and tasks[0].id not in {d.task_id for d in chosen}
    messages, _ = config.render(tasks[3])
    assert messages[-1]["content"] == tasks[3].request
    short = config.model_copy(update={"demos": config.demos.model_copy(update={"style": "first_call"})})
    assert len(short.render(tasks[3])[0]) == 2 + 2 * 2  # system, 2 demos x (request, call), request
    assert len(messages) > len(short.render(tasks[3])[0])


def test_demos_can_be_retrieved_by_function_schema(original: HCPConfig) -> None:
    """With match request_and_tools a task's tool and parameter names count: the demo calling the same function wins
    even when another demo's request shares more words."""

    def tool(name: str, *params: str) -> dict:
        props = {p: {"type": "string"} for p in params}
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}

    def demo(task_id: str, request: str, name: str, **args: str) -> Demo:
        call = ToolCall.make("c1", name, args)
        return Demo(
            task_id=task_id,
            messages=[Message(role="user", content=request), Message(role="assistant", tool_calls=[call])],
        )

    task = Task(id="t", env="fncall", split="dev", tier=1, request="What is the weather like in Paris today?",
                tools=[tool("weather_forecast", "city", "day")])  # fmt: skip
    demos = [
        demo("a", "How many people live in Paris?", "city_population", city="Paris"),
        demo("b", "Will it rain in Rome?", "weather_forecast", city="Rome", day="today"),
    ]
    by_request = Demos(items=demos, select="nearest", k=1)
    assert [d.task_id for d in by_request.for_task(task)] == ["a"]
    by_schema = by_request.model_copy(update={"match": "request_and_tools"})
    assert [d.task_id for d in by_schema.for_task(task)] == ["b"]
    with_match = original.model_copy(update={"demos": by_schema})
    assert with_match.id != original.model_copy(update={"demos": by_request}).id


def test_tool_renderings_differ(original: HCPConfig) -> None:
    shown = {f: render_tools(original.tools, f) for f in ("json", "python", "compact")}
    assert '"name":"book_table"' in shown["json"]
    assert "def book_table(restaurant_id: str, party_size: int, time: str):" in shown["python"]
    assert len(shown["compact"]) < len(shown["json"])


def test_diff_names_changed_components_only(original: HCPConfig) -> None:
    child = original.model_copy(update={"tool_format": "python", "call_syntax": "python"})
    text = diff(original, child)
    assert f"{original.id}/tool_format" in text and "+tool_format: python" in text
    assert "call_syntax" in text and "system_prompt" not in text
    assert diff(original, original) == ""
