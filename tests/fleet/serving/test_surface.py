"""The OpenAI surface beyond chat, on a bare tiny model: text completions, tokenize, metrics; every response read
by the openai package's own types, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest

from autoevolve.fleet.serving.app import create_app
from autoevolve.fleet.serving.startup import open_fleet
from tests.fleet.serving.helpers import running


@pytest.fixture(scope="module")
def bare(tiny_model_dir):
    """The tiny model alone, no registry; yields (base URL, served name, fleet)."""
    from autoevolve.policy.local import LocalPolicy

    fleet = open_fleet(None, LocalPolicy(str(tiny_model_dir), dtype="float32"), say=lambda _: None)
    with running(create_app(fleet)) as url:
        yield url, str(tiny_model_dir), fleet


def _events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_text_completion_continues_the_prompt_as_it_is(bare) -> None:
    from openai import OpenAI
    from openai.types import Completion

    url, name, fleet = bare
    client = OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    ask = {"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    done = Completion.model_validate(httpx.post(f"{url}/v1/completions", json=ask).json(), strict=True)
    assert (
        done.object == "text_completion" and done.id.startswith("cmpl-") and done.choices[0].finish_reason == "length"
    )
    prompt_ids = fleet.tokens("Once upon a time", None, False, False)
    assert done.usage.prompt_tokens == len(prompt_ids) and done.usage.completion_tokens == 8  # no chat template
    two = client.completions.create(**{**ask, "temperature": 1.0}, n=2, seed=3)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 16
    echoed = client.completions.create(echo=True, **ask)
    assert echoed.choices[0].text == "Once upon a time" + done.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8
    stopped = client.completions.create(**{**ask, "max_tokens": 40}, stop=[done.choices[0].text[3:6]])
    assert stopped.choices[0].text == done.choices[0].text[:3] and stopped.choices[0].finish_reason == "stop"
    for bad, param in [
        ({"n": 17}, "n"),
        ({"logprobs": 2, "stream": True}, "logprobs"),
        ({"prompt": ["a", "b"]}, "prompt"),
    ]:
        refused = httpx.post(f"{url}/v1/completions", json={**ask, **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_tokenize_and_detokenize_as_vllm_answers_them(bare) -> None:
    url, name, fleet = bare
    said = httpx.post(f"{url}/tokenize", json={"model": name, "prompt": "Hello world", "add_special_tokens": False})
    ids = fleet.policy.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert said.json() == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
    chat = httpx.post(f"{url}/tokenize", json={"model": name, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > len(fleet.tokens("hi", None, False, False))  # the chat template's tokens around it
    back = httpx.post(f"{url}/detokenize", json={"model": name, "tokens": ids})
    assert back.json() == {"prompt": "Hello world"}
    for route, body, param in [
        ("/detokenize", {"model": name, "tokens": [10**9]}, "tokens"),
        ("/tokenize", {"model": name}, "prompt"),
        ("/tokenize", {"model": "nobody", "prompt": "x"}, "model"),
    ]:
        refused = httpx.post(f"{url}{route}", json=body)
        assert refused.status_code in (400, 404) and refused.json()["error"]["param"] == param


def test_metrics_count_requests_tokens_and_times_per_served_name(bare) -> None:
    url, name, _ = bare
    before = _metric(httpx.get(f"{url}/metrics").text, "autoevolve:generation_tokens_total", name)
    ask = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
    httpx.post(f"{url}/v1/chat/completions", json=ask)
    httpx.post(f"{url}/v1/chat/completions", json={**ask, "stream": True})
    httpx.post(f"{url}/v1/chat/completions", json={**ask, "model": "nobody"})
    shown = httpx.get(f"{url}/metrics")
    assert shown.headers["content-type"].startswith("text/plain")
    text = shown.text
    assert _metric(text, "autoevolve:generation_tokens_total", name) - before == 10
    assert _metric(text, "autoevolve:request_success_total", name, 'finished_reason="length"') >= 2
    assert _metric(text, "autoevolve:request_success_total", "nobody", 'finished_reason="error"') == 1
    assert _metric(text, "autoevolve:time_to_first_token_seconds_count", name) >= 2
    assert "autoevolve:num_requests 0.0" in text


def test_every_response_reads_as_the_openai_packages_types(bare) -> None:
    from openai.types import Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    url, name, _ = bare
    ask = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ChatCompletion.model_validate(httpx.post(f"{url}/v1/chat/completions", json=ask).json(), strict=True)
    streamed = httpx.post(f"{url}/v1/chat/completions", json={**ask, "stream": True})
    for chunk in _events(streamed):
        ChatCompletionChunk.model_validate(chunk, strict=True)
    for card in httpx.get(f"{url}/v1/models").json()["data"]:
        Model.model_validate(card, strict=True)
    Model.model_validate(httpx.get(f"{url}/v1/models/{name}").json(), strict=True)


def test_response_format_holds_the_reply_to_its_json_schema(bare) -> None:
    url, name, _ = bare
    size = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}}, "required": ["size"]}
    size["additionalProperties"] = False
    ask = {"model": name, "messages": [{"role": "user", "content": "Which car?"}], "max_tokens": 40, "seed": 1}
    shaped = {"type": "json_schema", "json_schema": {"name": "car", "schema": size}}
    for stream in (False, True):
        answer = httpx.post(f"{url}/v1/chat/completions", json={**ask, "response_format": shaped, "stream": stream})
        if stream:
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in _events(answer) if c["choices"])
        else:
            text = answer.json()["choices"][0]["message"]["content"]
        assert json.loads(text)["size"] in ("small", "large")  # a random model, held to the schema
    free = httpx.post(f"{url}/v1/chat/completions", json=ask).json()["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(free)  # without it, the same model writes no JSON
    for bad, said in [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema with json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "JSON schema does not compile"),
        ({"type": "yaml"}, "text, json_object, or json_schema"),
    ]:
        refused = httpx.post(f"{url}/v1/chat/completions", json={**ask, "response_format": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
        assert said in refused.json()["error"]["message"]


def test_log_probabilities_of_each_generated_token_and_its_likeliest_alternatives(bare) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    url, name, fleet = bare
    hi = [{"role": "user", "content": "Tell me about tea."}]
    ask = {"model": name, "messages": hi, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    chat = ChatCompletion.model_validate(httpx.post(f"{url}/v1/chat/completions", json=ask).json(), strict=True)
    scored = chat.choices[0].logprobs.content
    assert len(scored) == chat.usage.completion_tokens == 6
    assert "".join(s.token for s in scored) == chat.choices[0].message.content
    for s in scored:  # greedy: each token is the likeliest, and its log-probability is the top one's
        assert len(s.top_logprobs) == 3 and s.token == s.top_logprobs[0].token and s.logprob <= 0
        assert s.logprob == s.top_logprobs[0].logprob >= s.top_logprobs[1].logprob >= s.top_logprobs[2].logprob
        assert bytes(s.bytes).decode() == s.token
    plain = httpx.post(f"{url}/v1/chat/completions", json={**ask, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["message"]["content"] == "".join(
        s.token for s in scored
    )  # the same reply with and without them
    text = {"model": name, "prompt": "Tea is", "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    done = Completion.model_validate(httpx.post(f"{url}/v1/completions", json=text).json(), strict=True)
    legacy = done.choices[0].logprobs
    assert len(legacy.tokens) == 5 and legacy.text_offset[0] == len("Tea is")
    assert done.choices[0].text == "Tea is" + "".join(legacy.tokens)
    assert all(len(top) == 2 for top in legacy.top_logprobs) and all(lp <= 0 for lp in legacy.token_logprobs)


def _metric(text: str, metric: str, model: str, extra: str = "") -> float:
    """The value of one sample of the exposition (0 when it is not there)."""
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'model_name="{model}"' in line and extra in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_strict_tool_under_auto_holds_a_call_to_its_schema_and_leaves_text_free(bare) -> None:
    from autoevolve.fleet.serving.calls import harnessed_call
    from autoevolve.fleet.serving.wire import ChatBody, conversation

    url, name, _ = bare
    size = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}}, "required": ["size"]}
    pick = {"name": "pick_car", "parameters": size}
    hi = [{"role": "user", "content": "Which car?"}]

    def constraint(**body):  # noqa: ANN003, ANN202
        history, system = conversation(hi)
        return harnessed_call(None, ChatBody(model=name, messages=hi, **body), history, system, None)[0].constrain

    strict = [{"type": "function", "function": {**pick, "strict": True}}]
    assert constraint(tools=strict).or_text and constraint(tools=strict, tool_choice="auto").tools == strict
    assert constraint(tools=[{"type": "function", "function": pick}]) is None  # not strict: checked once written
    assert (
        not constraint(tools=strict, tool_choice="required").or_text
        and constraint(tools=strict, tool_choice="none") is None
    )
    ask = {"model": name, "messages": hi, "tools": strict, "max_tokens": 12, "temperature": 1.0, "n": 4, "seed": 5}
    answer = httpx.post(f"{url}/v1/chat/completions", json=ask)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 4
    for choice in answer.json()["choices"]:
        message = choice["message"]
        if message.get("tool_calls"):
            assert json.loads(message["tool_calls"][0]["function"]["arguments"])["size"] in ("small", "large")
        else:
            assert message["content"].strip() and message["content"].lstrip()[0] not in "{["
