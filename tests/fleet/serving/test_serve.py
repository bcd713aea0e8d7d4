"""autoevolve serve on a tiny random model: the openai client, curl, parity with training, hot swap under load."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from autoevolve.fleet.serving.app import create_app
from autoevolve.fleet.serving.runtime_lora import RuntimeLoRA
from autoevolve.fleet.serving.startup import open_fleet, recorded_folders
from autoevolve.harness.hcp import HCPConfig
from autoevolve.store import Store
from tests.conftest import random_llama
from tests.fleet.serving.helpers import random_adapter, registered, running

LIFE = HCPConfig.from_yaml("prompts/life.yaml")


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory, tokenizer) -> Path:
    """A two-layer random Llama with large weights: its next-token choices are far apart, so batching (float
    rounding) never changes a greedy answer, and adapters change it visibly."""
    return random_llama(tmp_path_factory.mktemp("peaked"), tokenizer, seed=1, initializer_range=0.5)


@pytest.fixture(scope="module")
def registry_store(tmp_path_factory, peaked_dir) -> Path:
    """A registry with expert L1-life at three versions (v3 live), each a random adapter trained under LIFE."""
    root = tmp_path_factory.mktemp("registry")
    base = str(peaked_dir)
    with Store(root / "s.duckdb") as store:
        for seed in (1, 2, 3):
            path = random_adapter(base, root / f"L1-life-v{seed}", seed, base)
            registered(store, "L1-life", path, base, LIFE)
    return root / "s.duckdb"


@pytest.fixture(scope="module")
def server(registry_store, peaked_dir):
    """The registry served over HTTP (uvicorn in a thread); yields (base URL, fleet)."""
    from autoevolve.policy.local import LocalPolicy

    policy = LocalPolicy(str(peaked_dir), batch_size=16, dtype="float32")
    fleet = open_fleet(registry_store, policy, say=lambda _: None)
    with running(create_app(fleet, runtime=RuntimeLoRA(recorded_folders(registry_store)))) as url:
        yield url, fleet


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)


def test_models_lists_the_base_each_expert_and_each_version(server, peaked_dir) -> None:
    url, _ = server
    cards = {m.id: m for m in _client(url).models.list().data}
    assert set(cards) == {str(peaked_dir), "L1-life", "L1-life@v1", "L1-life@v2", "L1-life@v3"}
    assert cards["L1-life"].root == cards["L1-life@v3"].root and cards["L1-life"].root.endswith("L1-life-v3")
    assert cards["L1-life"].parent == str(peaked_dir) and cards[str(peaked_dir)].parent is None


def test_a_model_card_is_retrieved_by_its_id_slashes_and_all(server, peaked_dir) -> None:
    import openai

    url, _ = server
    client = _client(url)
    assert client.models.retrieve("L1-life@v2").root.endswith("L1-life-v2")
    assert client.models.retrieve(str(peaked_dir)).parent is None  # a path as the id: slashes and all
    with pytest.raises(openai.NotFoundError, match="'L9-none' is not served here"):
        client.models.retrieve("L9-none")


def test_a_bare_model_is_served_with_no_store(peaked_dir) -> None:
    from autoevolve.policy.local import LocalPolicy

    fleet = open_fleet(None, LocalPolicy(str(peaked_dir), dtype="float32"), say=lambda _: None)
    with running(create_app(fleet)) as url:
        client = _client(url)
        assert [m.id for m in client.models.list().data] == [str(peaked_dir)]
        hi = [{"role": "user", "content": "hi"}]
        answer = client.chat.completions.create(model=str(peaked_dir), messages=hi, max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3 and answer.model == str(peaked_dir)


def test_serve_gives_the_worker_thread_its_compute_threads_and_runs_startup_work_there(peaked_dir) -> None:
    import torch

    from autoevolve.cli_serve import _warm
    from autoevolve.policy.local import LocalPolicy

    fleet = open_fleet(None, policy := LocalPolicy(str(peaked_dir), dtype="float32"), say=lambda _: None)
    here = torch.get_num_threads()
    wanted = 1 if here > 1 else 2
    try:
        _warm(policy, fleet, wanted)
        assert fleet.on_worker(torch.get_num_threads) == wanted and torch.get_num_threads() == here
        assert fleet.on_worker(lambda: threading.current_thread().name) == "autoevolve-fleet"
        with pytest.raises(ZeroDivisionError):
            fleet.on_worker(lambda: 1 / 0)
    finally:
        torch.set_num_threads(here)  # the default threads made later start with


def test_a_served_call_starts_from_the_prompt_prefix_an_earlier_call_computed(peaked_dir) -> None:
    """Prefix caching: a second conversation with the same system prompt reuses the first's keys and values for the
    tokens they share, and replies as a fresh model does."""
    from autoevolve.policy import ChatRequest
    from autoevolve.policy.local import LocalPolicy

    policy = LocalPolicy(str(peaked_dir), dtype="float32")
    fleet = open_fleet(None, policy, say=lambda _: None)
    system = {"role": "system", "content": "You are the front desk of a small hotel by the sea. Answer briefly."}
    turns = [[system, {"role": "user", "content": text}] for text in ("Book a room.", "Where is breakfast?")]
    with running(create_app(fleet)) as url:
        client = _client(url)

        def ask(messages: list[dict]) -> str:
            answer = client.chat.completions.create(
                model=str(peaked_dir), messages=messages, max_tokens=6, temperature=0
            )
            return answer.choices[0].message.content

        ask(turns[0])
        reused = policy.decoder.stats.reused_tokens
        second = ask(turns[1])
    tok = policy.tokenizer
    prompts = [tok(tok.apply_chat_template(t, add_generation_prompt=True, tokenize=False))["input_ids"] for t in turns]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert policy.decoder.stats.reused_tokens - reused >= shared > 20
    fresh = LocalPolicy(str(peaked_dir), dtype="float32")
    assert fresh.generate([ChatRequest(messages=turns[1], max_new_tokens=6, temperature=0)])[0].text == second


def test_the_openai_client_gets_text_tool_calls_and_errors(server) -> None:
    import openai

    url, _ = server
    client = _client(url)
    ask = {"messages": [{"role": "user", "content": "Book a table for 2 in Lisbon."}], "temperature": 0}
    text = client.chat.completions.create(model="L1-life@v1", max_tokens=6, **ask)
    assert text.model == "L1-life@v1" and text.choices[0].finish_reason == "length"
    assert text.usage.completion_tokens == 6 and text.choices[0].message.content
    live = client.chat.completions.create(model="L1-life", max_tokens=6, **ask)
    assert live.model == "L1-life@v3"  # the expert's name serves its live version, and says which
    assert live.choices[0].message.content != text.choices[0].message.content  # another adapter answers
    size = {"type": "string", "enum": ["small", "large"]}
    pick = {"name": "pick_car", "parameters": {"type": "object", "properties": {"size": size}, "required": ["size"]}}
    forced = client.chat.completions.create(
        model="L1-life",
        max_tokens=100,  # an enum's call is short: the grammar closes it well within this
        tools=[*LIFE.tools, {"type": "function", "function": pick}],
        tool_choice={"type": "function", "function": {"name": "pick_car"}},
        **ask,
    )
    assert forced.choices[0].finish_reason == "tool_calls" and forced.choices[0].message.content is None
    [call] = forced.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "pick_car" and re.fullmatch("call_[0-9a-f]{24}", call.id)
    assert json.loads(call.function.arguments)["size"] in ("small", "large")
    with pytest.raises(openai.NotFoundError, match="'L9-none' is not served here"):
        client.chat.completions.create(model="L9-none", max_tokens=4, **ask)
    with pytest.raises(openai.BadRequestError, match="n: several choices are served without stream"):
        client.chat.completions.create(model="L1-life", n=2, max_tokens=4, stream=True, **ask)
    sampled = {**ask, "temperature": 2.0, "seed": 7}  # hot: this peaked model's draws differ
    three = client.chat.completions.create(model="L1-life", n=3, max_tokens=6, **sampled)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 18
    assert len({c.message.content for c in three.choices}) > 1  # three draws, not one thrice
    with pytest.raises(openai.BadRequestError, match="tool_choice: 'book' is not one of the request's tools"):
        client.chat.completions.create(
            model="L1-life", tools=LIFE.tools, tool_choice={"type": "function", "function": {"name": "book"}}, **ask
        )


def test_curl_streams_the_same_reply_as_server_sent_events(server) -> None:
    url, _ = server
    body = {
        "model": "L1-life@v2",
        "messages": [{"role": "user", "content": "Hi there"}],
        "temperature": 0,
        "max_tokens": 12,
        "seed": 3,
    }
    whole = _client(url).chat.completions.create(**body)
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"{url}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    events = [line.removeprefix("data: ") for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["model"] for c in chunks} == {"L1-life@v2"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole.choices[0].message.content and len([c for c in chunks if c["choices"]]) > 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_a_stream_leaves_as_it_is_generated_and_ends_when_its_client_leaves(server) -> None:
    import httpx

    url, fleet = server
    client, stats = _client(url), fleet.policy.decoder.stats
    ask = {"model": "L1-life@v1", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 600}
    ask |= {"temperature": 1.0, "seed": 5}  # sampled: one token a decode step
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 600
    before, calls, seen = stats.decode_tokens, fleet.stats["calls"], []
    stream = client.chat.completions.create(stream=True, **ask)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen.append(stats.decode_tokens - before)  # tokens generated when this piece arrived
        if len(seen) == 3:
            break
    stream.close()  # the client leaves mid-reply
    _until(lambda: fleet.stats["calls"] > calls)
    assert seen[0] < 300, seen  # the first text left long before the reply could have been generated whole
    assert stats.decode_tokens - before < 600  # and generation stopped when the client left
    again = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **ask) if c.choices
    )
    assert again == whole.choices[0].message.content  # streamed in full, the very reply
    before, calls = stats.decode_tokens, fleet.stats["calls"]
    with pytest.raises(httpx.ReadTimeout):  # a client that stops waiting for a reply not streamed
        httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=httpx.Timeout(5, read=0.2))
    _until(lambda: fleet.stats["calls"] > calls)
    assert stats.decode_tokens - before < 600


def test_vllm_sampling_extras_are_honoured(server) -> None:
    """top_k 1 (or min_p 1) at temperature 1 draws the greedy reply; a repetition penalty changes it."""
    url, _ = server
    client = _client(url)
    ask = {"model": "L1-life@v1", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24}
    greedy = client.chat.completions.create(temperature=0, **ask).choices[0].message.content
    sampled = client.chat.completions.create(temperature=1, seed=3, **ask).choices[0].message.content
    for knob in ({"top_k": 1}, {"min_p": 1.0}):
        drawn = client.chat.completions.create(temperature=1, seed=3, extra_body=knob, **ask)
        assert drawn.choices[0].message.content == greedy != sampled
    penalised = client.chat.completions.create(temperature=0, extra_body={"repetition_penalty": 0.2}, **ask)
    assert penalised.choices[0].message.content != greedy


def test_a_request_that_arrives_while_a_batch_decodes_joins_it(server) -> None:
    """Continuous batching: a short request sent while a long reply streams is answered before that reply ends,
    with the very reply it gets alone, and the long reply is the one it is alone too."""
    url, fleet = server
    client = _client(url)
    long = {"model": "L1-life@v1", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 3000}
    short = {"model": "L1-life@v1", "messages": [{"role": "user", "content": "Book a ride."}], "max_tokens": 8}
    whole, alone = client.chat.completions.create(**long), client.chat.completions.create(**short)
    assert whole.usage.completion_tokens == 3000
    joined, pieces, reply = fleet.stats["joined"], [], None
    for chunk in client.chat.completions.create(stream=True, **long):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if reply is None and pieces:
            reply = client.chat.completions.create(**short)  # while the long reply decodes
    assert fleet.stats["joined"] == joined + 1  # it joined the running batch, not a batch of its own after it
    assert reply.choices[0].message.content == alone.choices[0].message.content
    assert "".join(pieces) == whole.choices[0].message.content


def test_a_request_for_another_adapter_joins_the_running_batch(server) -> None:
    """Batches mix adapters: a request for v2 sent while a v1 reply streams joins that batch, under v2's LoRA."""
    url, fleet = server
    client = _client(url)
    long = {"model": "L1-life@v1", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 3000}
    short = {"model": "L1-life@v2", "messages": [{"role": "user", "content": "Book a ride."}], "max_tokens": 8}
    alone, base = (
        client.chat.completions.create(**short),
        client.chat.completions.create(**{**short, "model": "L1-life@v1"}),
    )
    assert alone.choices[0].message.content != base.choices[0].message.content  # the adapters answer apart
    joined, batches, reply = fleet.stats["joined"], fleet.stats["batches"], None
    for chunk in client.chat.completions.create(stream=True, **long):
        if reply is None and chunk.choices and chunk.choices[0].delta.content:
            reply = client.chat.completions.create(**short)
    assert fleet.stats["joined"] == joined + 1 and fleet.stats["batches"] == batches + 1
    assert reply.choices[0].message.content == alone.choices[0].message.content


def _until(done, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done()


def test_served_tokens_equal_the_tokens_stage_3_trained_on(server, peaked_dir) -> None:
    """A conversation sent to L1-life reaches the model as the very token ids distillation trained v3 on."""
    from autoevolve.envs.life import LifeEnv
    from autoevolve.records import Trajectory
    from autoevolve.stages.distill.dataset import native_tools, render_examples, tokenize_with_assistant_mask

    url, fleet = server
    env = LifeEnv(tiers=(2,))
    task = env.tasks("train")[0]
    gold = env.reference(task)  # user, call, result, call, result, answer
    traj = Trajectory(run_id="r", task_id=task.id, split="train", hcp_id=LIFE.id, messages=gold, reward=1.0)
    [example] = render_examples([traj], {task.id: task}, LIFE)
    trained = tokenize_with_assistant_mask(example, fleet.policy.tokenizer, native_tools(LIFE))
    seen: list[list[int]] = []
    generate = fleet.policy.generate

    def spy(requests, adapter=None, **heard):
        seen.extend(fleet.policy._encode_text(r) for r in requests)
        return generate(requests, adapter, **heard)

    fleet.policy.generate = spy
    try:
        turns = [i for i, m in enumerate(gold) if m.role == "assistant"]
        for turn in turns:
            wire = [_wire(m) for m in gold[:turn]]
            _client(url).chat.completions.create(
                model="L1-life", messages=wire, tools=LIFE.tools, metadata=task.metadata, max_tokens=2, temperature=0
            )
    finally:
        fleet.policy.generate = generate
    assert len(seen) == len(turns) == 3
    ids, mask = trained["input_ids"], trained["assistant_masks"]
    for prompt in seen:
        assert prompt == ids[: len(prompt)]  # the same tokens, up to the assistant's turn ...
        assert mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0  # ... which is where training's loss begins


def _wire(m) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def test_a_system_message_brings_its_own_harness(server) -> None:
    """The rollout engine renders its own prompts: those reach the chat template as sent."""
    url, fleet = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    seen = []
    generate = fleet.policy.generate
    fleet.policy.generate = lambda requests, adapter=None, **heard: (
        seen.extend(requests) or generate(requests, adapter, **heard)
    )
    try:
        _client(url).chat.completions.create(model="L1-life", messages=messages, max_tokens=2, temperature=0)
    finally:
        fleet.policy.generate = generate
    assert seen[0].messages == messages and seen[0].tools is None


def test_a_request_for_an_unloaded_name_waits_for_its_reload_or_fails_after_the_grace(server) -> None:
    import httpx
    import openai

    url, fleet = server
    folder = fleet.slots["L1-life@v1"].path
    ask = {"model": "L1-life@v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "L1-life@v1"}).status_code == 200
    answers: list = []
    waiting = threading.Thread(target=lambda: answers.append(_client(url).chat.completions.create(**ask)))
    waiting.start()
    waiting.join(0.5)  # it may not finish: an answer now would come from an adapter that is not loaded
    assert answers == [] and waiting.is_alive()  # held, not failed, while the name is away
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "L1-life@v1", "lora_path": folder})
    assert loaded.text == "Success: LoRA adapter 'L1-life@v1' added successfully."
    waiting.join(30)
    assert answers[0].model == "L1-life@v1"
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "L1-life@v1", "lora_path": folder})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "L7-none"})
    assert missing.status_code == 404
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "L7-x", "lora_path": str(folder) + "-gone"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"  # not recorded: never looked at
    grace, fleet.swap_grace_s = fleet.swap_grace_s, 0.3
    try:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "L1-life@v1"})
        with pytest.raises(openai.NotFoundError, match="'L1-life@v1' is not served here"):
            _client(url).chat.completions.create(**ask)
    finally:
        fleet.swap_grace_s = grace
        fleet.load("L1-life@v1", folder)


def test_promotions_and_rollbacks_swap_adapters_under_streaming_load(server, registry_store) -> None:
    """Four clients stream requests while the registry's vllm hook moves L1-life's live version ten times: no
    request fails, every reply is exactly the one its reported version gives, and the swaps show."""
    from autoevolve.fleet.hooks import VLLMHook, VLLMHookSettings
    from autoevolve.fleet.registry import Publisher, promote, rollback

    url, fleet = server
    client = _client(url)
    ask = {"messages": [{"role": "user", "content": "Find me a taxi."}], "temperature": 0, "max_tokens": 8}
    expected = {
        f"L1-life@v{v}": client.chat.completions.create(model=f"L1-life@v{v}", **ask).choices[0].message.content
        for v in (1, 2, 3)
    }
    assert len(set(expected.values())) == 3
    replies, failures, done = [], [], threading.Event()

    def stream() -> None:
        while not done.is_set():
            try:
                chunks = list(client.chat.completions.create(model="L1-life", stream=True, **ask))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                replies.append(({c.model for c in chunks}, text))
            except Exception as exc:  # noqa: BLE001 - counted, then asserted to be none
                failures.append(repr(exc))

    clients = [threading.Thread(target=stream) for _ in range(4)]
    for t in clients:
        t.start()
    loads = fleet.stats["loads"]
    publisher = Publisher([VLLMHook(VLLMHookSettings(kind="vllm", servers=[url]))], retries=0)
    try:
        with Store(registry_store) as store:
            for i in range(10):
                _more_replies(replies, failures)  # each version serves some replies before the next swap
                if i % 2 == 0:
                    promote(store, "L1-life", 1 + (i // 2) % 2, publisher=publisher)
                else:
                    rollback(store, "L1-life", publisher=publisher)
            live = store.expert("L1-life").live_version
    finally:
        _more_replies(replies, failures)
        done.set()
        for t in clients:
            t.join(60)
    assert failures == []
    assert len(replies) >= 20
    for models, text in replies:
        [model] = models  # one version wrote the whole reply
        assert text == expected[model]
    assert len({next(iter(m)) for m, _ in replies}) >= 2  # the swaps were seen by the clients
    assert fleet.stats["loads"] - loads == 10 and fleet.slots["L1-life"].ref == f"L1-life@v{live}"
    assert fleet.stats["largest_batch"] > 1  # concurrent requests shared batches


def _more_replies(replies: list, failures: list, timeout_s: float = 60.0) -> None:
    """Wait until the streaming clients have finished one more reply (or one failed)."""
    before, deadline = len(replies) + len(failures), time.monotonic() + timeout_s
    while len(replies) + len(failures) == before:
        assert time.monotonic() < deadline, f"no reply within {timeout_s:g} s"
        time.sleep(0.01)


@pytest.mark.integration
def test_a_routed_conversation_through_the_server_is_stored_as_converse_stores_it(tmp_path: Path, smol_policy) -> None:
    """SmolLM2 as L0-chat (router harness with demos) and L1-life: a booking goes to L1-life, the tool result goes
    back to it, the follow-up starts at L0-chat again; the recorded trajectory has converse's shape."""
    from autoevolve.envs.life import LifeEnv
    from autoevolve.envs.routing import EXPERTS, RouterEnv
    from autoevolve.fleet.serving.startup import recorder
    from autoevolve.harness.hcp import Decoding, Demo, Demos
    from autoevolve.model import EMBEDDED, base_model_id
    from tests.fleet.test_router import _fresh_adapter

    base = base_model_id(EMBEDDED)
    env = RouterEnv()
    shown = [t for t in env.tasks("train") if t.goal["expert"] != "L2-code"][:4]
    demos = Demos(items=[Demo(task_id=t.id, messages=env.reference(t)) for t in shown], style="first_call")
    router = HCPConfig.from_yaml("prompts/router.yaml").model_copy(update={"demos": demos})
    life = LifeEnv(tiers=(1,))
    task, *solved = life.tasks("train")[:5]
    booker = LIFE.model_copy(
        update={  # demos, and a grammar: the bare base model writes a valid call
            "demos": Demos(items=[Demo(task_id=t.id, messages=life.reference(t)) for t in solved]),
            "decoding": Decoding(constrain="tool_call"),
        }
    )
    with Store(tmp_path / "s.duckdb") as store:
        for seed, (e, hcp) in enumerate(zip(EXPERTS[:2], (router, booker), strict=True)):
            path = _fresh_adapter(tmp_path / e.name, seed)
            registered(store, e.name, path, base, hcp, tier=e.tier, rule=e.routing_rule)
    fleet = open_fleet(tmp_path / "s.duckdb", smol_policy, record=recorder(tmp_path / "served.duckdb"), say=print)
    assert fleet.entry == "L0-chat" and "router" in {c["id"] for c in fleet.cards()}
    episode = life.start(task)
    with running(create_app(fleet)) as url:
        client = _client(url)
        ask = {"model": "router", "tools": LIFE.tools, "metadata": task.metadata, "temperature": 0, "max_tokens": 120}
        messages = [{"role": "user", "content": task.request}]
        first = client.chat.completions.create(messages=messages, **ask)
        assert (first.model, first.choices[0].finish_reason) == ("L1-life@v1", "tool_calls")  # explicit routing
        [call] = first.choices[0].message.tool_calls
        result = episode.call(call.function.name, json.loads(call.function.arguments))
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]
        second = client.chat.completions.create(messages=messages, **ask)
        assert second.model == "L1-life@v1"  # the turn goes on with the expert that called the tool
        messages += [
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Thanks! How are you today?"},
        ]
        third = client.chat.completions.create(messages=messages, **ask)
        assert third.model == "L0-chat@v1" and third.choices[0].message.content  # implicit routing: back to L0
    fleet.recorder = None
    with Store(tmp_path / "served.duckdb") as served:
        stored = sorted(served.trajectories("serve"), key=lambda t: (len(t.messages), t.adapter))
    assert len(stored) == 3 and {t.stage for t in stored} == {"serve"}
    routed = stored[0].messages  # 4 messages: request, route, switched, L1-life's call; the second turn holds 4 too
    assert stored[0].adapter == "L0-chat@v1" and stored[0].hcp_id == router.id
    assert stored[1].adapter == "L1-life@v1" and stored[1].hcp_id == booker.id and stored[1].messages[2].role == "tool"
    [route] = routed[1].tool_calls
    assert (route.name, route.arguments, routed[1].adapter) == ("change_model", {"model": "L1-life"}, "L0-chat@v1")
    assert json.loads(routed[2].content) == {"model": "L1-life", "status": "switched"}
    assert (routed[3].role, routed[3].adapter, routed[3].tool_calls[0].name) == (
        "assistant",
        "L1-life@v1",
        call.function.name,
    )
    assert stored[2].messages[-1].adapter == "L0-chat@v1" and stored[2].messages[-2].content.startswith("Thanks!")


def test_a_registry_in_a_postgresql_store_is_served(tmp_path, peaked_dir, postgres_url) -> None:  # noqa: ANN001
    from autoevolve.policy.local import LocalPolicy

    base = str(peaked_dir)
    with Store(postgres_url) as store:
        for seed in (1, 2):
            registered(store, "L1-life", random_adapter(base, tmp_path / f"v{seed}", seed, base), base, LIFE)
    fleet = open_fleet(postgres_url, LocalPolicy(base, dtype="float32"), say=lambda _: None)
    folders, experts = recorded_folders(postgres_url)()
    assert {"L1-life", "L1-life@v1", "L1-life@v2"} <= set(fleet.slots) and experts == {"L1-life"}
    assert folders == {(tmp_path / "v1").resolve(): "L1-life@v1", (tmp_path / "v2").resolve(): "L1-life@v2"}
