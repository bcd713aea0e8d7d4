"""LifeEnv: seeded splits, tool behaviour, the fixed scorer, and gold references that score 1.0."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from autoevolve.envs.life import LifeEnv, LifeEpisode
from autoevolve.records import Message, Task, ToolCall

SPLITS = ("train", "dev", "test")


@pytest.fixture(scope="module")
def env() -> LifeEnv:
    """The default environment, built once for the module."""
    return LifeEnv(seed=0)


def _first(env: LifeEnv, tier: int, kind: str, split: str = "train") -> Task:
    """The first task of a tier and goal kind."""
    return next(t for t in env.tasks(split) if t.tier == tier and t.goal["kind"] == kind)


def _replay(env: LifeEnv, task: Task, messages: list[Message]) -> LifeEpisode:
    """Run a conversation's tool calls through a fresh episode."""
    episode = env.start(task)
    for message in messages:
        for call in message.tool_calls:
            episode.call(call.name, call.arguments)
    return episode


def _book(env: LifeEnv, task: Task, args: dict, reply: str = "Done.") -> tuple[float, str]:
    """Score a one-call conversation: book_table with the given arguments, then a reply."""
    episode = env.start(task)
    episode.call("book_table", args)
    messages = [
        Message(role="user", content=task.request),
        Message(role="assistant", tool_calls=[ToolCall.make("call_1", "book_table", args)]),
        Message(role="assistant", content=reply),
    ]
    return episode.score(messages)


def _error(episode: LifeEpisode, name: str, args: dict) -> str:
    """The error text of a tool result that must be an error."""
    result = json.loads(episode.call(name, args))
    assert set(result) == {"error"}
    return result["error"]


def test_splits_disjoint_and_deterministic(env: LifeEnv) -> None:
    """Same seed, same tasks; no id or request text shared across splits; another seed differs."""
    twin, other = LifeEnv(seed=0), LifeEnv(seed=1)
    for split in SPLITS:
        assert [t.model_dump() for t in env.tasks(split)] == [t.model_dump() for t in twin.tasks(split)]
        assert env.tasks(split) == env.tasks(split)
    ids = [t.id for s in SPLITS for t in env.tasks(s)]
    requests = [t.request for s in SPLITS for t in env.tasks(s)]
    assert len(ids) == len(set(ids)) == 416
    assert len(requests) == len(set(requests)) == 416
    theirs = {t.request for s in SPLITS for t in other.tasks(s)}
    assert len(set(requests) & theirs) < 20
    assert env.tasks("train")[0].id == "life-1-00054"  # test takes 0-31 and dev 32-53 of tier 1 first


def test_task_records(env: LifeEnv) -> None:
    """Tasks carry the env name, their split, a tier-tagged id and harmless metadata."""
    for split in SPLITS:
        for task in env.tasks(split):
            assert task.env == "life" and task.split == split
            assert task.id.startswith(f"life-{task.tier}-") and len(task.id) == len("life-1-00042")
            assert task.metadata["today"] == "2026-12-01" and task.metadata["user"]


def test_tier_mix(env: LifeEnv) -> None:
    """Each split holds the tiers in near-equal parts; tier 1 mixes all four tools."""
    counts = {s: Counter(t.tier for t in env.tasks(s)) for s in SPLITS}
    assert counts == {
        "train": {1: 86, 2: 85, 3: 85},
        "dev": {1: 22, 2: 21, 3: 21},
        "test": {1: 32, 2: 32, 3: 32},
    }
    kinds = Counter(t.goal["kind"] for t in env.tasks("train") if t.tier == 1)
    assert set(kinds) == {"table", "ride", "event", "hotel"}
    assert kinds["table"] > kinds["ride"] >= 15
    only_one = LifeEnv(tiers=(1,), n_train=10, n_dev=5, n_test=5)
    assert {t.tier for s in SPLITS for t in only_one.tasks(s)} == {1}
    assert [len(only_one.tasks(s)) for s in SPLITS] == [10, 5, 5]


def test_held_out_splits_ignore_n_train(env: LifeEnv) -> None:
    """Growing the train split leaves dev and test as they were."""
    bigger = LifeEnv(seed=0, n_train=300)
    for split in ("dev", "test"):
        assert [t.request for t in bigger.tasks(split)] == [t.request for t in env.tasks(split)]


@pytest.mark.parametrize("tier", [1, 2, 3])
def test_every_train_reference_scores_one(env: LifeEnv, tier: int) -> None:
    """Each gold conversation, replayed through a fresh episode, scores exactly 1.0 with no feedback."""
    tasks = [t for t in env.tasks("train") if t.tier == tier]
    assert len(tasks) >= 85
    for task in tasks:
        reference = env.reference(task)
        assert reference is not None and reference[0].role == "user" and reference[0].content == task.request
        calls = [c for m in reference for c in m.tool_calls]
        assert len(calls) == (1 if tier == 1 else 2)
        assert [c.id for c in calls] == [f"call_{i}" for i in range(1, len(calls) + 1)]
        episode = env.start(task)
        results = [m.content for m in reference if m.role == "tool"]
        assert [episode.call(c.name, c.arguments) for c in calls] == results
        assert "error" not in json.loads(results[-1])
        assert reference[-1].role == "assistant" and not reference[-1].tool_calls and reference[-1].content
        assert episode.score(reference) == (1.0, "")


def test_tier2_search_has_one_match_and_tier3_a_unique_winner(env: LifeEnv) -> None:
    """Tier-2 constraints pin one restaurant; tier-3 winners are unique and bookable at the asked time."""
    for task in env.tasks("train"):
        goal = task.goal
        if task.tier == 2 and goal["kind"] == "table":
            assert [r.id for r in env.world.find_restaurants(**goal["search"])] == [goal["restaurant_id"]]
        if task.tier == 3 and goal["kind"] == "table":
            found = env.world.find_restaurants(**goal["search"])
            winner = env.world.restaurant(goal["restaurant_id"])
            assert len(found) >= 2 and winner in found and winner.is_open(goal["time"])
            if goal["why"] == "the best-rated match":
                assert sum(r.rating >= winner.rating for r in found) == 1
            else:
                assert sum(r.price <= winner.price for r in found) == 1


def test_wrong_party_size_gets_partial_credit(env: LifeEnv) -> None:
    """Right restaurant and time but the wrong party size: 4 of 5 conditions, feedback names the expected size."""
    task = _first(env, 1, "table")
    goal = task.goal
    wrong = goal["party_size"] % 8 + 1
    reward, feedback = _book(
        env, task, {"restaurant_id": goal["restaurant_id"], "party_size": wrong, "time": goal["time"]}
    )
    assert 0.0 < reward < 1.0 and reward == pytest.approx(0.8)
    assert feedback == f"Expected party_size {goal['party_size']}, got {wrong}."


def test_no_booking_scores_zero(env: LifeEnv) -> None:
    """Nothing booked scores 0 even with a polite reply, and feedback says what was expected."""
    task = _first(env, 1, "table")
    episode = env.start(task)
    reward, feedback = episode.score([Message(role="user", content=task.request)])
    assert reward == 0.0
    assert f"Expected a table at {task.goal['restaurant_id']} ({task.goal['name']}); none was booked." in feedback
    assert "Expected a final reply to the user" in feedback
    replied, _ = episode.score([Message(role="user", content=task.request), Message(role="assistant", content="No.")])
    assert replied == 0.0


def test_wrong_restaurant_is_an_extra_booking(env: LifeEnv) -> None:
    """Booking another restaurant scores 0 and is named as not asked for."""
    task = _first(env, 2, "table")
    goal = task.goal
    other = next(r for r in env.world.restaurants if r.id != goal["restaurant_id"] and r.is_open(goal["time"]))
    reward, feedback = _book(
        env, task, {"restaurant_id": other.id, "party_size": goal["party_size"], "time": goal["time"]}
    )
    assert reward == 0.0
    assert f"a table at {other.id} ({other.name})" in feedback and "not asked for" in feedback


def test_tier3_reply_must_name_the_choice(env: LifeEnv) -> None:
    """A tier-3 booking that is right but unnamed in the reply loses only the naming condition."""
    task = _first(env, 3, "table")
    reference = env.reference(task)
    assert reference is not None
    unnamed = [*reference[:-1], Message(role="assistant", content="Done, booked it.")]
    reward, feedback = _replay(env, task, unnamed).score(unnamed)
    assert reward == pytest.approx(5 / 6)
    assert feedback == f"Expected the reply to name {task.goal['name']}."
    ends_on_call = reference[:-1]
    reward, feedback = _replay(env, task, ends_on_call).score(ends_on_call)
    assert reward == pytest.approx(4 / 6) and "Expected a final reply" in feedback


def test_domain_errors_are_json_results(env: LifeEnv) -> None:
    """Unknown ids, closed hours, oversize parties and bad formats come back as {'error': ...} and book nothing."""
    task = _first(env, 1, "table")
    episode = env.start(task)
    restaurant = env.world.restaurant(task.goal["restaurant_id"])
    assert restaurant is not None
    cases = {
        "unknown restaurant id 'R-999'": {"restaurant_id": "R-999", "party_size": 2, "time": "19:00"},
        "is closed at 03:00": {"restaurant_id": restaurant.id, "party_size": 2, "time": "03:00"},
        "is larger than": {"restaurant_id": restaurant.id, "party_size": restaurant.seats + 1, "time": "19:00"},
        "time must be HH:MM": {"restaurant_id": restaurant.id, "party_size": 2, "time": "7pm"},
        "party_size must be": {"restaurant_id": restaurant.id, "party_size": [2], "time": "19:00"},
    }
    for expected, args in cases.items():
        assert expected in _error(episode, "book_table", args)
    stay = {"hotel_id": "H-1", "check_in": "2026-12-05", "nights": 1, "guests": 1}
    assert _error(episode, "book_hotel", stay) == "unknown hotel id 'H-1'"
    past = stay | {"hotel_id": "H-201", "check_in": "2026-11-30"}
    assert _error(episode, "book_hotel", past) == "check_in 2026-11-30 is before today (2026-12-01)"
    assert _error(episode, "book_hotel", {"hotel_id": "H-201"}).startswith("check_in must be")
    assert _error(episode, "search_restaurants", {"city": "Atlantis"}).startswith("unknown city 'Atlantis'")
    assert _error(episode, "add_event", "not a dict").startswith("title must be")  # type: ignore[arg-type]
    assert episode.bookings == []


def test_unknown_tool_raises_key_error(env: LifeEnv) -> None:
    """A tool name that does not exist is the caller's problem to record."""
    episode = env.start(env.tasks("train")[0])
    with pytest.raises(KeyError):
        episode.call("order_pizza", {})


def test_tools_accept_lenient_but_exact_values(env: LifeEnv) -> None:
    """'H:MM' times and digit strings are normalised; names compare case-insensitively."""
    task = _first(env, 1, "ride")
    goal = task.goal
    episode = env.start(task)
    args = {"pickup": goal["pickup"].upper(), "dropoff": f" {goal['dropoff']} ", "time": goal["time"]}
    assert json.loads(episode.call("request_ride", args))["booking_id"] == "B-1"
    assert episode.score([Message(role="assistant", content="Booked.")]) == (1.0, "")
    event = json.loads(episode.call("add_event", {"title": "Gym", "date": "2026-12-02", "time": "9:05"}))
    assert event == {"event_id": "E-1", "title": "Gym", "date": "2026-12-02", "time": "09:05"}
    assert _error(episode, "add_event", {"title": "Gym", "date": "2026-12-02", "time": "09:05:00"}).startswith("time")
    found = json.loads(env.start(task).call("search_restaurants", {"city": "lisbon", "max_price": "2"}))
    assert len(found) >= 3 and all(r["price"] <= 2 for r in found)
    assert list(found[0]) == ["id", "name", "cuisine", "price", "rating", "vegetarian", "hours"]


def test_episodes_do_not_share_bookings(env: LifeEnv) -> None:
    """Each episode starts empty, whatever another one booked."""
    task = _first(env, 1, "event")
    first = env.start(task)
    first.call("add_event", {"title": "Gym", "date": "2026-12-02", "time": "07:00"})
    assert len(first.bookings) == 1 and env.start(task).bookings == []


def test_reference_is_none_for_held_out(env: LifeEnv) -> None:
    """Dev and test tasks have no labelled solution."""
    for split in ("dev", "test"):
        assert all(env.reference(t) is None for t in env.tasks(split))


def test_tool_specs_are_openai_function_schemas(env: LifeEnv) -> None:
    """Every spec is a function with an object schema, simple types, and required names that exist."""
    specs = env.tools()
    names = [s["function"]["name"] for s in specs]
    assert names == ["search_restaurants", "book_table", "search_hotels", "book_hotel", "request_ride", "add_event"]
    assert len(set(names)) == len(names)
    for spec in specs:
        assert spec["type"] == "function" and set(spec["function"]) == {"name", "description", "parameters"}
        params = spec["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        assert all(
            p["type"] in {"string", "integer", "boolean"} and p["description"] for p in params["properties"].values()
        )
    specs[0]["function"]["name"] = "changed"
    assert env.tools()[0]["function"]["name"] == "search_restaurants"


def test_bad_options_are_refused() -> None:
    """Unknown tiers and foreign tasks are errors, not silent surprises."""
    with pytest.raises(ValueError):
        LifeEnv(tiers=(4,))
    env = LifeEnv(n_train=3, n_dev=0, n_test=0)
    with pytest.raises(ValueError):
        env.start(env.tasks("train")[0].model_copy(update={"env": "other"}))
