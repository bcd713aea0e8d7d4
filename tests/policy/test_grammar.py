"""Constrained decoding: the tool-call grammar, its matcher in both decoding engines, and the HCP component."""

from __future__ import annotations

import json
from typing import Any

import pytest

from autoevolve.harness.hcp import Decoding, HCPConfig, format_calls
from autoevolve.harness.toolcall import check_arguments, parse_all
from autoevolve.policy import CallConstraint, ChatRequest
from autoevolve.policy.grammar import Grammars, json_schema, lark
from autoevolve.records import ToolCall

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculate_triangle_area",
            "description": "Area of a triangle.",
            "parameters": {
                "type": "object",
                "properties": {
                    "base": {"type": "integer"},
                    "height": {"type": "number"},
                    "unit": {"type": "string", "enum": ["cm", "m"]},
                },
                "required": ["base", "height"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "find_restaurants",
            "description": "Restaurants near a place.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "vegetarian": {"type": "boolean"},
                    "cuisines": {"type": "array", "items": {"type": "string"}},
                    "filters": {"type": "object", "properties": {"open_now": {"type": "boolean"}}},
                },
                "required": [],
            },
        },
    },
]
NAMES = [t["function"]["name"] for t in TOOLS]
SYNTAXES = ("json", "python", "python_list")


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    """Grammars over the real SmolLM2 tokenizer."""
    return Grammars(tokenizer, len(tokenizer))


def _accepts(grammars: Grammars, tokenizer, spec: CallConstraint, text: str) -> bool:
    """Whether the grammar takes the whole text, then the end of the reply."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return grammars.guide(spec).matcher.validate_tokens(ids) == len(ids)


def _parsed_and_typed(text: str, spec: CallConstraint) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a reply, each checked against its tool's schema (raises if a name or a type is wrong)."""
    calls = parse_all(text, NAMES)
    for name, args in calls:
        check_arguments(next(t for t in spec.tools if t["function"]["name"] == name), args)
    return calls


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_the_grammar_takes_what_the_harness_writes_and_nothing_else(grammars, tokenizer, syntax) -> None:
    calls = [
        ToolCall.make("c1", "calculate_triangle_area", {"base": 10, "height": 2.5, "unit": "cm"}),
        ToolCall.make("c2", "find_restaurants", {"vegetarian": True, "cuisines": ["thai"], "filters": {}}),
    ]
    one, both = CallConstraint(tools=TOOLS, syntax=syntax), CallConstraint(tools=TOOLS, syntax=syntax, parallel=True)
    for call in calls:
        written = format_calls([call], syntax)
        assert _accepts(grammars, tokenizer, one, written), written
        assert _parsed_and_typed(written, one) == [(call.name, call.arguments)]
    assert _accepts(grammars, tokenizer, both, format_calls(calls, syntax))
    assert not _accepts(grammars, tokenizer, one, format_calls(calls, syntax))  # two calls where one is asked
    wrong = [
        ToolCall.make("c3", "calculate_triangle_area", {"base": "ten", "height": 2}),  # a string for an integer
        ToolCall.make("c4", "calculate_triangle_area", {"base": 1, "height": 2, "unit": "km"}),  # not in the enum
        ToolCall.make("c5", "calculate_triangle_area", {"height": 2}),  # a required argument missing
        ToolCall.make("c6", "math_fibonacci", {"n": 3}),  # a function not offered
    ]
    for call in wrong:
        assert not _accepts(grammars, tokenizer, one, format_calls([call], syntax)), call


def test_a_plan_line_may_come_first_when_the_scaffold_asks(grammars, tokenizer) -> None:
    text = "Plan: the area tool.\ncalculate_triangle_area(base=1, height=2)"
    assert _accepts(grammars, tokenizer, CallConstraint(tools=TOOLS, syntax="python", plan_line=True), text)
    assert not _accepts(grammars, tokenizer, CallConstraint(tools=TOOLS, syntax="python"), text)


def test_text_or_a_call_takes_prose_and_typed_calls_but_no_malformed_call(grammars, tokenizer) -> None:
    either = CallConstraint(tools=TOOLS, syntax="json", parallel=True, or_text=True)
    good = ToolCall.make("c1", "calculate_triangle_area", {"base": 10, "height": 2.5})
    for text in ["The area is 12.5 square cm.", "  Sure: {braces} later are prose", format_calls([good, good], "json")]:
        assert _accepts(grammars, tokenizer, either, text), text
    bad = ToolCall.make("c2", "calculate_triangle_area", {"base": "ten", "height": 2})
    for text in [format_calls([bad], "json"), ' {"name": "math_fibonacci", "arguments": {}}', "[1, 2]", ""]:
        assert not _accepts(grammars, tokenizer, either, text), text
    with pytest.raises(ValueError, match="in JSON call syntax, not 'python'"):
        lark(CallConstraint(tools=TOOLS, syntax="python", or_text=True))


def test_a_grammar_needs_tools() -> None:
    with pytest.raises(ValueError, match="needs tools to call"):
        lark(CallConstraint(tools=[], syntax="json"))


@pytest.mark.parametrize("engine", ["auto", "hf"])
def test_every_constrained_reply_of_a_random_model_is_a_typed_call_of_an_offered_function(
    tiny_model_dir, engine
) -> None:
    """A random model writes garbage; under the grammar each finished reply still parses, names an offered function
    and holds values of the declared types (sampled at temperature 1 across seeds; both decoding engines)."""
    from autoevolve.policy.local import LocalPolicy

    policy = LocalPolicy(str(tiny_model_dir), batch_size=8, dtype="float32", engine=engine)
    finished = 0
    for syntax in SYNTAXES:
        for parallel in (False, True):
            spec = CallConstraint(tools=TOOLS, syntax=syntax, parallel=parallel)
            requests = [
                ChatRequest(
                    messages=[{"role": "user", "content": f"Question {i}"}],
                    temperature=1.0,
                    max_new_tokens=64,
                    seed=i,
                    constrain=spec,
                )
                for i in range(8)
            ]
            for reply in policy.generate(requests):
                assert not reply.error
                if reply.completion_tokens >= 64:  # cut by the token limit mid-call: nothing to check
                    continue
                finished += 1
                calls = _parsed_and_typed(reply.text, spec)
                assert calls and (parallel or len(calls) == 1), reply.text
    assert finished >= 24  # most replies end on their own: the grammar lets the end through once a call is whole
    free = policy.generate([ChatRequest(messages=[{"role": "user", "content": "Question"}], max_new_tokens=16)])
    assert not parse_all(free[0].text, NAMES)  # without the grammar the same model writes no call


def test_greedy_constrained_decoding_is_the_same_in_both_engines(tiny_model_dir) -> None:
    from autoevolve.policy.local import LocalPolicy

    spec = CallConstraint(tools=TOOLS, syntax="python_list", parallel=True)
    requests = [
        ChatRequest(messages=[{"role": "user", "content": f"Q{i}"}], max_new_tokens=48, constrain=spec)
        for i in range(4)
    ]
    texts = {}
    for engine in ("auto", "hf"):
        policy = LocalPolicy(str(tiny_model_dir), batch_size=4, dtype="float32", engine=engine)
        texts[engine] = [c.text for c in policy.generate(requests)]
    assert texts["auto"] == texts["hf"]


def test_the_decoding_component_keeps_old_ids_and_builds_the_request(env, original) -> None:
    from autoevolve.harness.rollout import constraint

    body = original.model_dump(mode="json")
    del body["decoding"]
    assert HCPConfig.model_validate(body).id == original.id  # configs written before the component keep their id
    on = original.model_copy(update={"decoding": Decoding(constrain="tool_call")})
    assert on.id != original.id
    task = env.tasks("train")[0]
    assert constraint(original, task) is None
    spec = constraint(on, task)
    assert spec.syntax == original.call_syntax and [t["function"]["name"] for t in spec.tools] == original.tool_names
    native = on.model_copy(update={"tool_format": "native"})
    assert constraint(native, task).syntax == "json"
    with pytest.raises(ValueError, match="constrain"):
        HCPConfig.model_validate({**body, "decoding": {"constrain": "regex"}})


def test_the_openai_policy_asks_the_server_for_its_own_equivalent() -> None:
    from autoevolve.policy.openai import constrained

    spec = CallConstraint(tools=TOOLS, syntax="json")
    native = ChatRequest(messages=[], tools=TOOLS, constrain=spec)
    assert constrained(native) == {"tool_choice": "required", "parallel_tool_calls": False}
    text = constrained(ChatRequest(messages=[], constrain=spec))
    schema = text["response_format"]["json_schema"]["schema"]
    assert text["response_format"]["type"] == "json_schema" and schema == json_schema(spec)
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == NAMES
    with pytest.raises(ValueError, match="no grammar for calls in Python syntax; use tool_format 'native'"):
        constrained(ChatRequest(messages=[], constrain=CallConstraint(tools=TOOLS, syntax="python_list")))
    either = spec.model_copy(update={"or_text": True})
    asked = constrained(ChatRequest(messages=[], tools=TOOLS, constrain=either))
    assert asked["tool_choice"] == "auto" and [t["function"]["strict"] for t in asked["tools"]] == [True, True]
    assert "strict" not in TOOLS[0]["function"]  # the request's own tools are left as they were
    with pytest.raises(ValueError, match="no equivalent in the API: use native tools"):
        constrained(ChatRequest(messages=[], constrain=either))


def test_python_call_syntax_writes_python_literals_the_parser_reads_back() -> None:
    call = ToolCall.make("c", "find_restaurants", {"vegetarian": True, "city": None, "filters": {"open_now": False}})
    written = format_calls([call], "python")
    assert written == 'find_restaurants(vegetarian=True, city=None, filters={"open_now": False})'
    assert parse_all(written, NAMES) == [("find_restaurants", call.arguments)]
    assert json.loads(format_calls([call], "json"))["arguments"]["vegetarian"] is True
