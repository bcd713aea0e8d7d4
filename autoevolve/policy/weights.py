"""A decoder layer's projections as the decoder computes them: fused base weights and each adapter's LoRA factors.

The query, key and value projections read the same input, and so do the MLP's gate and up projections: each group
is one matrix product with the weights stacked, instead of three or two. A LoRA adapter adds ``B (A x) * scaling``
to each projection; a group's A matrices are stacked too and its B matrices placed block-diagonally, so the
adapter costs two small products per group, in the adapter's own dtype as PEFT computes it. Only plain LoRA on
``nn.Linear`` layers is read this way; a layer with anything else (DoRA, a LoRA bias, a merged adapter) makes
``Unsupported`` the answer and the decoder falls back to calling the modules.

On CPU, fp32 base weights are also kept pre-packed for oneDNN (``pack``): its matrix product ran 2-3x faster than
``F.linear``'s BLAS call on the decode and prefill shapes measured (``bench/rollout_throughput.py``), most of all on
AMD processors. The packed product computes the same sums in another order, so results differ by float rounding.

A step that computes one token (one stream decoding) reads every weight once for a single row, so its time is the
time to read the weights: with ``compact`` the base weights also keep a bf16 copy that such steps read instead (the
input cast to bf16, the output back), half the bytes. On a CPU without native bf16 arithmetic this is faster only
for one row (``bench/decode_step.py``); steps of more rows keep the fp32 weights. A weight that is 4-bit already
(every group of 32 inputs in a row takes at most 16 evenly spaced values, as a Q4_1 GGUF's layers dequantise to) is
kept as those 4-bit codes instead, with each group's step and minimum (``FourBit``), and read for steps of up to
``FOUR_BIT_ROWS`` rows: a quarter of the bf16 copy's bytes, and faster there too (torch's CPU int4 kernel, bf16
in and out, as gpt-fast runs it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}  # fmt: skip


class Unsupported(ValueError):
    """A projection this module cannot read (the decoder calls the modules instead)."""


@dataclass
class Projection:
    """One group's base weight [out, in] (and bias), plus an adapter's stacked A [rank, in] and scaled B [out, rank]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout (see ``pack``), or None
    half: torch.Tensor | None = None  # a bf16 copy of the weight, read for one-token inputs (see ``pack``), or None
    four_bit: FourBit | None = None  # the weight's own 4-bit codes, read for inputs of a few rows, or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The group's outputs, concatenated in the group's order."""
        if self.four_bit is not None and x.numel() <= FOUR_BIT_ROWS * x.shape[-1]:
            y = self.four_bit(x)
            y = y if self.bias is None else y + self.bias
        elif self.half is not None and x.numel() == x.shape[-1]:
            y = F.linear(x.to(self.half.dtype), self.half).to(x.dtype)
            y = y if self.bias is None else y + self.bias
        elif self.packed is not None and not torch.compiler.is_compiling():  # inductor packs weights its own way
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.a is None:
            return y
        delta = F.linear(F.linear(x.to(self.a.dtype), self.a), self.b)
        return (y + delta).to(y.dtype)

    def with_lora(self, a: torch.Tensor, b: torch.Tensor) -> Projection:
        """The same base weight with an adapter's factors."""
        return Projection(self.weight, self.bias, a, b, self.packed, self.half, self.four_bit)


FOUR_BIT_GROUP = 32  # inputs per group of a 4-bit weight (llama.cpp's Q4 block)
FOUR_BIT_ROWS = 4  # up to this many rows the int4 product beats oneDNN's fp32 one (bench/decode_step.py)


@dataclass
class FourBit:
    """A weight [out, in] whose every group of 32 inputs in a row is ``minimum + step * code`` with codes 0-15, as
    torch's CPU int4 kernel reads it: the codes packed, each group's step and (minimum + 8 steps) in bf16."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [in / 32, out, 2]

    @classmethod
    def of(cls, weight: torch.Tensor) -> FourBit | None:
        """The weight's 4-bit form, or None where it is not 4-bit (or this torch has no CPU int4 kernel)."""
        out, inputs = weight.shape
        if inputs % FOUR_BIT_GROUP or out % 16 or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return None
        groups = weight.reshape(out, inputs // FOUR_BIT_GROUP, FOUR_BIT_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        step = ((high - low) / 15).clamp(min=torch.finfo(weight.dtype).tiny)
        codes = ((groups - low) / step).round().clamp(0, 15)
        if (codes * step + low - groups).abs().max() > 1e-6 * weight.abs().max():
            return None  # not 4-bit: quantising it would change the model
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(out, inputs).to(torch.int32), 1)
        scales_zeros = torch.cat([step, low + 8 * step], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, scales_zeros.to(torch.bfloat16))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T, computed from the codes in bf16, returned in x's dtype."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, FOUR_BIT_GROUP, self.scales_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


@dataclass
class Stack:
    """One group's LoRA factors of several adapters side by side: their A matrices stacked, their scaled B matrices
    next to each other, and which adapter owns each rank column."""

    a: torch.Tensor  # [ranks, in]
    b: torch.Tensor  # [out, ranks]
    owner: torch.Tensor  # [ranks]: the adapter's index, in the order ``stack`` was given them


def stack(adapters: list[list[dict[str, Projection]]]) -> list[dict[str, Stack | None]]:
    """Every layer's groups of several adapters' layers (as ``adapter_projections`` makes them) side by side; None
    for a group none of them touches. Factors of different dtypes are computed in the widest."""
    out = []
    for index, layer in enumerate(adapters[0]):
        groups: dict[str, Stack | None] = {}
        for group in layer:
            owned = [(n, own[index][group]) for n, own in enumerate(adapters) if own[index][group].a is not None]
            if not owned:
                groups[group] = None
                continue
            dtype = functools.reduce(torch.promote_types, [p.a.dtype for _, p in owned])
            a = torch.cat([p.a.to(dtype) for _, p in owned])
            b = torch.cat([p.b.to(dtype) for _, p in owned], dim=1)
            owner = torch.cat([torch.full((p.a.shape[0],), n) for n, p in owned])
            groups[group] = Stack(a, b, owner)
        out.append(groups)
    return out


@dataclass
class Mixed:
    """One group's projection for a batch whose rows use several adapters: the base weight for every row, then
    every adapter's LoRA in two products for all rows, each row's middle values masked to its own adapter's columns
    (a row of the base keeps none): three ops a group however many adapters the batch holds. Picking each adapter's
    rows out and adding them back instead took 144-148 ms a step of 16 rows over the base and two adapters, against
    135-141 ms this way (the base alone: 107-117 ms)."""

    base: Projection
    lora: Stack
    mask: torch.Tensor  # [rows, 1, ranks]: whether a column is the row's adapter's

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The group's outputs, each row with its own adapter's LoRA added."""
        y = self.base(x)
        middle = F.linear(x.to(self.lora.a.dtype), self.lora.a) * self.mask
        return (y + F.linear(middle, self.lora.b)).to(y.dtype)


def mixed(base: list[dict[str, Projection]], stacks: list[dict[str, Stack | None]], owners: torch.Tensor) -> list:
    """Every layer's groups for rows of several adapters: ``owners`` gives each row's adapter, as its index among
    the ``stack``'s (-1 for a row of the base)."""
    rows = owners[:, None]
    return [
        {group: layer[group] if lora is None else Mixed(layer[group], lora, (rows == lora.owner)[:, None])
         for group, lora in stacks[index].items()}
        for index, layer in enumerate(base)
    ]  # fmt: skip


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, compact: bool = False) -> Projection:
    """A projection of a base weight [out, in], pre-packed for oneDNN where that runs here (fp32 on CPU); with
    ``compact``, an fp32 CPU weight also keeps its 4-bit codes for inputs of a few rows where it is 4-bit, else a bf16
    copy for one-token inputs."""
    packed = four_bit = copy = None
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_linear():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
    if compact and weight.device.type == "cpu" and weight.dtype == torch.float32:
        four_bit = FourBit.of(weight)
    if compact and weight.dtype == torch.float32 and four_bit is None:
        copy = weight.to(torch.bfloat16)
    return Projection(weight, bias, packed=packed, half=copy, four_bit=four_bit)


ROWS_HINT = 64  # oneDNN packs for a typical row count; any count computes correctly


@functools.cache
def _onednn_linear() -> bool:
    """Whether oneDNN's packed linear exists in this torch and agrees with ``F.linear`` on a small product."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=gen), torch.randn(3, 16, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), atol=1e-4))


def base_projections(layer: Any, compact: bool = False) -> dict[str, Projection]:
    """A layer's four projection groups with the base weights (stacked once; the adapters share them); ``compact``: see
    ``pack``."""
    out = {}
    for group, names in GROUPS.items():
        modules = [_module(layer, name) for name in names]
        bases = [getattr(m, "base_layer", m) for m in modules]
        if any(not isinstance(b, torch.nn.Linear) for b in bases):
            raise Unsupported(f"{group}: not nn.Linear layers")
        weight = bases[0].weight if len(bases) == 1 else torch.cat([b.weight for b in bases])
        biases = [b.bias for b in bases]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.weight.shape[0], dtype=w.weight.dtype)
                              for b, w in zip(biases, bases, strict=True)])  # fmt: skip
        out[group] = pack(weight.detach(), bias.detach() if bias is not None else None, compact)
    return out


def adapter_projections(layer: Any, base: dict[str, Projection], adapter: str) -> dict[str, Projection]:
    """The base groups with one adapter's LoRA factors stacked (groups the adapter does not touch stay as they are)."""
    out = {}
    for group, names in GROUPS.items():
        factors = [_lora(_module(layer, name), adapter) for name in names]
        if all(f is None for f in factors):
            out[group] = base[group]
            continue
        sizes = [m.out_features for m in (_module(layer, name) for name in names)]
        dtype = next(f[0].dtype for f in factors if f is not None)
        a_parts = [f[0] for f in factors if f is not None]
        b = torch.zeros(sum(sizes), sum(p.shape[0] for p in a_parts), dtype=dtype)
        row = col = 0
        for size, f in zip(sizes, factors, strict=True):
            if f is not None:
                b[row : row + size, col : col + f[0].shape[0]] = f[1] * f[2]
                col += f[0].shape[0]
            row += size
        out[group] = base[group].with_lora(torch.cat(a_parts).detach(), b)
    return out


def beyond_projections(model: Any, layers: Any, adapter: str) -> list[str]:
    """The modules an adapter changes other than the decoder layers' projections (an embedding's LoRA, a trained
    copy of the head, trainable tokens): the decoder computes only the projections' LoRA, so it cannot serve such an
    adapter alone."""
    mine = {id(_module(layer, name)) for layer in layers for names in GROUPS.values() for name in names}
    found = []
    for name, module in model.named_modules():
        if id(module) in mine:
            continue
        for attr in getattr(module, "adapter_layer_names", ()):  # PEFT's per-adapter weights of a wrapped module
            held = module
            for part in attr.split("."):
                held = getattr(held, part, None)
            if hasattr(held, "keys") and adapter in held.keys():
                found.append(name)
                break
    return found


def _module(layer: Any, name: str) -> Any:
    """A projection module of a decoder layer by name."""
    return getattr(layer.self_attn if name in GROUPS["qkv"] + GROUPS["o"] else layer.mlp, name)


def _lora(module: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of a plain LoRA adapter on a PEFT layer; None where the adapter does not touch it."""
    if adapter not in getattr(module, "lora_A", {}):
        return None
    if adapter in getattr(module, "lora_variant", {}) or getattr(module, "fan_in_fan_out", False):
        raise Unsupported(f"adapter {adapter!r} is not plain LoRA (DoRA or another variant)")
    if module.lora_B[adapter].bias is not None or getattr(module, "merged", False):
        raise Unsupported(f"adapter {adapter!r} has a LoRA bias or is merged into the weights")
    return module.lora_A[adapter].weight.detach(), module.lora_B[adapter].weight.detach(), module.scaling[adapter]
