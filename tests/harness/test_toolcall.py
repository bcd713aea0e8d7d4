"""Generous parsing of tool calls and schema checks of their arguments."""

from __future__ import annotations

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.toolcall import CallError, check_arguments, parse, parse_all

TOOLS = ["book_table", "request_ride"]


def test_first_json_object_in_text() -> None:
    text = 'Sure! {"name": "book_table", "arguments": {"restaurant_id": "R-1", "party_size": 2}} done'
    assert parse(text, TOOLS) == ("book_table", {"restaurant_id": "R-1", "party_size": 2})


def test_other_json_shapes() -> None:
    assert parse('{"tool": "request_ride", "parameters": {"time": "08:00"}}', TOOLS) == (
        "request_ride",
        {"time": "08:00"},
    )
    wire = '{"function": {"name": "book_table", "arguments": "{\\"party_size\\": 3}"}}'
    assert parse(wire, TOOLS) == ("book_table", {"party_size": 3})


def test_python_call_of_a_known_tool() -> None:
    assert parse('book_table(restaurant_id="R-1", party_size=4)', TOOLS) == (
        "book_table",
        {"restaurant_id": "R-1", "party_size": 4},
    )
    assert parse("Done (booking B-1).", TOOLS) is None  # a plain reply


def test_broken_calls_raise_with_the_reason() -> None:
    with pytest.raises(CallError, match="unparseable tool call"):
        parse('{"name": "book_table", "arguments": {"party_size": ', TOOLS)
    with pytest.raises(CallError, match="unparseable tool call"):
        parse('book_table(restaurant_id="R-1", party_size=', TOOLS)


def test_argument_checks() -> None:
    spec = next(t for t in LifeEnv().tools() if t["function"]["name"] == "book_table")
    assert check_arguments(spec, {"restaurant_id": "R-1", "party_size": "4", "time": "19:00"})["party_size"] == 4
    with pytest.raises(CallError, match="missing required argument"):
        check_arguments(spec, {"restaurant_id": "R-1"})
    with pytest.raises(CallError, match="unknown argument"):
        check_arguments(spec, {"restaurant_id": "R-1", "party_size": 2, "time": "19:00", "date": "x"})
    with pytest.raises(CallError, match="party_size should be integer"):
        check_arguments(spec, {"restaurant_id": "R-1", "party_size": "two", "time": "19:00"})


JSON_LIST = (
    '[{"name": "book_table", "arguments": {"restaurant_id": "R-1", "party_size": 2}}, '
    '{"function": {"name": "request_ride", "arguments": "{\\"time\\": \\"08:00\\"}"}}]'
)
JSON_ROW = (
    'First: {"name": "book_table", "arguments": {"restaurant_id": "R-1", "party_size": 2}}\n'
    'then {"tool": "request_ride", "parameters": {"time": "08:00"}}'
)
PY_LIST = '[book_table(restaurant_id="R-1", party_size=2), request_ride(time="08:00")]'
PY_LINES = 'book_table(restaurant_id="R-1", party_size=2)\nrequest_ride(time="08:00")'
BOTH = [("book_table", {"restaurant_id": "R-1", "party_size": 2}), ("request_ride", {"time": "08:00"})]


def test_parse_all_reads_every_call_in_each_syntax() -> None:
    """A JSON list, JSON objects in a row, BFCL's Python list and Python calls one per line: all calls, in order."""
    for text in (JSON_LIST, JSON_ROW, PY_LIST, PY_LINES):
        assert parse_all(text, TOOLS) == BOTH, text
    assert parse_all(PY_LIST.replace("book_table(", "xbook_table("), TOOLS) == BOTH[1:]  # not a known tool
    assert parse_all('book_table(restaurant_id="request_ride(time=1)", party_size=2)', TOOLS) == [
        ("book_table", {"restaurant_id": "request_ride(time=1)", "party_size": 2})
    ]  # a tool name inside an argument is not a second call
    nested = '{"calls": [{"name": "request_ride", "arguments": {"time": "09:00"}}]} [3, 5]'
    assert parse_all(nested, TOOLS) == [("request_ride", {"time": "09:00"})]
    assert parse_all("Done (booking B-1).", TOOLS) == []


def test_parse_is_unchanged_on_replies_with_several_calls() -> None:
    """parse still reads the first call only, and it is parse_all's first."""
    for text in (JSON_LIST, JSON_ROW, PY_LIST, PY_LINES):
        assert parse(text, TOOLS) == BOTH[0] == parse_all(text, TOOLS)[0]
    assert parse('book_table(restaurant_id="R-1", party_size=2) request_ride(time=', TOOLS) == BOTH[0]


def test_parse_all_refuses_a_call_it_cannot_read() -> None:
    """A broken later call must not vanish: the reply's count of calls would be wrong."""
    good = '{"name": "book_table", "arguments": {"party_size": 2}}'
    with pytest.raises(CallError, match=r"unparseable tool call after 1 readable one\(s\)"):
        parse_all(good + ' {"name": "request_ride", "arguments": {"time": ', TOOLS)
    with pytest.raises(CallError, match="unparseable tool call"):
        parse_all('book_table(party_size=2)\nrequest_ride(time="08:00"', TOOLS)
    with pytest.raises(CallError, match="unparseable tool call"):
        parse_all('{"name": "book_table", "arguments": {"party_size": ', TOOLS)
