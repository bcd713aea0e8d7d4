"""OpenAIPolicy against a local server that errors, hangs or drops connections: the client's retries counted and
timed, the server's Retry-After and x-should-retry obeyed."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import rollout
from autoevolve.policy import ChatRequest
from autoevolve.policy.openai import OpenAIPolicy
from tests.policy.fake_http import JSONHandler, chat_completion, serving

TIMEOUT_S = 2.0  # generous: a loaded 2-core machine once took over 0.5 s to answer a plain 422
HANG_S = 8.0  # well past TIMEOUT_S; the hanging handler is released at teardown
HEADERED = {  # failure modes whose answer carries a header the client must obey
    "after": (429, {"Retry-After": "1"}),
    "noretry": (500, {"x-should-retry": "false"}),
    "retry": (400, {"x-should-retry": "true"}),
}


class Fake:
    """What the fake server was told and what it saw.

    The model name says how to fail: ``"<mode>:<n>"`` fails the first n calls of each request (keyed by its last
    message) with mode ``500``/``400``/``429``/... (that status), ``hang`` (no answer for HANG_S) or ``drop``
    (close the socket unanswered), ``after`` (429 with ``Retry-After: 1``), ``noretry`` (500 with
    ``x-should-retry: false``) or ``retry`` (400 with ``x-should-retry: true``); then it answers. A request whose
    messages contain a ``doomed`` text always gets a 500, one with an ``echo_key`` text a 401 showing the key it
    was sent. ``script`` maps a user request to its first reply; later turns get "Booked!".
    """

    def __init__(self) -> None:
        self.hits: Counter[tuple[str, str]] = Counter()
        self.doomed: set[str] = set()
        self.echo_key: set[str] = set()
        self.script: dict[str, str] = {}
        self.released = threading.Event()
        self.lock = threading.Lock()


@pytest.fixture(scope="module")
def fake():
    """A ThreadingHTTPServer serving /v1/chat/completions as told by a Fake; yields (base url, fake)."""
    state = Fake()

    class Handler(JSONHandler):
        def do_POST(self) -> None:
            body = self.read_json()
            messages = body["messages"]
            key = (body["model"], messages[-1]["content"])
            with state.lock:
                state.hits[key] += 1
                hit = state.hits[key]
            mode, _, n = body["model"].partition(":")
            if any(k in m["content"] for k in state.echo_key for m in messages):  # a server that shows the key
                return self._send(401, {"error": {"message": f"invalid key {self.headers.get('Authorization')}"}})
            if any(d in m["content"] for d in state.doomed for m in messages):
                return self._send(500, {"error": {"message": "doomed"}})
            if n and hit <= int(n):
                if mode == "hang":
                    state.released.wait(HANG_S)
                elif mode in HEADERED:
                    status, headers = HEADERED[mode]
                    return self._send(status, {"error": {"message": f"told to answer {mode}"}}, headers)
                elif mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)  # no status line: the client sees a disconnect
                    return
                else:
                    return self._send(int(mode), {"error": {"message": f"told to answer {mode}"}})
            users = [m for m in messages if m["role"] != "system"]
            text = state.script.get(users[0]["content"], "ok") if len(users) == 1 else "Booked!"
            self._send(200, chat_completion(body["model"], {"role": "assistant", "content": text}, 7, 3))

    with serving(Handler) as url:
        try:
            yield url, state
        finally:
            state.released.set()  # a handler still hanging returns before the server shuts down


def _policy(url: str, **kwargs) -> OpenAIPolicy:
    """A policy with a small timeout (the client's backoff starts at 0.5 s, doubling, jittered down by up to 25%)."""
    settings = {"concurrency": 4, "timeout_s": TIMEOUT_S, "max_retries": 2} | kwargs
    return OpenAIPolicy("base-model", url, **settings)


def _requests(tag: str, n: int = 1) -> list[ChatRequest]:
    """n requests with distinct texts, so the server counts each one's attempts apart."""
    return [ChatRequest(messages=[{"role": "user", "content": f"{tag} #{i}"}], max_new_tokens=4) for i in range(n)]


def _hits(fake: Fake, model: str, requests: list[ChatRequest]) -> list[int]:
    """Server hits of each request under a model name."""
    return [fake.hits[(model, r.messages[-1]["content"])] for r in requests]


def test_transient_500s_are_retried_and_backoff_waits(fake) -> None:
    url, state = fake
    policy, requests = _policy(url, max_retries=3), _requests("transient", 3)
    started = time.perf_counter()
    completions = policy.generate(requests, "500:3")
    elapsed = time.perf_counter() - started
    assert _hits(state, "500:3", requests) == [4, 4, 4]  # 1 + 3 retries each
    assert [c.error for c in completions] == ["", "", ""] and [c.text for c in completions] == ["ok"] * 3
    assert [c.completion_tokens for c in completions] == [3, 3, 3]
    assert policy.stats == {"requests": 3, "retries": 9, "failed": 0}
    waits = 0.75 * (0.5 + 1.0 + 2.0)  # the shortest the three jittered waits can be
    assert waits <= elapsed < 3 * waits  # the requests wait side by side, not one after another
    assert all(c.latency_s >= 0.75 * 3.5 for c in completions)  # a request's latency includes its waits


def test_the_servers_retry_headers_are_obeyed(fake) -> None:
    url, state = fake
    policy = _policy(url)
    started = time.perf_counter()
    [waited] = policy.generate(_requests("retry after"), "after:1")
    elapsed = time.perf_counter() - started
    assert waited.text == "ok" and 1.0 <= elapsed < 1.0 + 1.5  # Retry-After: 1, not the 0.5 s backoff
    [stopped] = policy.generate(_requests("should not"), "noretry:1")
    assert stopped.error.startswith("InternalServerError after 1 attempt: Error code: 500")
    [again] = policy.generate(_requests("should"), "retry:1")
    assert again.text == "ok" and _hits(state, "retry:1", _requests("should")) == [2]
    assert policy.stats == {"requests": 3, "retries": 2, "failed": 1}


def test_one_client_serves_every_batch(fake) -> None:
    url, _ = fake
    policy = _policy(url)
    policy.generate(_requests("first"))
    client = policy._client
    policy.generate(_requests("second", 3))
    assert policy._client is client and policy.stats == {"requests": 4, "retries": 0, "failed": 0}
    policy.close()
    assert policy.generate(_requests("after close"))[0].text == "ok" and policy._client is not client


def test_persistent_500_fails_after_every_attempt(fake) -> None:
    url, state = fake
    policy, requests = _policy(url), _requests("persistent", 2)
    completions = policy.generate(requests, "500:99")
    assert _hits(state, "500:99", requests) == [3, 3]
    assert all(c.error.startswith("InternalServerError after 3 attempts: Error code: 500") for c in completions)
    assert all("told to answer 500" in c.error and c.text == "" for c in completions)
    assert policy.stats == {"requests": 2, "retries": 4, "failed": 2}


@pytest.mark.parametrize(
    ("status", "hits", "error"),
    [
        (400, 1, "BadRequestError after 1 attempt: Error code: 400"),
        (401, 1, "AuthenticationError after 1 attempt: Error code: 401"),
        (404, 1, "NotFoundError after 1 attempt: Error code: 404"),
        (422, 1, "UnprocessableEntityError after 1 attempt: Error code: 422"),
        (408, 2, ""),
        (409, 2, ""),
        (429, 2, ""),
        (502, 2, ""),
        (503, 2, ""),
    ],
)
def test_only_transient_statuses_are_retried(fake, status: int, hits: int, error: str) -> None:
    url, state = fake
    policy, requests = _policy(url), _requests(f"status {status}")
    [completion] = policy.generate(requests, f"{status}:1")  # fails once, then would succeed
    assert _hits(state, f"{status}:1", requests) == [hits]
    assert completion.error.startswith(error) and (completion.text == "ok") == (error == "")
    assert policy.stats == {"requests": 1, "retries": hits - 1, "failed": int(bool(error))}


def test_no_retries_when_max_retries_is_zero(fake) -> None:
    url, state = fake
    policy, requests = _policy(url, max_retries=0), _requests("no retries")
    [completion] = policy.generate(requests, "503:1")
    assert _hits(state, "503:1", requests) == [1]
    assert completion.error.startswith("InternalServerError after 1 attempt: Error code: 503")
    assert policy.stats == {"requests": 1, "retries": 0, "failed": 1}


def test_a_hang_is_cut_at_the_timeout_then_retried(fake) -> None:
    url, state = fake
    policy, requests = _policy(url, max_retries=1), _requests("hang once", 2)
    started = time.perf_counter()
    completions = policy.generate(requests, "hang:1")
    elapsed = time.perf_counter() - started
    assert _hits(state, "hang:1", requests) == [2, 2]
    assert [c.text for c in completions] == ["ok", "ok"] and policy.stats["retries"] == 2
    assert TIMEOUT_S + 0.05 <= elapsed < TIMEOUT_S + 1.0 < HANG_S  # cut at the timeout, not at the server's whim


def test_a_server_that_always_hangs_times_out_every_attempt(fake) -> None:
    url, state = fake
    policy, requests = _policy(url, max_retries=1), _requests("hang always")
    started = time.perf_counter()
    [completion] = policy.generate(requests, "hang:99")
    elapsed = time.perf_counter() - started
    assert _hits(state, "hang:99", requests) == [2]
    assert completion.error == "APITimeoutError after 2 attempts: Request timed out."
    assert 2 * TIMEOUT_S + 0.05 <= elapsed < 2 * TIMEOUT_S + 1.0
    assert policy.stats == {"requests": 1, "retries": 1, "failed": 1}


def test_dropped_connections_are_retried(fake) -> None:
    url, state = fake
    policy, requests = _policy(url), _requests("drop twice", 2)
    completions = policy.generate(requests, "drop:2")
    assert _hits(state, "drop:2", requests) == [3, 3]
    assert [c.text for c in completions] == ["ok", "ok"]
    [lost] = policy.generate(_requests("drop always"), "drop:99")
    assert _hits(state, "drop:99", _requests("drop always")) == [3]
    assert lost.error == "APIConnectionError after 3 attempts: Connection error."
    assert policy.stats == {"requests": 3, "retries": 6, "failed": 1}  # cumulative over both calls


def test_a_refused_connection_is_retried_then_reported() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = _policy(f"http://127.0.0.1:{port}/v1")
    completions = policy.generate(_requests("refused", 2))
    assert [c.error for c in completions] == ["APIConnectionError after 3 attempts: Connection error."] * 2
    assert policy.stats == {"requests": 2, "retries": 4, "failed": 2}


def test_rollout_turns_permanent_failures_into_zero_reward_trajectories(fake) -> None:
    url, state = fake
    env, hcp = LifeEnv(tiers=(1,)), HCPConfig.from_yaml("prompts/life.yaml")
    tasks = [t for t in env.tasks("train") if t.goal["kind"] == "table"][:5]
    for t in tasks:
        g = t.goal
        args = {"restaurant_id": g["restaurant_id"], "party_size": g["party_size"], "time": g["time"]}
        state.script[t.request] = json.dumps({"name": "book_table", "arguments": args})
    state.doomed |= {tasks[1].request, tasks[3].request}
    policy = _policy(url, max_retries=2)
    # "503:1": every request's first attempt fails once, so the healthy tasks pass only through a retry.
    trajs = rollout(policy, env, hcp, tasks, run_id="faults", adapter="503:1")
    failed = [t for t in trajs if t.error]
    assert [t.task_id for t in failed] == [tasks[1].id, tasks[3].id]
    assert all(t.error.startswith("backend error: InternalServerError after 3 attempts") for t in failed)
    assert all(t.reward == 0.0 and "doomed" in t.error and len(t.messages) == 1 for t in failed)
    fine = [t for t in trajs if not t.error]
    assert [t.reward for t in fine] == [1.0, 1.0, 1.0]
    assert all([m.role for m in t.messages] == ["user", "assistant", "tool", "assistant"] for t in fine)
    # Step 1: 5 requests, 3 healthy (2 attempts each) + 2 doomed (3 each); step 2: 3 healthy, 2 attempts each.
    assert policy.stats == {"requests": 5 + 3, "retries": 3 + 2 * 2 + 3, "failed": 2}
