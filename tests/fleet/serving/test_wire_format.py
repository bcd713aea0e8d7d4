"""The chat-completions wire format the server reads and writes, without a model."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from autoevolve.fleet.serving.calls import caller, cut
from autoevolve.fleet.serving.wire import ChatBody, Reply, WireError, conversation, sse
from autoevolve.records import Message, ToolCall

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"n": 2}, "n: one choice per request is served"),
        ({"logprobs": True}, "logprobs: not served"),
        ({"response_format": {"type": "json_schema"}}, "response_format: only 'text' is served"),
        ({"tool_choice": "maybe"}, "tool_choice: 'maybe' is not none, auto, required or a named function"),
        ({"temperature": 3}, "less than or equal to 2"),
    ],
)
def test_a_body_the_server_cannot_honour_is_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChatBody(model="m", messages=USER, **extra)


def test_unknown_fields_are_ignored_and_limits_read_from_either_name() -> None:
    body = ChatBody(model="m", messages=USER, max_completion_tokens=7, user="u-1", store=False, stop="END")
    assert (body.max_new, body.stops, body.forced_tool()) == (7, ["END"], None)
    named = ChatBody(model="m", messages=USER, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.forced_tool() == "f"
    with pytest.raises(WireError, match="at most 4 sequences"):
        _ = ChatBody(model="m", messages=USER, stop=list("abcde")).stops


def test_messages_become_the_canonical_conversation() -> None:
    raw = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Book "}, {"type": "text", "text": "it"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    history, system = conversation(raw)
    assert system == "Be brief.\n\nUse tools."
    assert [m.role for m in history] == ["user", "assistant", "tool"] and history[0].content == "Book it"
    assert history[1].tool_calls[0].function == {"name": "f", "arguments": '{"x": 1}'}  # an object, sent as JSON
    for bad, why in [
        ([{"role": "tool", "content": "x"}, *USER], "messages\\[0\\].tool_call_id: a tool message needs the id"),
        ([{"role": "robot", "content": "x"}], "messages\\[0\\].role: 'robot' is not system"),
        ([{"role": "system", "content": "x"}], "the conversation needs a user message"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages\\[0\\].content: only text parts"),
    ]:
        with pytest.raises(WireError, match=why):
            conversation(bad)


def test_a_reply_streams_as_chunks_that_join_back_to_it() -> None:
    reply = Reply(model="L1-life@v2", text="Table for two,\nbooked.", prompt_tokens=9, completion_tokens=5)
    chunks = reply.chunks(include_usage=True)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == reply.text and len(chunks) == 1 + 4 + 1 + 1  # role, four words, finish, usage
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["total_tokens"] == 14
    assert {c["id"] for c in chunks} == {reply.id} and {c["model"] for c in chunks} == {"L1-life@v2"}
    call = ToolCall.make("call_1.L1-life", "book_table", {"restaurant_id": "R-1"})
    calls = Reply(model="m", calls=[call], finish_reason="tool_calls")
    body = calls.completion()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    streamed = calls.chunks()
    assert streamed[1]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **call.model_dump()}]
    events = sse(streamed)
    assert events[-1] == "data: [DONE]\n\n" and json.loads(events[0].removeprefix("data: ")) == streamed[0]


def test_stops_cut_the_text_and_call_ids_name_who_called() -> None:
    assert cut("Sure. END more", ["END", "ore"]) == "Sure. "
    assert cut("no stop", []) == "no stop"
    result = Message(role="tool", content="{}", tool_call_id="call_ab12.L1-life")
    assert caller([Message(role="user", content="x"), result]) == "L1-life"
    assert caller([Message(role="user", content="x")]) is None
    assert caller([Message(role="tool", content="{}", tool_call_id="call_1")]) is None  # another server's id
