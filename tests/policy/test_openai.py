"""OpenAIPolicy against a local OpenAI-compatible server that generates real tokens with LocalPolicy."""

from __future__ import annotations

import json
import time

import pytest

from autoevolve.policy import ChatRequest
from autoevolve.policy.openai import OpenAIPolicy
from tests.policy.fake_http import JSONHandler, serving


@pytest.fixture(scope="module")
def server(tiny_policy):
    """Serves /v1/chat/completions from the tiny model; model 'fail' answers 500, model 'slow' hangs 3 s."""
    seen: list[dict] = []

    class Handler(JSONHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            if body["model"] == "fail":
                return self._send(500, {"error": {"message": "boom"}})
            if body["model"] == "slow":
                time.sleep(3)
            request = ChatRequest(messages=body["messages"], max_new_tokens=body["max_tokens"])
            [c] = tiny_policy.generate([request])
            message: dict = {"role": "assistant", "content": c.text}
            if body.get("tools"):
                call = {"name": body["tools"][0]["function"]["name"], "arguments": '{"city": "Lisbon"}'}
                message = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "call_9", "type": "function", "function": call}],
                }
            self._send(
                200,
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {
                        "prompt_tokens": c.prompt_tokens,
                        "completion_tokens": c.completion_tokens,
                        "total_tokens": c.prompt_tokens + c.completion_tokens,
                    },
                },
            )

    with serving(Handler) as url:
        yield url, seen


def _policy(url: str, **kwargs) -> OpenAIPolicy:
    return OpenAIPolicy("base-model", url, **({"concurrency": 2, "timeout_s": 30, "max_retries": 0} | kwargs))


def test_same_tokens_as_local_and_adapter_is_the_model_name(server, tiny_policy) -> None:
    url, seen = server
    requests = [ChatRequest(messages=[{"role": "user", "content": f"Hello {i}"}], max_new_tokens=6) for i in range(3)]
    remote = _policy(url).generate(requests, "L1-life@v2")
    local = tiny_policy.generate(requests)
    assert [c.text for c in remote] == [c.text for c in local]
    assert [c.completion_tokens for c in remote] == [c.completion_tokens for c in local]
    assert {b["model"] for b in seen[-3:]} == {"L1-life@v2"}
    assert _policy(url).generate(requests[:1])[0].text == local[0].text and seen[-1]["model"] == "base-model"
    assert not {"top_k", "min_p", "repetition_penalty"} & set(seen[-1])  # vLLM's extras only when set
    _policy(url).generate([requests[0].model_copy(update={"top_k": 5, "repetition_penalty": 1.1})])
    assert (seen[-1]["top_k"], seen[-1]["repetition_penalty"]) == (5, 1.1) and "min_p" not in seen[-1]


def test_native_tool_calls_come_back_structured(server) -> None:
    url, _ = server
    tools = [{"type": "function", "function": {"name": "search_restaurants", "parameters": {"type": "object"}}}]
    [c] = _policy(url).generate([ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)])
    assert c.tool_calls[0].name == "search_restaurants" and c.tool_calls[0].arguments == {"city": "Lisbon"}


def test_server_errors_and_timeouts_are_failed_completions(server) -> None:
    url, seen = server
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4)
    before = len(seen)
    [failed] = _policy(url, max_retries=1).generate([request], "fail")
    assert "500" in failed.error and len(seen) - before == 2  # the first try and one retry
    [slow] = _policy(url, timeout_s=0.5).generate([request], "slow")
    assert "Timeout" in slow.error and slow.text == ""
