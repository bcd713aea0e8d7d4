"""Promotion hooks against a real local HTTP server that speaks vLLM's runtime LoRA endpoints, and real commands."""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from autoevolve.fleet.hooks import (
    CommandHook,
    CommandHookSettings,
    HookError,
    HookSettings,
    PromotionEvent,
    VLLMHook,
    VLLMHookSettings,
    WebhookHook,
    WebhookHookSettings,
    fire_all,
    make_hook,
)

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
V1, V2 = "/adapters/L1-life/v1", "/adapters/L1-life/v2"
SECRET = "s3cr3t-value-1234"


class FakeVLLM(ThreadingHTTPServer):
    """A vLLM server with runtime LoRA updating: loaded adapters by name, every request recorded.

    ``load_status``: answer load with this status (and do nothing). ``load_delay``: hang this long on load, then do
    nothing. ``load_applies``: False to answer load 200 without loading. Any other POST path is a webhook
    receiver answering ``hook_status`` with the secret header echoed back.
    """

    block_on_close = False  # do not wait for hung handlers at shutdown

    def __init__(self) -> None:
        """Listen on a free port of 127.0.0.1."""
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.loaded: dict[str, str] = {}
        self.requests: list[dict[str, Any]] = []
        self.load_status: int | None = None
        self.load_delay = 0.0
        self.load_applies = True
        self.hook_status = 200
        self.stop = threading.Event()

    def calls(self) -> list[tuple[str, str, Any]]:
        """(method, path, JSON body) of every request so far, in order."""
        return [(r["method"], r["path"], r["body"]) for r in self.requests]


class _Handler(BaseHTTPRequestHandler):
    """Answers as vLLM's OpenAI-compatible server does for /v1/models and the LoRA endpoints."""

    server: FakeVLLM

    def log_message(self, format: str, *args: Any) -> None:
        """Keep test output quiet."""

    def _answer(self, status: int, payload: Any) -> None:
        """Send a JSON (or plain text) answer; the client may have given up already."""
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass

    def _record(self) -> Any:
        """Record the request and return its JSON body (None without one)."""
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append(
            {"method": self.command, "path": self.path, "body": body, "headers": dict(self.headers.items())}
        )
        return body

    def do_GET(self) -> None:
        """/v1/models: the base model and every loaded adapter."""
        self._record()
        if self.path != "/v1/models":
            return self._answer(404, {"detail": "Not Found"})
        cards = [{"id": BASE, "object": "model", "root": BASE, "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": BASE} for n, p in self.server.loaded.items()]
        self._answer(200, {"object": "list", "data": cards})

    def do_POST(self) -> None:
        """Load or unload an adapter, or receive a webhook."""
        body = self._record()
        server = self.server
        if self.path == "/v1/load_lora_adapter":
            if server.load_delay:
                server.stop.wait(server.load_delay)
                return self._answer(200, "too late")
            if server.load_status is not None:
                return self._answer(server.load_status, {"object": "error", "message": "CUDA out of memory"})
            if body["lora_name"] in server.loaded:
                message = f"The lora adapter '{body['lora_name']}' has already been loaded."
                return self._answer(400, {"object": "error", "message": message, "code": 400})
            if server.load_applies:
                server.loaded[body["lora_name"]] = body["lora_path"]
            return self._answer(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if self.path == "/v1/unload_lora_adapter":
            if server.loaded.pop(body["lora_name"], None) is None:
                message = f"The lora adapter '{body['lora_name']}' cannot be found."
                return self._answer(404, {"object": "error", "message": message, "code": 404})
            return self._answer(200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
        self._answer(server.hook_status, f"bad secret {self.headers.get('X-Autoevolve-Secret')} for {self.path}")


@pytest.fixture
def servers():
    """Start fake vLLM servers on demand; shut them all down afterwards."""
    started: list[FakeVLLM] = []

    def start(loaded: dict[str, str] | None = None) -> FakeVLLM:
        server = FakeVLLM()
        server.loaded.update(loaded or {})
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop.set()
        server.shutdown()
        server.server_close()


def _event(**update: Any) -> PromotionEvent:
    """Promote v2 of L1-life over v1."""
    fields = {
        "action": "promote",
        "expert": "L1-life",
        "served_name": "L1-life",
        "version": 2,
        "path": V2,
        "previous_version": 1,
        "previous_path": V1,
        "base_model": BASE,
        "eval": {"decision": "promote", "gain": 0.125},
    }
    return PromotionEvent(**(fields | update))


def _vllm(*servers: FakeVLLM, timeout_s: float = 5.0, api_key_env: str | None = None) -> VLLMHook:
    """A vLLM hook for the servers."""
    urls = [s.url for s in servers]
    return VLLMHook(VLLMHookSettings(kind="vllm", servers=urls, timeout_s=timeout_s, api_key_env=api_key_env))


def _ids(server: FakeVLLM) -> list[str]:
    """Model ids the server's /v1/models lists now."""
    return [card["id"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]]


def test_promote_swaps_adapter_on_every_server(servers, monkeypatch):
    """Unload v1 then load v2 under the same name on both servers; models lists it; the key is sent."""
    monkeypatch.setenv("VLLM_KEY", "k-123")
    a, b = servers({"L1-life": V1}), servers({"L1-life": V1, "L2-life": "/adapters/L2-life/v4"})
    hook = _vllm(a, b, api_key_env="VLLM_KEY")
    assert hook.name == f"vllm {a.url}, {b.url}"

    hook.fire(_event())

    assert a.loaded == {"L1-life": V2}
    assert b.loaded == {"L1-life": V2, "L2-life": "/adapters/L2-life/v4"}
    expected = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "L1-life"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "L1-life", "lora_path": V2}),
        ("GET", "/v1/models", None),
    ]
    assert a.calls() == expected and b.calls() == expected
    assert {r["headers"]["Authorization"] for r in a.requests + b.requests} == {"Bearer k-123"}

    hook.fire(_event())  # already live everywhere: a retry only looks
    assert a.calls()[4:] == [("GET", "/v1/models", None)] and b.calls()[4:] == [("GET", "/v1/models", None)]
    assert _ids(a) == [BASE, "L1-life"] and _ids(b) == [BASE, "L2-life", "L1-life"]


def test_first_promotion_loads_without_unloading(servers):
    """No previous version and nothing listed: load only; an unset key variable sends no Authorization."""
    a = servers()
    _vllm(a, api_key_env="AUTOEVOLVE_TEST_UNSET_KEY").fire(
        _event(version=1, path=V1, previous_version=None, previous_path=None)
    )
    assert a.loaded == {"L1-life": V1}
    assert [c[1] for c in a.calls()] == ["/v1/models", "/v1/load_lora_adapter", "/v1/models"]
    assert all("Authorization" not in r["headers"] for r in a.requests)


def test_load_500_raises_and_is_retried(servers, caplog):
    """A 500 on load names the server, the step and the status; fire_all tries three times and reports once."""
    a = servers({"L1-life": V1})
    a.load_status = 500
    hook = _vllm(a)

    with pytest.raises(HookError) as raised:
        hook.fire(_event())
    message = str(raised.value)
    assert message.startswith(f"vllm {a.url}: load_lora_adapter answered 500: ")
    assert "CUDA out of memory" in message and "\n" not in message

    a.requests.clear()
    failures = fire_all([hook], _event(), retries=2, backoff_s=0)
    assert len(failures) == 1
    assert failures[0].hook == hook.name and failures[0].attempts == 3
    assert "load_lora_adapter answered 500" in failures[0].error
    assert [c[1] for c in a.calls()].count("/v1/load_lora_adapter") == 3
    assert len([r for r in caplog.records if r.levelname == "WARNING" and "attempt" in r.getMessage()]) == 3


def test_load_timeout_raises_and_is_recorded(servers):
    """A server that hangs on load past timeout_s fails with 'timed out' and the timeout; fire_all records it."""
    a = servers({"L1-life": V1})
    a.load_delay = 1.0
    hook = _vllm(a, timeout_s=0.2)

    with pytest.raises(HookError, match=r"load_lora_adapter timed out after 0\.2 s") as raised:
        hook.fire(_event())
    assert a.url in str(raised.value)

    failures = fire_all([hook], _event(), retries=1, backoff_s=0)
    assert [(f.hook, f.attempts) for f in failures] == [(hook.name, 2)]
    assert "timed out after 0.2 s" in failures[0].error


def test_one_bad_server_does_not_stop_the_others(servers):
    """The healthy server is updated; the error names only the failing one."""
    good, bad = servers({"L1-life": V1}), servers({"L1-life": V1})
    bad.load_status = 503
    with pytest.raises(HookError) as raised:
        _vllm(bad, good).fire(_event())
    assert good.loaded == {"L1-life": V2} and bad.loaded == {}
    assert bad.url in str(raised.value) and good.url not in str(raised.value)
    assert "answered 503" in str(raised.value)


def test_unreachable_server_and_failed_verification(servers):
    """A closed port is a connection failure; a load that answers 200 but lists nothing fails verification."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    hook = VLLMHook(VLLMHookSettings(kind="vllm", servers=[closed], timeout_s=1))
    with pytest.raises(HookError, match=rf"^vllm {closed}: models failed: ConnectError"):
        hook.fire(_event())

    liar = servers()
    liar.load_applies = False
    with pytest.raises(HookError, match=r"models does not list 'L1-life' after load_lora_adapter"):
        _vllm(liar).fire(_event(previous_version=None, previous_path=None))


def test_rollback_to_base_unloads_only(servers):
    """Version None: unload, no load, and models no longer lists the name."""
    a = servers({"L1-life": V2})
    _vllm(a).fire(_event(action="rollback", version=None, path=None, previous_version=2, previous_path=V2))
    assert a.loaded == {} and _ids(a) == [BASE]
    assert a.calls()[:3] == [
        ("GET", "/v1/models", None),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "L1-life"}),
        ("GET", "/v1/models", None),
    ]


def test_webhook_sends_body_and_secret_without_leaking_it(servers, monkeypatch):
    """The body is event.body(); the secret travels in the header only, never in name, repr or errors."""
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    receiver = servers()
    settings = WebhookHookSettings(kind="webhook", url=f"{receiver.url}/promoted", secret_env="HOOK_SECRET")
    hook = WebhookHook(settings)
    event = _event()

    hook.fire(event)
    [request] = receiver.requests
    assert (request["method"], request["path"]) == ("POST", "/promoted")
    assert request["body"] == event.body() and request["body"]["eval"]["gain"] == 0.125
    assert request["headers"]["X-Autoevolve-Secret"] == SECRET
    assert SECRET not in repr(hook) + hook.name + repr(settings)

    receiver.hook_status = 500  # the receiver echoes the secret in its error body
    with pytest.raises(HookError) as raised:
        hook.fire(event)
    assert str(raised.value) == f"webhook {receiver.url}/promoted: POST answered 500: bad secret *** for /promoted"

    monkeypatch.delenv("HOOK_SECRET")
    with pytest.raises(HookError, match="environment variable HOOK_SECRET is not set"):
        hook.fire(event)
    assert len(receiver.requests) == 2  # nothing sent without the secret


def test_command_gets_event_on_stdin(tmp_path):
    """The program reads the event's JSON; exit codes, timeouts and missing programs become HookErrors."""
    out = tmp_path / "event.json"
    write = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text(sys.stdin.read())"
    event = _event()
    CommandHook(CommandHookSettings(kind="command", command=[sys.executable, "-c", write, str(out)])).fire(event)
    assert json.loads(out.read_text()) == event.body()

    fail = "import sys; sys.stderr.write('x' * 300 + ' disk full'); sys.exit(3)"
    with pytest.raises(HookError, match=r"exit 3: x+ disk full$") as raised:
        CommandHook(CommandHookSettings(kind="command", command=[sys.executable, "-c", fail])).fire(event)
    assert str(raised.value).count("x") < 300

    sleep = CommandHook(
        CommandHookSettings(kind="command", command=[sys.executable, "-c", "import time; time.sleep(5)"], timeout_s=0.2)
    )
    with pytest.raises(HookError, match=r"timed out after 0\.2 s"):
        sleep.fire(event)

    missing = CommandHook(CommandHookSettings(kind="command", command=[str(tmp_path / "no-such-notify.sh")]))
    with pytest.raises(HookError, match="cannot run .*no-such-notify.sh"):
        missing.fire(event)
    assert [f.attempts for f in fire_all([missing], event, retries=1, backoff_s=0)] == [2]


def test_fire_all_retries_until_success_and_records_foreign_errors():
    """A hook that fails twice then succeeds is no failure; one raising another exception type is recorded."""

    class Flaky:
        """Fails ``n`` times, then succeeds."""

        def __init__(self, name: str, n: int, error: Exception) -> None:
            """A hook called ``name`` that raises ``error`` ``n`` times."""
            self.name, self.n, self.error, self.calls = name, n, error, 0

        def fire(self, event: PromotionEvent) -> None:
            """Raise until ``n`` calls have failed."""
            self.calls += 1
            if self.calls <= self.n:
                raise self.error

    flaky, broken = Flaky("flaky", 2, HookError("flaky: busy")), Flaky("broken", 9, KeyError("lora"))
    failures = fire_all([flaky, broken], _event(), retries=2, backoff_s=0)
    assert flaky.calls == 3 and broken.calls == 3
    assert [(f.hook, f.error, f.attempts) for f in failures] == [("broken", "KeyError: 'lora'", 3)]
    assert fire_all([Flaky("ok", 0, HookError("never"))], _event()) == []


def test_settings_parse_and_build_hooks():
    """A list of dicts becomes the right settings and hooks; unknown kinds and keys are errors."""
    raw = [
        {"kind": "vllm", "servers": ["http://gpu-1:8000/", "http://gpu-2:8000"], "api_key_env": "VLLM_KEY"},
        {"kind": "webhook", "url": "https://hooks.example.com/promoted", "secret_env": "HOOK_SECRET"},
        {"kind": "command", "command": ["scripts/notify.sh", "--channel", "ml ops"], "timeout_s": 5},
    ]
    parsed = TypeAdapter(list[HookSettings]).validate_python(raw)
    assert [type(s) for s in parsed] == [VLLMHookSettings, WebhookHookSettings, CommandHookSettings]
    assert parsed[0].servers == ["http://gpu-1:8000", "http://gpu-2:8000"] and parsed[0].timeout_s == 10
    assert parsed[1].header == "X-Autoevolve-Secret" and parsed[2].timeout_s == 5

    hooks = [make_hook(s) for s in parsed]
    assert [type(h) for h in hooks] == [VLLMHook, WebhookHook, CommandHook]
    assert [h.name for h in hooks] == [
        "vllm http://gpu-1:8000, http://gpu-2:8000",
        "webhook https://hooks.example.com/promoted",
        "command scripts/notify.sh --channel 'ml ops'",
    ]

    adapter = TypeAdapter(HookSettings)
    for bad in (
        {"kind": "slack", "url": "https://x"},
        {"kind": "vllm", "servers": []},
        {"kind": "vllm", "servers": ["gpu-1:8000"]},
        {"kind": "webhook", "url": "https://x", "secret": SECRET},
        {"kind": "command", "command": ["x"], "timeout_s": 0},
    ):
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)


def test_event_round_trips_and_pairs_versions_with_paths():
    """The body parses back to the same event; a version without a folder is refused."""
    event = _event()
    assert PromotionEvent.model_validate(json.loads(json.dumps(event.body()))) == event
    assert event.body()["previous_path"] == V1
    with pytest.raises(ValidationError, match="path must be set exactly when version is set"):
        _event(path=None)
    with pytest.raises(ValidationError, match="previous_path"):
        _event(previous_path=None)


def test_an_openai_policy_loads_the_adapters_a_round_uses_into_vllm(servers) -> None:
    from autoevolve.policy.openai import OpenAIPolicy

    server = servers()
    policy = OpenAIPolicy(BASE, f"{server.url}/v1", load_adapters=True)
    policy.add_adapter("L1-life@v2", "/adapters/L1-life-v2")
    policy.add_adapter("L1-life@v2", "/adapters/L1-life-v2")  # known already: no second request
    assert server.loaded == {"L1-life@v2": "/adapters/L1-life-v2"}
    assert [c[1] for c in server.calls()] == ["/v1/load_lora_adapter"]
    OpenAIPolicy(BASE, f"{server.url}/v1", load_adapters=True).add_adapter("L1-life@v2", "/adapters/L1-life-v2")
    assert len(server.calls()) == 2  # another process's policy: vLLM's 'already loaded' is fine
    server.load_status = 500
    with pytest.raises(RuntimeError, match=r"could not load adapter 'L1-life@v3' .* HTTP 500 .*--enable-lora"):
        policy.add_adapter("L1-life@v3", "/adapters/L1-life-v3")
    OpenAIPolicy(BASE, f"{server.url}/v1").add_adapter("L1-life@v4", "/x")  # load_adapters off: nothing sent
    assert len(server.calls()) == 3 and "L1-life@v3" not in server.loaded


def test_an_openai_policy_unloads_what_it_loaded_and_a_missing_name_is_fine(servers) -> None:
    from autoevolve.policy.openai import OpenAIPolicy

    server = servers()
    policy = OpenAIPolicy(BASE, f"{server.url}/v1", load_adapters=True)
    policy.add_adapter("L1-life@v2-epoch1", "/adapters/e1")
    policy.remove_adapter("L1-life@v2-epoch1")
    assert server.loaded == {} and "L1-life@v2-epoch1" not in policy.adapters
    policy.remove_adapter("L1-life@v2-epoch1")  # not added any more: nothing sent
    policy.add_adapter("gone", "/adapters/gone")
    server.loaded.clear()  # the server lost it (a restart): vLLM's 404 'cannot be found' is not an error
    policy.remove_adapter("gone")
    assert [c[1] for c in server.calls()] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] * 2
