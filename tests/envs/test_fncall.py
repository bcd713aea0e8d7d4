"""FncallEnv: BFCL-format loading, seeded splits, tool conversion, the fixed scorer, references and a rollout."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from autoevolve.envs import make_env
from autoevolve.envs.bfcl_scoring import AGENTIC, MULTI_TURN, NO_TRUTH, NO_TRUTH_RELEVANCE, category_of
from autoevolve.envs.fncall import PARALLEL, SAMPLE, FncallEnv, FncallEpisode, to_openai_tools
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import rollout
from autoevolve.harness.toolcall import PARALLEL_CALLS, parse_all
from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import Task

SPLITS = ("train", "dev", "test")
TRIANGLE = {
    "name": "calculate_triangle_area",
    "description": "Area of a triangle.",
    "parameters": {
        "type": "dict",
        "properties": {
            "base": {"type": "float", "description": "Base length."},
            "height": {"type": "float", "description": "Height."},
            "unit": {"type": "string", "description": "Unit, default 'units'."},
        },
        "required": ["base", "height"],
    },
}
FACTORIAL = {
    "name": "math.factorial",
    "description": "n!",
    "parameters": {"type": "dict", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
}
SHIP = {
    "name": "shipping.quote",
    "description": "Quote a parcel.",
    "parameters": {
        "type": "dict",
        "properties": {
            "parcel": {"type": "dict", "properties": {"kg": {"type": "float"}, "fragile": {"type": "boolean"}}},
            "sizes": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["parcel", "sizes"],
    },
}


class Scripted:
    """A policy that replays fixed replies, one per model call (as in tests/harness/test_rollout.py)."""

    def __init__(self, replies: list[str]) -> None:
        self.replies, self.calls = replies, 0

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        return [Completion(text=reply, prompt_tokens=10, completion_tokens=5) for _ in requests]

    def add_adapter(self, name: str, path: str) -> None:
        pass


def _row(id_: str, question: Any, functions: Any, truth: Any = None) -> dict[str, Any]:
    """One BFCL line; without ground truth when truth is None."""
    row = {"id": id_, "question": question, "function": functions}
    return row if truth is None else row | {"ground_truth": truth}


def _write(path: Path, rows: list[Any]) -> Path:
    """Write JSON lines (a str row is written verbatim, to make bad lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def env() -> FncallEnv:
    """The shipped sample, split 60/20/20."""
    return FncallEnv(SAMPLE)


@pytest.fixture
def small(tmp_path: Path) -> FncallEnv:
    """Three hand-made questions: a triangle, a dotted name, two parallel calls with nested values; all train."""
    rows = [
        _row("tri", [[{"role": "user", "content": "Area, base 10, height 5?"}]], [TRIANGLE],
             [{"calculate_triangle_area": {"base": [10.0], "height": [5.0], "unit": ["units", ""]}}]),
        _row("fact", "What is 5 factorial?", FACTORIAL, [{"math.factorial": {"number": [5]}}]),
        _row("par", [{"role": "user", "content": "Quote two parcels."}], [SHIP], [
            {"shipping.quote": {"parcel": [{"kg": [2], "fragile": ["", False]}], "sizes": [[2, 3]]}},
            {"shipping.quote": {"parcel": [{"kg": [1.5], "fragile": [True]}], "sizes": [[4]]}},
        ]),
    ]  # fmt: skip
    return FncallEnv(_write(tmp_path / "small.jsonl", rows), n_train=3, n_dev=0, n_test=0)


def _task(env: FncallEnv, source: str) -> Task:
    """The task made from a line id."""
    return next(t for s in SPLITS for t in env.tasks(s) if t.id == f"fncall-{source}")


def _score(env: FncallEnv, task: Task, *calls: tuple[str, dict[str, Any]]) -> tuple[float, str]:
    """Score an episode after the given calls."""
    episode = env.start(task)
    for name, args in calls:
        episode.call(name, args)
    return episode.score([])


def test_splits_deterministic_disjoint_and_sized(env: FncallEnv) -> None:
    """Same seed, same splits; another seed differs; 60/20/20 for a small file; asked sizes otherwise."""
    twin, other = FncallEnv(SAMPLE, seed=0), FncallEnv(SAMPLE, seed=1)
    for split in SPLITS:
        assert [t.model_dump() for t in env.tasks(split)] == [t.model_dump() for t in twin.tasks(split)]
    assert [len(env.tasks(s)) for s in SPLITS] == [20, 6, 6] and env.skipped == {} and env.notes() == []
    ids = [t.id for s in SPLITS for t in env.tasks(s)]
    assert len(ids) == len(set(ids)) == 32 and all(i.startswith("fncall-sample_") for i in ids)
    assert [t.id for t in other.tasks("test")] != [t.id for t in env.tasks("test")]
    lines = [json.loads(line)["id"] for line in SAMPLE.read_text().splitlines()]
    for split in SPLITS:  # each split keeps file order
        positions = [lines.index(t.id.removeprefix("fncall-")) for t in env.tasks(split)]
        assert positions == sorted(positions) and all(t.split == split for t in env.tasks(split))
    sized, fewer = FncallEnv(SAMPLE, n_train=10, n_dev=5, n_test=4), FncallEnv(SAMPLE, n_train=3, n_dev=5, n_test=4)
    assert [len(sized.tasks(s)) for s in SPLITS] == [10, 5, 4]
    assert sized.tasks("test") == fewer.tasks("test") and sized.tasks("dev") == fewer.tasks("dev")


def test_task_records(env: FncallEnv) -> None:
    """Tasks carry the converted tools, the request, a tier from the call count, and the ground truth."""
    assert env.name == "fncall" and env.tools() == []
    tasks = {t.id: t for s in SPLITS for t in env.tasks(s)}
    par = tasks["fncall-sample_gcd_lcm_1"]
    assert par.tier == 2 and [t["function"]["name"] for t in par.tools] == ["math_gcd", "math_lcm"]
    assert par.request == "What is the GCD of 12 and 18, and the LCM of 4 and 5?"
    assert par.goal["names"] == {"math_gcd": "math.gcd", "math_lcm": "math.lcm"}
    assert sum(t.tier == 2 for t in tasks.values()) == 2 and all(t.tools for t in tasks.values())
    assert make_env("fncall", path=SAMPLE).tasks("dev") == env.tasks("dev")
    with pytest.raises(ValueError, match="unknown environment .nope. \(registered: fncall, life, router, trl\)"):
        make_env("nope")


def test_tool_conversion() -> None:
    """BFCL types become JSON Schema types, nested too; names become OpenAI-safe and unique, mapped back."""
    doc = {
        "name": "geo.area",
        "parameters": {
            "type": "dict",
            "properties": {
                "x": {"type": "float", "optional": True},
                "pt": {"type": "tuple", "items": {"type": "float"}},
                "blob": {"type": "any", "description": "anything"},
                "opts": {"type": "dict", "properties": {"scale": {"type": "float"}, "rows": {"type": "tuple"}}},
                "cls": {"type": "HashMap"},
            },
            "required": ["x"],
        },
    }
    tools, names = to_openai_tools([doc, {"name": "geo_area", "parameters": {}}, {"name": "a b/c"}])
    assert names == {"geo_area": "geo.area", "geo_area_2": "geo_area", "a_b_c": "a b/c"}
    params = tools[0]["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["x"]
    props = params["properties"]
    assert props["x"] == {"type": "number"} and props["pt"] == {"type": "array", "items": {"type": "number"}}
    assert props["blob"] == {"description": "anything"} and props["cls"] == {"type": "string"}
    assert props["opts"]["type"] == "object"
    assert props["opts"]["properties"] == {"scale": {"type": "number"}, "rows": {"type": "array"}}
    assert tools[2]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_exact_and_equivalent_answers_score_one(small: FncallEnv) -> None:
    """Omitted optional (''), int for float, case and spaces in strings, and the dotted name's safe form all pass."""
    tri, fact = _task(small, "tri"), _task(small, "fact")
    for args in ({"base": 10.0, "height": 5.0}, {"base": 10, "height": 5}, {"base": 10, "height": 5, "unit": " Units"}):
        assert _score(small, tri, ("calculate_triangle_area", args)) == (1.0, "")
    assert _score(small, fact, ("math_factorial", {"number": 5})) == (1.0, "")
    assert _score(small, fact, ("math.factorial", {"number": 5.0})) == (1.0, "")


def test_each_failed_check_costs_its_fraction(small: FncallEnv) -> None:
    """Checks are the name and one per expected parameter, plus one per unexpected one; feedback names each."""
    tri = _task(small, "tri")
    reward, feedback = _score(small, tri, ("calculate_triangle_area", {"base": 11, "height": 5}))
    assert reward == 3 / 4
    assert feedback == "Argument 'base' of calculate_triangle_area was 11; expected one of [10.0]."
    reward, feedback = _score(small, tri, ("calculate_triangle_area", {"base": 10}))
    assert (
        reward == 3 / 4
        and feedback == "Argument 'height' of calculate_triangle_area is missing; expected one of [5.0]."
    )
    reward, feedback = _score(small, tri, ("calculate_triangle_area", {"base": 10, "height": 5, "unit": "cm"}))
    assert reward == 3 / 4 and "Argument 'unit' of calculate_triangle_area was \"cm\"; expected one of" in feedback
    assert 'one of ["units"] or omitted' in feedback
    reward, feedback = _score(small, tri, ("calculate_triangle_area", {"base": 10, "height": 5, "color": "red"}))
    assert reward == 4 / 5 and feedback == "Argument 'color' of calculate_triangle_area was not expected."
    reward, feedback = _score(small, tri, ("calculate_triangle_area", {"base": 1, "height": True, "color": 1}))
    assert reward == 2 / 5 and feedback.count("Argument") == 3  # True is not 5.0 and not 1


def test_wrong_function_and_no_call_score_zero(small: FncallEnv) -> None:
    """A call to another function earns nothing; no call at all says what was expected."""
    tri = _task(small, "tri")
    reward, feedback = _score(small, tri, ("math_factorial", {"base": 10, "height": 5}))
    assert reward == 0.0 and feedback.startswith("Called math_factorial instead of calculate_triangle_area(")
    reward, feedback = _score(small, tri)
    assert reward == 0.0
    assert feedback == 'No function was called; expected calculate_triangle_area(base=10.0, height=5.0, unit="units").'


def test_parallel_calls_match_in_any_order_with_nested_values(small: FncallEnv) -> None:
    """Two expected calls: any order scores 1.0; nested dicts and lists compare element-wise; gaps cost."""
    par = _task(small, "par")
    one = ("shipping_quote", {"parcel": {"kg": 2.0}, "sizes": [2, 3.0]})
    two = ("shipping_quote", {"parcel": {"kg": 1.5, "fragile": True}, "sizes": [4]})
    assert _score(small, par, one, two) == (1.0, "") and _score(small, par, two, one) == (1.0, "")
    reward, feedback = _score(small, par, two)
    assert reward == 3 / 6 and feedback.startswith("Expected a call to shipping_quote(parcel=")
    reward, _ = _score(small, par, one, ("shipping_quote", {"parcel": {"kg": 1.5}, "sizes": [4]}))
    assert reward == 5 / 6  # fragile is required inside the second parcel
    reward, _ = _score(small, par, one, ("shipping_quote", {"parcel": {"kg": 1.5, "fragile": True}, "sizes": [4, 5]}))
    assert reward == 5 / 6
    reward, feedback = _score(small, par, one, two, two)
    assert reward == 6 / 7 and "The call shipping_quote(" in feedback and "was not expected" in feedback


def test_episode_finishes_after_the_expected_number_of_calls(small: FncallEnv) -> None:
    """finished flips once as many calls were made as the ground truth lists."""
    episode = small.start(_task(small, "par"))
    assert isinstance(episode, FncallEpisode) and not episode.finished
    ack = json.loads(episode.call("shipping_quote", {}))
    assert ack == {"status": "ok", "function": "shipping_quote"} and not episode.finished
    episode.call("shipping_quote", {})
    assert episode.finished


def test_answers_from_a_possible_answer_file_by_id(tmp_path: Path) -> None:
    """Answers beside the data (possible_answer/<same name>) or named explicitly, matched by id; others skipped."""
    question = [[{"role": "user", "content": "5!"}]]
    rows = [_row(f"q{i}", question, [FACTORIAL]) for i in range(5)]
    data = _write(tmp_path / "BFCL_v4_simple.json", rows)
    answers = [{"id": f"q{i}", "ground_truth": [{"math.factorial": {"number": [i]}}]} for i in (3, 0, 4, 1)]
    _write(tmp_path / "possible_answer" / "BFCL_v4_simple.json", answers)
    env = FncallEnv(data)
    tasks = {t.id: t for s in SPLITS for t in env.tasks(s)}
    assert env.skipped == {NO_TRUTH: 1} and sorted(tasks) == ["fncall-q0", "fncall-q1", "fncall-q3", "fncall-q4"]
    assert tasks["fncall-q3"].goal["ground_truth"] == [{"math.factorial": {"number": [3]}}]
    elsewhere = _write(tmp_path / "other" / "gold.jsonl", answers[:1])
    assert FncallEnv(data, answers=elsewhere).skipped == {NO_TRUTH: 4}
    with pytest.raises(ValueError, match="no question with a ground truth"):
        FncallEnv(_write(tmp_path / "lonely.json", rows))


def test_bad_lines_name_the_file_and_line(tmp_path: Path) -> None:
    """A broken line raises ValueError with path:line and the expected shape."""
    good = _row("ok", "5!", [FACTORIAL], [{"math.factorial": {"number": [5]}}])
    cases = {
        "{not json": "not valid JSON",
        json.dumps(_row("b", "5!", [FACTORIAL], {"math.factorial": 5})): "bad ground_truth",
        json.dumps(_row("b", "5!", [FACTORIAL], [{"math.factorial": {"number": 5}}])): "bad ground_truth",
        json.dumps(_row("b", "5!", [], [{"math.factorial": {"number": [5]}}])): "missing or empty 'function'",
        json.dumps(_row("b", [[{"role": "user"}]], [FACTORIAL], [{"math.factorial": {"number": [5]}}])): "question",
    }
    for line, why in cases.items():
        path = _write(tmp_path / "bad.jsonl", [good, "", line])
        with pytest.raises(ValueError, match=why) as info:
            FncallEnv(path)
        assert f"{path}:3:" in str(info.value) and "{function_name: {param: [accepted values]}}" in str(info.value)
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: duplicate id 'ok'; ids must be unique"):
        FncallEnv(_write(tmp_path / "bad.jsonl", [good, "", json.dumps(good)]))
    data = _write(tmp_path / "d" / "x.json", [_row("a", "5!", [FACTORIAL])])
    _write(tmp_path / "d" / "possible_answer" / "x.json", [{"id": "a", "ground_truth": [["cd(folder='a')"]]}])
    with pytest.raises(ValueError, match=r"possible_answer/x\.json:1: bad ground_truth"):
        FncallEnv(data)


def test_question_shapes_become_one_request(tmp_path: Path) -> None:
    """A string, a flat message list, or turns: earlier messages travel with the last, joined by newlines."""
    truth = [{"math.factorial": {"number": [5]}}]
    rows = [
        _row("s", "Plain?", FACTORIAL, truth),
        _row("f", [{"role": "user", "content": "Flat?"}], FACTORIAL, truth),
        _row("t", [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                   [{"role": "user", "content": "Now 5!"}]], FACTORIAL, truth),
    ]  # fmt: skip
    env = FncallEnv(_write(tmp_path / "q.jsonl", rows), n_train=3, n_dev=0, n_test=0)
    assert [t.request for t in env.tasks("train")] == ["Plain?", "Flat?", "Be brief.\nHi\nNow 5!"]


def test_references_replay_to_full_reward(env: FncallEnv, small: FncallEnv) -> None:
    """Every train task's reference scores 1.0 through a fresh episode; held-out tasks have none."""
    for source in (env, small):
        for task in source.tasks("train"):
            messages = source.reference(task)
            assert messages is not None and messages[0].content == task.request
            assert [m.role for m in messages] == ["user"] + ["assistant", "tool"] * len(task.goal["ground_truth"])
            episode = source.start(task)
            for message in messages:
                for call in message.tool_calls:
                    assert call.name in [t["function"]["name"] for t in task.tools]
                    episode.call(call.name, call.arguments)
            assert episode.finished and episode.score(messages) == (1.0, "")
    assert all(env.reference(t) is None for s in ("dev", "test") for t in env.tasks(s))
    [call] = small.reference(_task(small, "tri"))[1].tool_calls
    assert call.arguments == {"base": 10.0, "height": 5.0, "unit": "units"}


def test_original_config_renders_task_tools(env: FncallEnv) -> None:
    """The original config has no tools of its own and lists each task's functions in the prompt."""
    hcp = HCPConfig.from_yaml("prompts/fncall.yaml")
    task = next(t for t in env.tasks("train") if t.id == "fncall-sample_gcd_lcm_1")
    messages, native = hcp.render(task)
    assert hcp.tools == [] and native is None and hcp.scaffold.max_steps == 2
    assert "- math_gcd(a, b): Greatest common divisor" in messages[0]["content"]
    assert "math_lcm(numbers)" in messages[0]["content"] and messages[-1]["content"] == task.request


def test_rollout_ends_after_one_model_call(env: FncallEnv) -> None:
    """A right JSON call ends the episode at once (finished) with reward 1.0; two calls for a parallel task."""
    hcp = HCPConfig.from_yaml("prompts/fncall.yaml")
    task = next(t for t in env.tasks("train") if t.id == "fncall-sample_compound_1")
    args = {"principal": 5000, "annual_rate": 0.04, "years": 6, "compounds_per_year": 12}
    policy = Scripted([json.dumps({"name": "finance_compound_interest", "arguments": args}), "never asked"])
    [traj] = rollout(policy, env, hcp, [task], run_id="r")
    assert policy.calls == 1 and traj.reward == 1.0 and traj.error == "" and traj.feedback == ""
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool"]
    par = next(t for t in env.tasks("train") if t.id == "fncall-sample_gcd_lcm_1")
    replies = [
        '{"name": "math_lcm", "arguments": {"numbers": [4, 5]}}',
        '{"name": "math_gcd", "arguments": {"a": 12, "b": 18}}',
    ]
    policy = Scripted(replies)
    [traj] = rollout(policy, env, hcp, [par], run_id="r")
    assert policy.calls == 2 and traj.reward == 1.0 and traj.error == ""
    [traj] = rollout(Scripted(replies[:1]), env, hcp, [par], run_id="r")  # the same call twice
    assert traj.reward == 2 / 5 and traj.feedback == "Called math_lcm instead of math_gcd(a=12, b=18)."


def test_an_empty_accepted_list_means_omit() -> None:
    """A few BFCL answers accept [] for a parameter: only leaving it out can pass."""
    goal = {"ground_truth": [{"f": {"a": [1], "b": []}}], "names": {"f": "f"}}
    task = Task(id="fncall-x", env="fncall", split="dev", tier=1, request="?", goal=goal)
    for args, want in (({"a": 1}, 1.0), ({"a": 1, "b": 2}, 2 / 3)):
        episode = FncallEpisode(task)
        episode.call("f", args)
        assert episode.score([])[0] == want


@pytest.fixture(scope="module")
def par() -> FncallEnv:
    """The shipped parallel sample, every scorable question in train."""
    return FncallEnv(PARALLEL, n_train=9, n_dev=0, n_test=0)


AREA = ("circle_calculate_area", {"radius": 5})
CIRCUMFERENCE = ("circle_calculate_circumference", {"diameter": 10})
PERIMETER = ("rectangle_calculate_perimeter", {"length": 4, "breadth": 6})


def test_category_from_the_id_and_parallel_flag(par: FncallEnv) -> None:
    """BFCL's category is the id up to its last '_'; only the parallel categories allow several calls per reply."""
    cases = {
        "parallel_multiple_12": "parallel_multiple",
        "simple_python_3": "simple_python",
        "live_parallel_1-0-1": "live_parallel",
        "multi_turn_base_0": "multi_turn_base",
        "format_sensitivity_0:prompt_format:live_simple_23-5-1": "format_sensitivity",
        "tri": "",
    }
    assert {i: category_of(i) for i in cases} == cases
    tasks = par.tasks("train")
    assert [t.metadata["category"] for t in tasks] == ["parallel"] * 4 + ["parallel_multiple"] * 4 + ["live_parallel"]
    assert all(t.metadata[PARALLEL_CALLS] is True and t.tier == 2 for t in tasks)
    sample = [t for s in SPLITS for t in FncallEnv(SAMPLE).tasks(s)]
    gcd = next(t for t in sample if t.id == "fncall-sample_gcd_lcm_1")
    assert gcd.metadata == {"bfcl_id": "sample_gcd_lcm_1", "category": "sample_gcd_lcm"}
    assert not any(PARALLEL_CALLS in t.metadata for t in sample)


def test_questions_it_cannot_score_are_skipped_per_reason(tmp_path: Path) -> None:
    """Multi-turn, memory, web-search and answerless questions are counted per reason and noted, not fatal."""
    question = [[{"role": "user", "content": "5!"}]]
    rows = [
        _row("simple_python_0", question, [FACTORIAL]),
        _row("irrelevance_0", question, [TRIANGLE]),
        _row("live_irrelevance_3-0-1", question, [TRIANGLE]),
        _row("live_relevance_0-0-0", question, [TRIANGLE]),
        {"id": "multi_turn_base_0", "question": [question[0], question[0]], "initial_config": {}},
        {"id": "multi_turn_miss_func_2", "question": question, "initial_config": {}},
        {"id": "memory_0-customer-0", "question": question, "involved_classes": ["MemoryAPI"]},
        {"id": "web_search_1", "question": question, "involved_classes": ["WebSearchAPI"]},
        _row("q_7", question, [FACTORIAL]),
    ]
    data = _write(tmp_path / "mixed.json", rows)
    answers = [
        {"id": "simple_python_0", "ground_truth": [{"math.factorial": {"number": [5]}}]},
        {"id": "multi_turn_base_0", "ground_truth": [["cd(folder='a')"], ["ls()"]]},  # not BFCL's single-turn shape
        {"id": "memory_0-customer-0", "ground_truth": ["Michael"]},
        {"id": "web_search_1", "ground_truth": ["Zhang Yiming"]},
    ]
    _write(tmp_path / "possible_answer" / "mixed.json", answers)
    env = FncallEnv(data)
    assert [t.id for s in SPLITS for t in env.tasks(s)] == ["fncall-simple_python_0"]
    assert env.skipped == {NO_TRUTH_RELEVANCE: 3, MULTI_TURN: 2, AGENTIC: 2, NO_TRUTH: 1}
    assert len(env.notes()) == 4 and env.notes()[0] == f"skipped 3 questions: {NO_TRUTH_RELEVANCE}"
    assert env.notes()[3] == "skipped 1 question: no ground truth in the line or the answers file"
    assert FncallEnv(PARALLEL).skipped == {NO_TRUTH_RELEVANCE: 1, MULTI_TURN: 1}
    # A question of a category it can score still fails the file, at its line, when its ground truth is malformed.
    bad = _row("parallel_5", question, [FACTORIAL], [{"math.factorial": {"number": 5}}])
    with pytest.raises(ValueError, match=r"mixed\.json:10: bad ground_truth"):
        FncallEnv(_write(tmp_path / "mixed.json", [*rows, bad]))
    with pytest.raises(ValueError, match=r"no question with a ground truth .*skipped 3 questions: no ground truth"):
        FncallEnv(_write(tmp_path / "none.json", rows[1:4]))


def test_a_parallel_reply_scores_one_in_any_order(par: FncallEnv) -> None:
    """Every order of the expected calls scores 1.0; so does one text reply holding them, JSON list or Python."""
    task = _task(par, "parallel_multiple_2")
    for calls in itertools.permutations([AREA, CIRCUMFERENCE, PERIMETER]):
        assert _score(par, task, *calls) == (1.0, "")
    hcp = HCPConfig.from_yaml("prompts/fncall.yaml")
    as_json = json.dumps([{"name": n, "arguments": a} for n, a in (PERIMETER, AREA, CIRCUMFERENCE)])
    as_python = (
        "[rectangle_calculate_perimeter(length=4, breadth=6), circle_calculate_area(radius=5), "
        "circle_calculate_circumference(diameter=10)]"
    )
    for reply in (as_json, as_python):
        policy = Scripted([reply, "never asked"])
        [traj] = rollout(policy, par, hcp, [task], run_id="r")
        assert policy.calls == 1 and (traj.reward, traj.error, traj.feedback) == (1.0, "", "")
        assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "tool", "tool"]


def test_a_wrong_count_of_calls_scores_zero_and_says_why(par: FncallEnv) -> None:
    """Too few or too many calls in the reply score 0 (BFCL's wrong count), naming what was left unmatched; a
    parallel episode ends with its first reply that made calls, so calls spread over replies fail too."""
    task = _task(par, "parallel_multiple_2")
    reward, feedback = _score(par, task, CIRCUMFERENCE, AREA)
    assert reward == 0.0 and feedback == (
        "The reply made 2 calls but the question needs exactly 3, all in one reply; a wrong count of calls scores 0. "
        "Expected rectangle_calculate_perimeter(length=4, breadth=6), but no call in the reply was left for it."
    )
    reward, feedback = _score(par, task, AREA, CIRCUMFERENCE, PERIMETER, AREA)
    assert reward == 0.0 and feedback.startswith("The reply made 4 calls but the question needs exactly 3")
    assert feedback.endswith("The call circle_calculate_area(radius=5) was not expected.")
    hcp = HCPConfig.from_yaml("prompts/fncall.yaml")
    replies = [json.dumps({"name": n, "arguments": a}) for n, a in (AREA, CIRCUMFERENCE, PERIMETER)]
    policy = Scripted(replies)
    [traj] = rollout(policy, par, hcp, [task], run_id="r")
    assert policy.calls == 1 and traj.reward == 0.0 and "The reply made 1 call but" in traj.feedback


def test_an_unmatched_expected_call_is_named_with_the_reason(par: FncallEnv) -> None:
    """With the right count, each expected call no call matched is named, with its closest call and what differs."""
    task = _task(par, "parallel_0")
    coldplay = ("music_play", {"artist": "Coldplay", "duration": 20})
    adele = ("music_play", {"artist": "adele ", "duration": 10})  # case and spaces do not matter
    reward, feedback = _score(par, task, coldplay, adele)
    assert reward == 5 / 6 and feedback == (
        'No call in the reply matched music_play(artist="Coldplay", duration=25); in the closest, '
        "music_play(artist=\"Coldplay\", duration=20): Argument 'duration' of music_play was 20; expected one of [25]."
    )
    task = _task(par, "parallel_multiple_0")
    sums = ("math_toolkit_sum_of_multiples", {"lower_limit": 1, "upper_limit": 100, "multiples": [3, 5]})
    reward, feedback = _score(par, task, sums, sums)
    assert reward == 4 / 6 and feedback == (
        "No call in the reply matched math_toolkit_product_of_primes(count=4) (the closest, "
        "math_toolkit_sum_of_multiples(lower_limit=1, upper_limit=100, multiples=[3, 5]), calls another function)."
    )


def test_parallel_references_put_every_call_in_one_reply(par: FncallEnv) -> None:
    """A parallel question's reference is one assistant message with all its calls; written out under either call
    syntax, parse_all reads the calls back, and the reference scores 1.0."""
    hcp = HCPConfig.from_yaml("prompts/fncall.yaml")
    for task in par.tasks("train"):
        messages = par.reference(task)
        n = len(task.goal["ground_truth"])
        assert [m.role for m in messages] == ["user", "assistant"] + ["tool"] * n
        calls = [(c.name, c.arguments) for c in messages[1].tool_calls]
        episode = par.start(task)
        for name, args in calls:
            episode.call(name, args)
        assert episode.finished and episode.score(messages) == (1.0, "")
        names = [t["function"]["name"] for t in task.tools]
        for syntax in ("json", "python"):
            wire, _ = hcp.model_copy(update={"call_syntax": syntax}).render(task, messages)
            assert parse_all(wire[2]["content"], names) == calls


BFCL_FILES = ["bfcl_eval:data/BFCL_v4_simple_python.json", "bfcl_eval:data/BFCL_v4_multiple.json"]


def test_bfcl_files_from_the_installed_package_split_one_by_one() -> None:
    """configs/bfcl.yaml's data: both files read from bfcl-eval, each split on its own (sizes per file, seeded), ground
    truth from possible_answer/; adding a file leaves the other's split as it was alone."""
    both = FncallEnv(BFCL_FILES, n_train=104, n_dev=32, n_test=64)
    counts = {s: Counter(t.metadata["category"] for t in both.tasks(s)) for s in SPLITS}
    assert counts == {
        "train": {"simple_python": 104, "multiple": 104},
        "dev": {"simple_python": 32, "multiple": 32},
        "test": {"simple_python": 64, "multiple": 64},
    }
    ids = [t.id for s in SPLITS for t in both.tasks(s)]
    assert len(ids) == len(set(ids)) == 400
    first = Counter(t.metadata["category"] for t in both.tasks("dev")[:10])  # a stage reading 10 sees both files
    assert first == {"simple_python": 5, "multiple": 5}
    again = FncallEnv(list(reversed(BFCL_FILES)), n_train=104, n_dev=32, n_test=64)
    assert {t.id for t in again.tasks("test")} == {t.id for t in both.tasks("test")}
    answers = _json_lines(Path(both.paths[0]).parent / "possible_answer" / "BFCL_v4_simple_python.json")
    task = both.tasks("test")[0]
    assert task.goal["ground_truth"] == answers[task.metadata["bfcl_id"]]["ground_truth"]
    ((name, params),) = task.goal["ground_truth"][0].items()
    call = (both.start(task).tool_of[name], {p: values[0] for p, values in params.items() if values[0] != ""})
    assert _score(both, task, call)[0] == 1.0


def _json_lines(path: Path) -> dict[str, Any]:
    """A BFCL file's lines by id."""
    return {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}


def test_a_package_file_that_is_missing_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the package 'no_such_pkg' is not installed; install it with pip install"):
        FncallEnv("no_such_pkg:data/x.json")
    with pytest.raises(ValueError, match=r"installed package 'bfcl_eval' has no file data/nope.json"):
        FncallEnv("bfcl_eval:data/nope.json")
    with pytest.raises(ValueError, match="answers names one file, for one data file"):
        FncallEnv(BFCL_FILES, answers=tmp_path / "a.json")
