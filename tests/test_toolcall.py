"""Generous parsing of tool calls and schema checks of their arguments."""

from __future__ import annotations

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.toolcall import CallError, check_arguments, parse

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
