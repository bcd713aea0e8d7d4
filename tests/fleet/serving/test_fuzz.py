"""Request bodies drawn at random from the routes' fields (good values, wrong types, nonsense): the server answers
each with a reply or OpenAI's error object, never a 500, never hangs, and still answers a plain request after."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoevolve.fleet.serving.app import create_app
from autoevolve.fleet.serving.startup import open_fleet
from autoevolve.harness.hcp import HCPConfig
from autoevolve.store import Store
from tests.fleet.serving.helpers import random_adapter, registered, running

LIFE = HCPConfig.from_yaml("prompts/life.yaml")

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot", "", None])
CALL = st.fixed_dictionaries(
    {"id": JSON | st.just("call_1"), "type": st.just("function"), "function": JSON | st.fixed_dictionaries(
        {"name": st.text(max_size=8) | JSON, "arguments": JSON | st.just('{"a": 1}')}
    )},
)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.text(max_size=30) | JSON | st.lists(st.fixed_dictionaries({"type": JSON, "text": JSON})),
        "tool_calls": st.lists(CALL, max_size=2) | JSON,
        "tool_call_id": st.just("call_1") | JSON,
        "name": JSON,
    },
)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function") | JSON, "function": JSON | st.fixed_dictionaries(
        {"name": st.text(min_size=1, max_size=8), "parameters": JSON | st.just({"type": "object", "properties": {}})}
    )},
)  # fmt: skip
FORMAT = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
    optional={"json_schema": st.fixed_dictionaries({}, optional={"name": JSON, "schema": JSON})},
)
LIMIT = st.sampled_from([-1, 0, 1, 3, 10**13, "8", 1.5, True, [], {}])  # never a long generation
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=4) | JSON, "max_tokens": LIMIT},
    optional={
        "tools": st.lists(TOOL, max_size=2) | JSON,
        "tool_choice": st.sampled_from(["none", "auto", "required", "x"]) | JSON,
        "temperature": JSON,
        "top_p": JSON,
        "seed": JSON,
        "stop": JSON,
        "stream": st.booleans() | JSON,
        "stream_options": JSON,
        "metadata": JSON,
        "n": JSON,
        "logprobs": JSON,
        "response_format": JSON | FORMAT,
        "parallel_tool_calls": JSON,
        "max_completion_tokens": LIMIT,
        "top_k": JSON,
    },
)
TEXT = st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | JSON, "max_tokens": LIMIT},
    optional={"echo": JSON, "stop": JSON, "stream": st.booleans(), "suffix": JSON, "best_of": JSON, "seed": JSON},
)
TOKENS = st.fixed_dictionaries({}, optional={"prompt": JSON, "messages": JSON, "tokens": JSON})
ROUTES = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), CHAT),
    st.tuples(st.just("/v1/completions"), TEXT),
    st.tuples(st.sampled_from(["/tokenize", "/detokenize"]), TOKENS),
)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """The tiny model and an expert L1-life (a random adapter under the life harness) and L0-chat, so the router."""
    from autoevolve.policy.local import LocalPolicy

    base, root = str(tiny_model_dir), tmp_path_factory.mktemp("fuzz")
    with Store(root / "s.duckdb") as store:
        registered(store, "L1-life", random_adapter(base, root / "L1-life-v1", 1, base), base, LIFE)
        chat = HCPConfig.from_yaml("prompts/router.yaml")
        registered(store, "L0-chat", random_adapter(base, root / "L0-chat-v1", 2, base), base, chat, tier=0)
    fleet = open_fleet(root / "s.duckdb", LocalPolicy(base, dtype="float32"), say=lambda _: None)
    assert fleet.entry == "L0-chat"
    with running(create_app(fleet)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, base


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=ROUTES, model=st.sampled_from(["base", "L1-life", "router", "L0-chat", "nobody", ""]) | JSON)
def test_no_body_breaks_the_server(served, route, model) -> None:
    client, base = served
    path, body = route
    answer = client.post(path, json={"model": base if model == "base" else model, **body})
    assert answer.status_code < 500, answer.text
    if answer.status_code >= 400:
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif "text/event-stream" in answer.headers["content-type"]:
        assert answer.text.endswith("data: [DONE]\n\n")


def test_the_server_answers_after_the_fuzz(served) -> None:
    client, name = served
    ok = client.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
