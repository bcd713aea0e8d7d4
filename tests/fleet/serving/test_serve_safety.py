"""Safe by default: runtime loading off unless enabled, and then only recorded or allowed folders under the store's
identity; bounded requests and waits; every error the reference's error object, never internal text."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from autoevolve.fleet.serving import Fleet
from autoevolve.fleet.serving.app import MAX_BODY_BYTES, create_app
from autoevolve.fleet.serving.runtime_lora import RuntimeLoRA
from autoevolve.fleet.serving.startup import open_fleet, recorded_folders
from autoevolve.store import Store
from tests.fleet.serving.helpers import random_adapter, registered, running

ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from autoevolve.policy.local import LocalPolicy

    return LocalPolicy(str(tiny_model_dir), batch_size=4, dtype="float32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """A registry with L1-x@v1 (live), and an unregistered adapter under an 'uploads' root."""
    root, base = tmp_path_factory.mktemp("safety"), str(tiny_model_dir)
    v1 = random_adapter(base, root / "L1-x-v1", 1, base)
    loose = random_adapter(base, root / "uploads" / "mine", 2, base)
    with Store(root / "s.duckdb") as store:
        registered(store, "L1-x", v1, base, None)
    (root / "uploads" / "pissa").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "uploads" / "pissa" / name).write_bytes((Path(loose) / name).read_bytes())
    config = json.loads((root / "uploads" / "pissa" / "adapter_config.json").read_text())
    (root / "uploads" / "pissa" / "adapter_config.json").write_text(json.dumps(config | {"init_lora_weights": "pissa"}))
    return {"store": root / "s.duckdb", "v1": Path(v1), "loose": Path(loose), "uploads": root / "uploads", "root": root}


def _load(url: str, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_runtime_loading_is_off_unless_enabled(policy, folders) -> None:
    fleet = open_fleet(folders["store"], policy, say=lambda _: None)
    with running(create_app(fleet)) as url:
        answer = _load(url, "mine", folders["loose"])
        assert answer.status_code == 404 and answer.json()["error"]["message"] == "no route /v1/load_lora_adapter"
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "L1-x"})
        assert gone.status_code == 404 and "L1-x" in fleet.slots


def test_loading_takes_recorded_or_allowed_folders_under_the_stores_identity(policy, folders) -> None:
    fleet = open_fleet(folders["store"], policy, say=lambda _: None)
    runtime = RuntimeLoRA(recorded_folders(folders["store"]), roots=(folders["uploads"],), max_loras=3)
    with running(create_app(fleet, runtime=runtime)) as url:
        etc = _load(url, "innocent", "/etc")
        assert etc.status_code == 400 and etc.json()["error"]["param"] == "lora_path"
        assert "adapter_config" not in etc.text  # judged by its path: nothing on disk was read or told
        outside = _load(url, "mine", folders["root"] / "elsewhere")
        assert outside.status_code == 400 and "--allow-adapter-root" in outside.json()["error"]["message"]
        posing = _load(url, "L1-x@v7", folders["loose"])  # an allowed folder may not pose as a registered version
        assert posing.status_code == 400 and "registered expert" in posing.json()["error"]["message"]
        assert _load(url, "mine", folders["loose"]).status_code == 200 and fleet.slots["mine"].ref == "mine"
        as_v1 = _load(url, "again", folders["v1"])  # a recorded folder under another expert's name
        assert as_v1.status_code == 400 and "the folder is L1-x@v1's" in as_v1.json()["error"]["message"]
        pissa = _load(url, "pissa", folders["uploads"] / "pissa")
        assert pissa.status_code == 400 and "init_lora_weights is 'pissa'" in pissa.json()["error"]["message"]
        assert _load(url, "mine2", folders["loose"]).status_code == 200  # three loaded now: L1-x@v1, mine, mine2
        full = _load(url, "mine3", folders["loose"])
        assert full.status_code == 400 and "3 adapters are loaded" in full.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200
        assert "mine" not in policy.adapters  # its weights freed
        assert _load(url, "mine3", folders["loose"]).status_code == 200


def test_errors_are_the_references_object_on_every_route_and_status(policy, tiny_model_dir) -> None:
    fleet = Fleet(policy, str(tiny_model_dir))
    with running(create_app(fleet, api_key="k")) as url:
        key = {"authorization": "Bearer k"}
        cases = [
            (httpx.get(f"{url}/v1/nothing", headers=key), 404, None),
            (httpx.get(f"{url}/v1/chat/completions", headers=key), 405, None),
            (
                httpx.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer ключ".encode()}, json={}),
                401,
                None,
            ),
            (httpx.post(f"{url}/v1/chat/completions", headers=key, json={"model": "x", **ASK, "n": 99}), 400, "n"),
            (httpx.post(f"{url}/v1/chat/completions", headers=key, content=b"{"), 400, "body"),
            (
                httpx.post(
                    f"{url}/v1/chat/completions",
                    headers=key,
                    json={"model": str(tiny_model_dir), "messages": [{"role": "tool", "tool_call_id": {"a": 1}}]},
                ),
                400,
                "messages[0].tool_call_id",
            ),
            (
                httpx.post(
                    f"{url}/v1/chat/completions",
                    headers=key,
                    json={
                        "model": str(tiny_model_dir),
                        "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": [None]}]}],
                    },
                ),
                400,
                "messages[0].tool_calls[0]",
            ),
            (
                httpx.post(f"{url}/v1/chat/completions", headers=key, content=b" " * (MAX_BODY_BYTES + 1)),
                413,
                None,
            ),
            (
                httpx.post(
                    f"{url}/v1/chat/completions",
                    headers=key,
                    json={"model": str(tiny_model_dir), **ASK, "max_tokens": 10**13},
                ),
                400,
                "max_tokens",
            ),
        ]
        for answer, status, param in cases:
            error = answer.json()["error"]
            assert answer.status_code == status and set(error) == {"message", "type", "param", "code"}, answer.text
            assert error["param"] == param, error


def test_a_completion_limit_past_the_context_is_refused_and_the_default_cut_to_fit(policy, tiny_model_dir) -> None:
    fleet = Fleet(policy, str(tiny_model_dir))
    assert fleet.context == policy.context_tokens > 0
    with running(create_app(fleet)) as url:
        ask = {"model": str(tiny_model_dir), "messages": ASK["messages"], "max_tokens": fleet.context - 3}
        answer = httpx.post(f"{url}/v1/chat/completions", json=ask)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
        assert "ask for at most" in answer.json()["error"]["message"]


def test_too_many_waiting_requests_are_told_to_retry_and_a_slow_batch_times_out(policy, tiny_model_dir) -> None:
    fleet = Fleet(policy, str(tiny_model_dir), max_waiting=1, reply_timeout_s=0.5)
    release = threading.Event()
    generate = policy.generate
    policy.generate = lambda requests, adapter=None, **heard: release.wait(10) and generate(requests, adapter, **heard)
    try:
        with running(create_app(fleet)) as url:
            ask = {"model": str(tiny_model_dir), **ASK}
            first: list = []
            held = threading.Thread(target=lambda: first.append(httpx.post(f"{url}/v1/chat/completions", json=ask)))
            held.start()
            for _ in range(100):  # until the first request holds the one place
                if fleet._waiting._value == 0:
                    break
                threading.Event().wait(0.01)
            second = httpx.post(f"{url}/v1/chat/completions", json=ask)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            held.join(10)
            assert first[0].status_code == 503 and first[0].headers["retry-after"] == "5"
    finally:
        release.set()
        policy.generate = generate
