"""One stream's decode step by weight dtype: where a single stream's speed can come from on a CPU.

A single stream on CPU is bound by reading the weights (every linear layer once per token). Side by side in one
process, the embedded SmolLM2-135M-Instruct decodes 48 greedy tokens after a short chat prompt, one token per
forward pass with its KV cache, three ways: fp32 (what the server runs on a CPU without native bf16); the linear
layers' weights in bf16 with everything else in fp32 (each layer's input cast to bf16, its output back to fp32); and
the whole model in bf16. Per variant: the median step time over two passes (the faster pass), tokens/s, and how
many of the 48 greedy tokens equal fp32's.

Goal (the serving single-stream goal): the fastest variant whose tokens equal fp32's reaches >= 0.5x llama.cpp's
single-stream tokens/s as recorded in bench/results/serve_load.json.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/decode_step.py
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import write_json  # noqa: E402

STEPS = 48
PROMPT = "Tell me a story about a dragon."


def bf16_linears(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose linear layers hold bf16 weights and compute in bf16 on an fp32 stream."""
    out = copy.deepcopy(model)
    for module in out.modules():
        if isinstance(module, torch.nn.Linear):  # its own bf16 copy: the tied embedding stays fp32
            module.weight = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16),))
            module.register_forward_hook(lambda _, __, output: output.float())
    return out


@torch.inference_mode()
def decode(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, list[int]]:
    """Median seconds per decode step, and the greedy tokens."""
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times, tokens = [], []
    for _ in range(STEPS):
        started = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - started)
        tokens.append(int(token))
    return statistics.median(times), tokens


def llama_cpp_single_stream() -> float | None:
    """llama.cpp's single-stream tokens/s from the serving bench's recorded run, if there is one."""
    path = ROOT / "bench" / "results" / "serve_load.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["servers"].get("llama.cpp", [])
    return next((r["tokens_per_s"] for r in rows if r["clients"] == 1), None)


def main() -> None:
    from autoevolve.model import load

    model, tokenizer = load("smollm2-135m-instruct", "float32")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    variants = {"fp32": model, "bf16 linears": bf16_linears(model), "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    best: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        for name, m in variants.items():
            seconds, tokens[name] = decode(m, ids)
            best[name] = min(best.get(name, seconds), seconds)
    rows = [
        {"variant": name, "ms_per_step": round(best[name] * 1e3, 1), "tokens_per_s": round(1 / best[name], 1),
         "tokens_equal_fp32": sum(a == b for a, b in zip(tokens[name], tokens["fp32"], strict=True))}
        for name in variants
    ]  # fmt: skip
    print(f"{'variant':<14} {'ms/step':>8} {'tokens/s':>9} {'tokens equal to fp32':>21}")
    for r in rows:
        equal = f"{r['tokens_equal_fp32']}/{STEPS}"
        print(f"{r['variant']:<14} {r['ms_per_step']:>8.1f} {r['tokens_per_s']:>9.1f} {equal:>21}")
    reference = llama_cpp_single_stream()
    exact = max((r for r in rows if r["tokens_equal_fp32"] == STEPS), key=lambda r: r["tokens_per_s"])
    if reference is None:
        check = "no llama.cpp single-stream row in bench/results/serve_load.json: run make bench-serve first"
    else:
        ratio = exact["tokens_per_s"] / reference
        verdict = "PASS" if ratio >= 0.5 else "FAIL"
        check = (
            f"{exact['variant']} (tokens equal to fp32's): {exact['tokens_per_s']:.1f} tokens/s, {ratio:.2f}x "
            f"llama.cpp's single stream ({reference:.1f}; goal >= 0.5x): {verdict}"
        )
    print("\n" + check)
    write_json(ROOT / "bench" / "results" / "decode_step.json", {"rows": rows, "llama_cpp": reference, "check": check})


if __name__ == "__main__":
    main()
