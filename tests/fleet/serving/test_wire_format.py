"""The chat-completions wire format the server reads and writes, without a model."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from autoevolve.fleet.serving.calls import cut
from autoevolve.fleet.serving.live import Live
from autoevolve.fleet.serving.wire import ChatBody, Reply, WireError, conversation, event
from autoevolve.records import ToolCall

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"n": 17}, "n: 1 to 16 choices per request are served"),
        ({"n": 2, "stream": True}, "n: several choices are served without stream"),
        ({"logprobs": True, "stream": True}, "logprobs: served without stream"),
        ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
        ({"response_format": {"type": "json_schema"}}, "response_format: text, json_object, or json_schema with"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format: text, json_object"),
        ({"tool_choice": "maybe"}, "tool_choice: 'maybe' is not none, auto, required or a named function"),
        ({"temperature": 3}, "less than or equal to 2"),
        ({"top_k": -2}, "top_k\n  Input should be greater than or equal to -1"),
        ({"min_p": 1.5}, "min_p\n  Input should be less than or equal to 1"),
        ({"repetition_penalty": 0}, "repetition_penalty\n  Input should be greater than 0"),
    ],
)
def test_a_body_the_server_cannot_honour_is_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChatBody(model="m", messages=USER, **extra)


def test_unknown_fields_are_ignored_and_limits_read_from_either_name() -> None:
    body = ChatBody(model="m", messages=USER, max_completion_tokens=7, user="u-1", store=False, stop="END", top_k=-1)
    assert (body.max_new, body.stops, body.forced_tool()) == (7, ["END"], None)
    assert body.extras() == {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}  # vLLM's -1: every token
    knobs = ChatBody(model="m", messages=USER, top_k=40, min_p=0.05, repetition_penalty=1.2).extras()
    assert knobs == {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2}
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
    call = ToolCall.make("call_1", "book_table", {"restaurant_id": "R-1", "party": 2})
    calls = Reply(model="m", calls=[call], finish_reason="tool_calls")
    body = calls.completion()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    streamed = calls.chunks()
    named = {"id": "call_1", "type": "function", "function": {"name": "book_table", "arguments": ""}}
    assert streamed[1]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **named}]  # as the reference streams it
    pieces = [c["choices"][0]["delta"]["tool_calls"][0] for c in streamed[2:-1]]
    assert len(pieces) > 1 and all(p.keys() == {"index", "function"} for p in pieces)
    assert "".join(p["function"]["arguments"] for p in pieces) == call.function["arguments"]
    assert json.loads(event(streamed[0]).removeprefix("data: ")) == streamed[0]
    rest = reply.chunks(sent="Table for")  # the role and these words left as they were generated
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in rest) == " two,\nbooked."


def test_stops_cut_the_text() -> None:
    assert cut("Sure. END more", ["END", "ore"]) == "Sure. "
    assert cut("no stop", []) == "no stop"


def test_live_text_leaves_as_generated_holding_back_what_may_be_a_stop_or_half_a_character(tokenizer) -> None:
    live = Live(tokenizer, ["</end>"])
    live.begin("m", text_only=True)
    ids = tokenizer("Hello wor", add_special_tokens=False)["input_ids"]
    assert all(live.take([i]) for i in ids)
    held = tokenizer("ld </", add_special_tokens=False)["input_ids"]
    assert live.take(held) and live.sent == "Hello world "  # "</" may begin the stop: held back
    assert not live.take(tokenizer("end> more", add_special_tokens=False)["input_ids"])  # the stop ends the row
    pieces = []
    while not live.pieces.empty():
        pieces.append(live.pieces.get_nowait())
    assert "".join(pieces) == "Hello world " and len(pieces) >= 3
    euro = tokenizer("€", add_special_tokens=False)["input_ids"]
    other = Live(tokenizer, [])
    other.begin("m", text_only=True)
    if len(euro) > 1:  # a character over several tokens leaves whole
        assert other.take(euro[:1]) and other.sent == ""
    assert other.take(euro[1:] if len(euro) > 1 else euro) and other.sent == "€"
    gone = Live(tokenizer, [], stream=False)
    gone.begin("m", text_only=True)
    assert gone.take(ids) and gone.sent == ""  # not streamed: no text is decoded
    gone.cancelled.set()
    assert not gone.take(ids)  # its client left: the row ends
