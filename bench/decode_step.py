"""One stream's decode step by how the weights are stored: where a single stream's speed can come from on a CPU.

A single stream on CPU is bound by reading the weights (every linear layer once per token). Side by side in one
process, the embedded SmolLM2-135M-Instruct decodes 48 greedy tokens after a short chat prompt, one stream, seven
ways. Through transformers' forward with its KV cache, one token per pass: fp32; the linear layers' weights in bf16
with everything else in fp32 (each layer's input cast to bf16, its output back to fp32); the whole model in bf16.
Through the decoder ``autoevolve serve`` runs (``autoevolve.policy.decode``: oneDNN-packed fp32 weights, prompt-lookup
guesses): fp32; its one-token steps reading bf16 copies of the weights; its steps of up to four tokens reading the
4-bit codes of the weights that are 4-bit (``compact_weights``; the GGUF is Q4_1: every layer's are) and a bf16 copy
of the head; and as served (the server's default on a CPU), those weights with the lone row's steps compiled
(``compiled_steps``, ``autoevolve.policy.stream``; its compile timed). Per variant: milliseconds per generated token
(the faster of two passes; a median step for the forward passes, decode seconds over tokens for the decoder), tokens/s,
and how many of the 48 greedy tokens equal the fp32 forward's. Then every linear layer's product (the decoder's
fused groups and the head, as in ``autoevolve.policy.weights``) over 1, 2, 4 and 16 rows, median of 5 passes over
all layers: oneDNN-packed fp32, bf16, int8 per row (weight-only, measured, not served: it would round the 4-bit
weights) and 4-bit; the served step's share spent in its products; and the tokens/s the fastest products alone
would allow. Last, time to the first token as served (``first_token``): prefix caching beside none.

Goal (the serving single-stream goal): the decoder as served reaches >= 0.5x llama.cpp's single-stream tokens/s as
recorded in bench/results/serve_load.json.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/decode_step.py
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

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
    """Median seconds per decode step, and the greedy tokens (the prompt's, then one per step)."""
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times, tokens = [], [int(token)]
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


def served(policy: Any, messages: list[dict[str, str]]) -> tuple[float, list[int]]:
    """Seconds per generated token of the serving decoder, and its greedy tokens."""
    from autoevolve.policy import ChatRequest
    from autoevolve.policy.decode import Stats

    policy.decoder.stats = Stats()
    tokens: list[int] = []
    policy.generate(
        [ChatRequest(messages=messages, max_new_tokens=STEPS)], listeners=[lambda new: tokens.extend(new) or True]
    )
    return policy.decoder.stats.decode_s / policy.decoder.stats.decode_tokens, tokens


def first_token(policy: Any) -> dict[str, float]:
    """Median milliseconds to the first token over the serving bench's eight chat prompts, one at a time, as served
    (a key on every call, so a call starts from the longest prefix an earlier one computed) beside no key (each
    prompt computed whole): a first pass (the default system prompt and the template reused from the prompt
    before) and a second (each prompt seen before)."""
    from serve_load import PROMPTS

    from autoevolve.fleet.serving.worker import PREFIXES
    from autoevolve.policy import ChatRequest

    def ms(prompt: str, key: str | None) -> float:
        started, first = time.perf_counter(), []
        request = ChatRequest(messages=[{"role": "user", "content": prompt}], max_new_tokens=2, cache_key=key)
        policy.generate([request], listeners=[lambda _: first.append(time.perf_counter()) or True])
        return (first[0] - started) * 1e3

    policy.decoder.store.forget()
    out = {"no_key_ms": statistics.median(ms(p, None) for p in PROMPTS)}
    out["prefix_reused_ms"] = statistics.median(ms(p, PREFIXES) for p in PROMPTS)
    out["prompt_seen_ms"] = statistics.median(ms(p, PREFIXES) for p in PROMPTS)
    return {k: round(v, 1) for k, v in out.items()}


def bf16_product(w: torch.Tensor) -> Any:
    """x @ w.T from a bf16 copy of w, the input cast to bf16 and the output back."""
    half = w.to(torch.bfloat16)
    return lambda x: torch.nn.functional.linear(x.to(torch.bfloat16), half).float()


def int8_product(w: torch.Tensor) -> Any:
    """x @ w.T from w as int8 with one bf16 scale per output row (weight-only, symmetric)."""
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    codes, scale = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(torch.bfloat16)
    return lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), codes, scale).float()


def bf16_copies(policy: Any) -> Any:
    """The policy with bf16 copies where its decoder reads 4-bit codes (the one-token weights before 4-bit)."""
    for layer in policy.decoder.base:
        for group, projection in layer.items():
            if projection.four_bit is not None:
                layer[group] = replace(projection, four_bit=None, half=projection.weight.to(torch.bfloat16))
    return policy


@torch.inference_mode()
def products_by_rows(model: torch.nn.Module) -> tuple[list[dict[str, Any]], int]:
    """Milliseconds for every layer's products over a few rows, by how the weights are stored: fp32 as the decoder
    packs it, bf16 copies, int8 (per row) and 4-bit (``FourBit``, where the weight is 4-bit; the rest bf16)
    weight-only with the input cast to bf16; and how many of the weights are 4-bit already."""
    from autoevolve.policy.weights import FourBit, base_projections, pack

    fp32 = [g for layer in model.model.layers for g in base_projections(layer).values()]
    fp32.append(pack(model.lm_head.weight.detach()))
    four_bit = [FourBit.of(g.weight) for g in fp32]  # None where a weight is not 4-bit: its bf16 copy is read
    stored = {
        "fp32": fp32,
        "bf16": [bf16_product(g.weight) for g in fp32],
        "int8": [int8_product(g.weight) for g in fp32],
        "int4": [codes or bf16_product(g.weight) for codes, g in zip(four_bit, fp32, strict=True)],
    }
    rows = []
    for n in (1, 2, 4, 16):
        inputs = [torch.randn(n, g.weight.shape[1]) for g in fp32]
        timed = {}
        for name, products in stored.items():
            times = []
            for _ in range(6):  # the first pass warms up
                started = time.perf_counter()
                for product, x in zip(products, inputs, strict=True):
                    product(x)
                times.append(time.perf_counter() - started)
            timed[f"{name}_ms"] = round(statistics.median(times[1:]) * 1e3, 1)
        rows.append({"rows": n, **timed})
    return rows, sum(codes is not None for codes in four_bit)


def main() -> None:
    from autoevolve.model import load
    from autoevolve.policy.local import LocalPolicy

    model, tokenizer = load("smollm2-135m-instruct", "float32")
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    forward = {"fp32": model, "bf16 linears": bf16_linears(model), "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    decoders = {
        "decoder fp32": LocalPolicy("smollm2-135m-instruct", dtype="float32"),
        "decoder, bf16 one-token steps": bf16_copies(
            LocalPolicy("smollm2-135m-instruct", dtype="float32", compact_weights=True)
        ),
        "decoder, 4-bit few-row steps": LocalPolicy("smollm2-135m-instruct", dtype="float32", compact_weights=True),
        "decoder, 4-bit, compiled lone row": LocalPolicy(
            "smollm2-135m-instruct", dtype="float32", compact_weights=True, compiled_steps=True
        ),
    }
    compile_s = decoders["decoder, 4-bit, compiled lone row"].warm_steps()
    for policy in decoders.values():
        served(policy, messages)  # the shared prefix computed once, as on a warm server
    best: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        runs = [(name, lambda m=m: decode(m, ids)) for name, m in forward.items()]
        runs += [(name, lambda p=p: served(p, messages)) for name, p in decoders.items()]
        for name, run in runs:
            seconds, tokens[name] = run()
            best[name] = min(best.get(name, seconds), seconds)
    reference = tokens["fp32"]
    rows = [
        {"variant": name, "ms_per_token": round(best[name] * 1e3, 1), "tokens_per_s": round(1 / best[name], 1),
         "tokens_equal_fp32": sum(a == b for a, b in zip(tokens[name][:STEPS], reference[:STEPS], strict=False))}
        for name in best
    ]  # fmt: skip
    print(f"{'variant':<34} {'ms/token':>9} {'tokens/s':>9} {'tokens equal to fp32':>21}")
    for r in rows:
        equal = f"{r['tokens_equal_fp32']}/{STEPS}"
        print(f"{r['variant']:<34} {r['ms_per_token']:>9.1f} {r['tokens_per_s']:>9.1f} {equal:>21}")
    products, four_bit = products_by_rows(model)
    head = f"{'products ms: fp32':>18} {'bf16':>6} {'int8':>6} {'int4':>6} {'bf16/fp32':>10} {'int4/bf16':>10}"
    print(f"\n{'rows':>4} {head}")
    for r in products:
        print(f"{r['rows']:>4} {r['fp32_ms']:>18.1f} {r['bf16_ms']:>6.1f} {r['int8_ms']:>6.1f} {r['int4_ms']:>6.1f}"
              f" {r['bf16_ms'] / r['fp32_ms']:>10.2f} {r['int4_ms'] / r['bf16_ms']:>10.2f}")  # fmt: skip
    one, served_ms = products[0], rows[-1]["ms_per_token"]
    share, ceiling = one["int4_ms"] / served_ms, 1e3 / min(one["bf16_ms"], one["int8_ms"], one["int4_ms"])
    print(f"4-bit already: {four_bit} of {4 * len(model.model.layers) + 1} weights (int4 reads those, bf16 the rest)")
    print(
        f"one row's products as served are {share:.0%} of the served step; the fastest products alone would allow"
        f" {ceiling:.0f} tokens/s"
    )
    print(f"the lone row's step compiled in {compile_s:.0f} s (inductor's cache on this machine may hold it)")
    first = first_token(decoders["decoder, 4-bit, compiled lone row"])
    print(
        f"first token, median over 8 chat prompts: {first['no_key_ms']:.0f} ms computed whole, "
        f"{first['prefix_reused_ms']:.0f} ms with the system prompt reused, "
        f"{first['prompt_seen_ms']:.0f} ms seen before"
    )
    llama = llama_cpp_single_stream()
    server = rows[-1]
    if llama is None:
        check = "no llama.cpp single-stream row in bench/results/serve_load.json: run make bench-serve first"
    else:
        ratio = server["tokens_per_s"] / llama
        verdict = "PASS" if ratio >= 0.5 else "FAIL"
        check = (
            f"{server['variant']} (as served): {server['tokens_per_s']:.1f} tokens/s, {ratio:.2f}x llama.cpp's single "
            f"stream ({llama:.1f}; goal >= 0.5x): {verdict}"
        )
    print("\n" + check)
    write_json(
        ROOT / "bench" / "results" / "decode_step.json",
        {
            "rows": rows,
            "products": products,
            "four_bit_weights": four_bit,
            "products_share": round(share, 2),
            "products_ceiling_tokens_per_s": round(ceiling, 1),
            "compile_s": round(compile_s, 1),
            "first_token": first,
            "llama_cpp": llama,
            "check": check,
        },
    )


if __name__ == "__main__":
    main()
