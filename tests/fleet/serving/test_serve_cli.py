"""The autoevolve serve command: a process that serves the registry until interrupted, and its bad input."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from autoevolve.cli import main
from autoevolve.harness.hcp import HCPConfig
from autoevolve.store import Store
from tests.fleet.serving.helpers import random_adapter, registered

LIFE = HCPConfig.from_yaml("prompts/life.yaml")


def test_serve_runs_the_registry_and_records_what_it_served(tmp_path: Path, tiny_model_dir) -> None:
    base = str(tiny_model_dir)
    with Store(tmp_path / "s.duckdb") as store:
        registered(store, "L1-life", random_adapter(base, tmp_path / "L1-life-v1", 1, base), base, LIFE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "autoevolve.cli",
        "serve",
        "--store",
        str(tmp_path / "s.duckdb"),
        "--port",
        str(port),
        "--record",
        str(tmp_path / "served.duckdb"),
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "autoevolve serve did not start within 120 s"
                time.sleep(0.2)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        body = {"model": "L1-life", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    finally:
        server.send_signal(signal.SIGINT)
        out, _ = server.communicate(timeout=60)
    assert {m["id"] for m in models} == {base, "L1-life", "L1-life@v1"}
    assert answer["model"] == "L1-life@v1" and answer["usage"]["completion_tokens"] == 3
    assert f"serving {base}, L1-life, L1-life@v1 on http://127.0.0.1:{port}/v1" in out
    with Store(tmp_path / "served.duckdb", read_only=True) as served:
        [stored] = served.trajectories("serve")
    assert stored.adapter == "L1-life@v1" and stored.hcp_id == LIFE.id and stored.messages[0].content == "hi"


def test_serve_refuses_a_missing_store_and_a_bad_harness(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--store", str(tmp_path / "none.duckdb")]) == 2
    missing = f"autoevolve: no store at {tmp_path / 'none.duckdb'} (pass --store with an existing store's path; a run"
    assert (
        capsys.readouterr().err.strip()
        == f"{missing} creates one; or --model NAME without --store to serve a model alone)"
    )
    Store(tmp_path / "s.duckdb").close()
    assert main(["serve", "--store", str(tmp_path / "s.duckdb"), "--hcp", "L1-life=nowhere.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoevolve: --hcp L1-life=nowhere.yaml: ") and "write EXPERT=FILE" in err


def test_serve_refuses_an_open_host_without_a_key_and_a_root_without_runtime_loading(tmp_path: Path, capsys) -> None:
    Store(tmp_path / "s.duckdb").close()
    store = ["--store", str(tmp_path / "s.duckdb")]
    assert main(["serve", *store, "--host", "0.0.0.0"]) == 2
    assert "--host 0.0.0.0: anyone who reaches it could use every expert" in capsys.readouterr().err
    assert main(["serve", *store, "--allow-adapter-root", str(tmp_path)]) == 2
    assert "runtime loading is off; add --enable-runtime-lora" in capsys.readouterr().err
