"""Serving under load: streaming clients against `autoevolve serve` and llama.cpp's server, side by side.

Both servers run as their own processes on this machine, on the embedded SmolLM2-135M-Instruct: autoevolve serve on
the dequantised weights (``autoevolve serve --model smollm2-135m-instruct``, no store), llama.cpp's OpenAI-compatible
server (``llama-cpp-python[server]``, built from PyPI into a virtualenv of its own: ``--llama-python``) on the very
GGUF file the weights come from (Q4_1, as llama.cpp runs it), 2 threads, requests queued rather than interrupted
(its ``--interrupt_requests`` is on by default: a new request ends the stream in progress). autoevolve serves the
base model and two LoRA adapters (rank 16 on every projection, small random weights, made by the bench and loaded
at runtime with ``--enable-runtime-lora``), and client k asks the base, the first or the second in turn: three
models, so three batches where one model would have one. llama.cpp's server applies a LoRA to every request alike
(no adapter per request), so it serves the base model to every client. Each level starts N clients at once; each
streams ``--requests`` chat completions in turn (temperature 0, ``--max-tokens``, prompts from a fixed list) and
stops by itself. Per level: generated tokens/s over the level's wall time (tokens counted by
the model's tokenizer over the streamed text, the same for both servers), time to first token (TTFT) p50/p99, the
gap between text chunks p50/p99, errors (a stream that ends with no text is one). The server's batch holds up to
64 requests (``--batch-size 64``).

PASS when, at 16 clients, autoevolve generates at least 2x llama.cpp's tokens/s; at 1 client at least 0.5x its
tokens/s with a TTFT p50 within 1.5x of its; and no request failed. Without ``--llama-python`` only autoevolve runs
(and nothing passes).

    python bench/serve_load.py [--clients 1 4 16 64] [--requests 2] [--max-tokens 64] \\
        [--llama-python /path/to/venv/bin/python] [--out bench/results/serve_load.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench._shared import write_json  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe a busy market in the morning.",
    "Tell me about the history of tea.",
    "Write a letter to a friend about a trip to the mountains.",
    "Why is the sky blue? Explain to a child.",
    "Give me three ideas for a rainy weekend.",
    "Describe how bread is made, step by step.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], port: int, log: Path) -> subprocess.Popen:
    """A server process, once its model list answers (its output goes to ``log``)."""
    import httpx

    out = log.open("w")
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "2"})
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{command[0]} exited ({proc.returncode}); its output is in {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{command[0]} did not answer within 300 s; its output is in {log}")
        time.sleep(0.5)


async def one(client: Any, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed request: when it began, when each text chunk arrived, the text, or the error."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    began, arrivals, text = time.perf_counter(), [], []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:200]}
                piece = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if piece:
                    arrivals.append(time.perf_counter())
                    text.append(piece)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not arrivals:
        return {"error": "the stream ended with no text"}
    return {"began": began, "arrivals": arrivals, "text": "".join(text)}


async def level(url: str, models: list[str], clients: int, requests: int, max_tokens: int, tokenizer: Any) -> dict:
    """``clients`` clients at once, each streaming ``requests`` requests in turn, client k to ``models[k % len]``."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:

        async def run(k: int) -> list[dict]:
            return [
                await one(client, url, models[k % len(models)], PROMPTS[(k * requests + i) % len(PROMPTS)], max_tokens)
                for i in range(requests)
            ]

        began = time.perf_counter()
        done = [r for rs in await asyncio.gather(*(run(k) for k in range(clients))) for r in rs]
        wall = time.perf_counter() - began
    ok = [r for r in done if "error" not in r]
    tokens = sum(len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in ok)
    ttft = [r["arrivals"][0] - r["began"] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    errors = [r["error"] for r in done if "error" in r]
    return {
        "clients": clients,
        "requests": len(done),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": _q(ttft, 0.5),
        "ttft_p99_s": _q(ttft, 0.99),
        "gap_p50_ms": _q([g * 1000 for g in gaps], 0.5),
        "gap_p99_ms": _q([g * 1000 for g in gaps], 0.99),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[max(0, round(q * 100) - 1)], 3)


def adapters(folder: Path) -> dict[str, Path]:
    """Two LoRA adapters of the embedded model (rank 16 on every projection, B drawn small so replies stay near the
    base model's), saved under ``folder``; made once."""
    out = {name: folder / name for name in ("adapter-a", "adapter-b")}
    if all((path / "adapter_config.json").exists() for path in out.values()):
        return out
    import torch
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import EMBEDDED, base_model_id, load
    from autoevolve.stages.distill.fit import save_adapter

    for seed, path in enumerate(out.values()):
        base, _ = load(EMBEDDED)
        torch.manual_seed(seed)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "lora_B" in name:
                    weight.normal_(std=1e-3)
        save_adapter(model, path, base_model_id(EMBEDDED))  # the base model's id, as the server checks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=2, help="requests each client streams in turn")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-python", help="a python with llama-cpp-python[server] installed")
    parser.add_argument("--out", default=str(ROOT / "bench/results/serve_load.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from autoevolve.model import EMBEDDED, cache_dir, embedded_gguf, load

    load(EMBEDDED)  # the dequantised copy is cached before the server starts, so it loads as it would for a user
    tokenizer = AutoTokenizer.from_pretrained(str(cache_dir() / EMBEDDED))
    logs = ROOT / "trajectories" / "serve_load"  # each server's output (git-ignored)
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple[list[str], str]] = {}
    port = free_port()
    loras = adapters(logs / "adapters")
    servers["autoevolve"] = (
        [sys.executable, "-m", "autoevolve.cli", "serve", "--model", EMBEDDED, "--port", str(port)]
        + ["--batch-size", "64", "--enable-runtime-lora", "--allow-adapter-root", str(logs / "adapters")],
        f"http://127.0.0.1:{port}",
    )
    if args.llama_python:
        port = free_port()
        servers["llama.cpp"] = (
            [args.llama_python, "-m", "llama_cpp.server", "--model", str(embedded_gguf()), "--port", str(port)]
            + ["--n_threads", "2", "--n_ctx", "4096", "--model_alias", "smollm2"]
            + ["--interrupt_requests", "False"],  # queue requests (its default drops a stream when the next comes)
            f"http://127.0.0.1:{port}",
        )
    table: dict[str, list[dict]] = {}
    for name, (command, url) in servers.items():
        proc = start(command, int(url.rsplit(":", 1)[1]), logs / f"{name}.log")
        try:
            import httpx

            models = [httpx.get(f"{url}/v1/models").json()["data"][0]["id"]]
            if name == "autoevolve":
                for lora, path in loras.items():
                    body = {"lora_name": lora, "lora_path": str(path)}
                    answer = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=300)
                    if answer.status_code != 200:
                        raise SystemExit(f"loading {lora} failed: {answer.text}")
                models += list(loras)
            for model in models:
                asyncio.run(level(url, [model], 1, 1, 8, tokenizer))  # warm: first-call costs are not load
            table[name] = []
            for clients in args.clients:
                row = asyncio.run(level(url, models, clients, args.requests, args.max_tokens, tokenizer))
                table[name].append(row)
                said = (
                    f"{name:>10} {clients:>3} clients: {row['tokens_per_s']:>7} tok/s, TTFT p50 {row['ttft_p50_s']} s"
                )
                print(said, f"p99 {row['ttft_p99_s']} s, gap p50 {row['gap_p50_ms']} ms, errors {row['errors']}")
        finally:
            proc.terminate()
            proc.wait(60)

    print(f"\n{args.requests} streamed requests per client, max_tokens {args.max_tokens}, temperature 0, 2 CPU cores\n")
    print("| server | clients | requests | tokens/s | TTFT p50 s | TTFT p99 s | gap p50 ms | gap p99 ms | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in table.items():
        for r in rows:
            print(f"| {name} | {r['clients']} | {r['requests']} | {r['tokens_per_s']} | {r['ttft_p50_s']} | "
                  f"{r['ttft_p99_s']} | {r['gap_p50_ms']} | {r['gap_p99_ms']} | {r['errors']} |")  # fmt: skip
    verdict = "FAIL (llama.cpp's server was not run: pass --llama-python)"
    if "llama.cpp" in table:
        ours, theirs = ({r["clients"]: r for r in table[n]} for n in ("autoevolve", "llama.cpp"))
        checks = []
        if 16 in ours and 16 in theirs:
            ratio = ours[16]["tokens_per_s"] / max(theirs[16]["tokens_per_s"], 1e-9)
            checks.append((ratio >= 2.0, f"16 clients {ratio:.2f}x llama.cpp's tokens/s (goal >= 2x)"))
        if 1 in ours and 1 in theirs:
            ratio = ours[1]["tokens_per_s"] / max(theirs[1]["tokens_per_s"], 1e-9)
            checks.append((ratio >= 0.5, f"1 client {ratio:.2f}x its tokens/s (goal >= 0.5x)"))
            ttft = (ours[1]["ttft_p50_s"] or 1e9) / max(theirs[1]["ttft_p50_s"] or 1e-9, 1e-9)
            checks.append((ttft <= 1.5, f"1 client TTFT p50 {ttft:.2f}x its (goal <= 1.5x)"))
        errors = sum(r["errors"] for r in table["autoevolve"])
        checks.append((errors == 0, f"{errors} failed requests"))
        verdict = ("PASS" if all(ok for ok, _ in checks) else "FAIL") + ": " + "; ".join(why for _, why in checks)
    print(f"\n{verdict}")
    write_json(Path(args.out), {"servers": table, "verdict": verdict, "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
