"""KV-cached batched decoding for Llama-shaped models, built from the model's own modules (so LoRA layers apply).

Why not ``model.generate``: a batch of rollout prompts shares a long prefix (system prompt, tool list), and
generate attends to a copy of that prefix per row, appends to its cache with a copy every step, and keeps every
row in the batch until the slowest one ends. Here the shared prefix's keys and values are computed once (and kept
across calls, per adapter), and attention reads three segments: the prefix (one matrix product for all rows), each
row's own prompt (computed once at prefill, stored contiguously), and the tokens generated so far (one column per
step in a buffer allocated once). A row leaves the batch as soon as it ends, and a new row may join between steps
(``arrivals``: continuous batching, as a server needs); the batch in flight is ``autoevolve.policy.batch``'s. An
episode's next call starts from the keys and values its rows left in the store (``autoevolve.policy.kvstore``), so
only the reply, the tool result and the new generation prompt are computed again.

Greedy decoding gives the tokens ``generate`` gives, up to float rounding (the tests compare them). Sampling applies
the repetition penalty, temperature, top-k, top-p and min-p, and draws from a generator seeded per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from autoevolve.policy.batch import Batch, Joiner, Listener, Sampling, Scored
from autoevolve.policy.kvstore import KV, KVStore, Sequence
from autoevolve.policy.stream import Streams
from autoevolve.policy.weights import (
    Projection,
    Unsupported,
    adapter_projections,
    base_projections,
    beyond_projections,
    pack,
)

if TYPE_CHECKING:
    from autoevolve.policy.batch import Rows

SUPPORTED = ("llama", "mistral", "qwen2")  # decoder layers of exactly this shape; others use model.generate
PREFILL_TOKENS = 2048  # tokens per prefill chunk: bounds the attention's memory
PREFIXES_KEPT = 8  # shared prefixes kept: one per config and adapter in use is plenty
ADAPTERS_KEPT = 4  # adapters whose stacked LoRA factors are kept

OWN = object()  # Decoder.generate's kv_adapter default: the keys and values of the adapter that generates
Layers = list[dict[str, Projection]]  # per layer: the projection groups (see autoevolve.policy.weights)
STORE_BYTES = 1 << 30  # keys and values kept for later calls (about 45k tokens of SmolLM2-135M in bf16)


def supports(model: Any) -> bool:
    """Whether a causal LM has the decoder shape this module computes (no q/k norms, no sliding window in use)."""
    config = model.config
    if config.model_type not in SUPPORTED or getattr(config, "use_sliding_window", False):
        return False
    layer = model.model.layers[0]
    try:
        base_projections(layer)
    except (Unsupported, AttributeError):
        return False
    return not hasattr(layer.self_attn, "q_norm") and hasattr(layer.mlp, "act_fn")


@dataclass
class Stats:
    """Work done since the decoder was made: tokens computed, tokens taken from stored keys and values, seconds."""

    calls: int = 0
    rows: int = 0  # prompts completed
    prefill_tokens: int = 0  # prompt tokens run through the model
    reused_tokens: int = 0  # prompt tokens whose keys and values came from the store instead
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens generated (stop tokens included)
    guessed_tokens: int = 0  # of those, prompt-lookup guesses the model confirmed (see Guesses)
    compiled_steps: int = 0  # decode steps of a lone row through the compiled step (autoevolve.policy.stream)
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Decoder:
    """Batched decoding over a (possibly LoRA-wrapped) Llama-shaped model; see the module docstring."""

    def __init__(
        self,
        model: Any,
        stop_ids: set[int],
        store_bytes: int = STORE_BYTES,
        compact_weights: bool = False,
        compiled_steps: bool = False,
    ) -> None:
        """``compact_weights``: steps of a few tokens read compact copies of fp32 base weights, the 4-bit codes of a
        weight that is 4-bit, else a bf16 copy for one token (see ``autoevolve.policy.weights``): a few streams
        decode faster on a CPU, for 1.25x (4-bit) to 1.5x (bf16) the weights' memory. ``compiled_steps``: a lone
        row decodes through a compiled step once it is compiled (``autoevolve.policy.stream``)."""
        self.model = model  # PEFT wraps its modules in place: each adapter's factors are read from them by name
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.head = model.lm_head
        head_bias = None if self.head.bias is None else self.head.bias.detach()
        self.logits = pack(self.head.weight.detach(), head_bias, compact_weights)
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.groups = self.heads // self.kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.layers[0].self_attn.scaling
        self.stop_ids = stop_ids
        self.store = KVStore(store_bytes)
        self.prefixes: OrderedDict[tuple, Sequence] = OrderedDict()  # computed from scratch: the same in any process
        self.base: Layers = [base_projections(layer, compact_weights) for layer in self.layers]
        self.adapters: OrderedDict[str, Layers] = OrderedDict()
        self.refused: dict[str, str] = {}  # adapters it cannot compute, and why: judged once, until forgotten
        self.streams = Streams(self) if compiled_steps else None
        self.stats = Stats()

    def forget(self, adapter: str | None = None) -> None:
        """Drop what depends on an adapter's weights (or on every adapter's): keys, values and LoRA factors."""
        self.store.forget(adapter)
        for key in [k for k in self.prefixes if adapter is None or k[0] == adapter]:
            del self.prefixes[key]
        for name in [n for n in self.adapters if adapter is None or n == adapter]:
            del self.adapters[name]
        for name in [n for n in self.refused if adapter is None or n == adapter]:
            del self.refused[name]
        if self.streams is not None:
            self.streams.forget(adapter)

    def serves(self, adapter: str | None) -> bool:
        """Whether this decoder computes an adapter (plain LoRA); else the caller falls back to model.generate."""
        try:
            self._layers(adapter)
        except Unsupported:
            return False
        return True

    def _layers(self, adapter: str | None) -> Layers:
        """Every layer's projections with an adapter's LoRA factors (the base's for None), built once and kept."""
        if adapter is None:
            return self.base
        if adapter in self.refused:  # judging again walks the model (~10 ms): a held request asks every step
            raise Unsupported(self.refused[adapter])
        if adapter not in self.adapters:
            try:
                if beyond := beyond_projections(self.model, self.layers, adapter):
                    raise Unsupported(f"adapter {adapter!r} changes {beyond[0]}, which the decoder does not compute")
                self.adapters[adapter] = [
                    adapter_projections(layer, base, adapter)
                    for layer, base in zip(self.layers, self.base, strict=True)
                ]
            except Unsupported as exc:
                self.refused[adapter] = str(exc)
                raise
            while len(self.adapters) > ADAPTERS_KEPT:
                self.adapters.popitem(last=False)
        self.adapters.move_to_end(adapter)
        return self.adapters[adapter]

    @torch.inference_mode()
    def generate(
        self,
        rows: list[list[int]],
        *,
        adapter: str | None,
        max_new: int,
        sampling: Sampling | None = None,
        seed: int = 0,
        cache_key: str | None = None,
        guides: list[Any] | None = None,
        kv_adapter: Any = OWN,
        listeners: list[Listener | None] | None = None,
        scores: list[list[Scored]] | None = None,
        top: int = 0,
        arrivals: Callable[[int], list[Joiner]] | None = None,
    ) -> list[list[int]]:
        """New tokens for each prompt, up to ``max_new``, without the stop token that ended it.

        Rows may start from keys and values stored by earlier calls with the same ``cache_key`` (see
        ``autoevolve.policy.kvstore``); None: from the shared-prefix cache only. A row with a guide (see
        ``autoevolve.policy.grammar.Guide``) picks only tokens its grammar allows; guides turn prompt-lookup guessing
        off.
        ``kv_adapter`` (an adapter's name, None for the bare base): take the prompt's stored keys and values from
        what that adapter computed instead of this one's (an approximation: they depend on the weights; nothing
        computed so is stored).
        ``listeners``: per row, called with each step's new tokens as they are generated (a stream's); a row whose
        listener returns False ends there (its client left, or its stop sequence came).
        ``scores`` (an empty list per row): filled with each generated token's log-probability under the model (its
        raw logits, before temperature and grammar) and the ``top`` likeliest tokens' (guessing off).
        ``sampling``: how tokens are picked (default greedy).
        ``arrivals`` (continuous batching): called after each decode step with the number of live rows; the rows
        it returns join the batch at the next step (their prompts are computed then) and leave it when they end, each
        handing its tokens to its own ``Joiner.done``. They decode under this call's adapter and sampling settings.
        """
        n = len(rows)
        guides = guides if guides and any(guides) else [None] * n
        own = zip(rows, listeners or [None] * n, guides, scores or [None] * n, strict=True)
        borrowed = kv_adapter is not OWN
        kv_adapter = kv_adapter if borrowed else adapter
        batch = Batch(self, adapter, kv_adapter, borrowed, cache_key, sampling or Sampling(), seed, top)
        batch.add([Joiner(r, max_new, listener, guide, score) for r, listener, guide, score in own])
        while batch.step():
            joining = arrivals(len(batch.active)) if arrivals is not None else []
            if joining:
                batch.add(joining)
        return batch.out[:n]

    def _append(self, out: list[int], tokens: list[int], max_new: int) -> bool:
        """Append new tokens to a row up to its stop token or ``max_new``; whether the row goes on."""
        for token in tokens:
            self.stats.decode_tokens += 1
            if token in self.stop_ids:
                return False
            out.append(token)
            if len(out) >= max_new:
                return False
        return True

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits (fp32) of hidden states."""
        return self.logits(_rms_norm(self.norm, hidden)).float()

    def _prefix(self, adapter: str | None, weights: Layers, ids: list[int]) -> Sequence:
        """The shared prefix's keys and values (one row), computed from scratch once per adapter and kept."""
        key = (adapter, tuple(ids))
        if key in self.prefixes:
            self.prefixes.move_to_end(key)
            self.stats.reused_tokens += len(ids)
            return self.prefixes[key]
        layers: KV = []
        if ids:
            x = self.embed(torch.tensor([ids]))
            cos, sin = self.rotary(x, torch.arange(len(ids)).unsqueeze(0))
            for layer, w in zip(self.layers, weights, strict=True):
                q, k, v = self._qkv(layer, w, x, cos, sin)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
                x = self._finish(layer, w, x, o)
                layers.append((k[0], v[0]))
            self.stats.prefill_tokens += len(ids)
        self.prefixes[key] = Sequence(adapter, "", np.asarray(ids), layers)
        while len(self.prefixes) > PREFIXES_KEPT:
            self.prefixes.popitem(last=False)
        return self.prefixes[key]

    def _stored(
        self, adapter: str | None, cache_key: str | None, row: list[int], shared: int
    ) -> tuple[Sequence | None, int]:
        """A stored sequence this row starts with beyond the shared prefix, and how many of its own tokens it gives."""
        if cache_key is None:
            return None, 0
        seq, known = self.store.longest(adapter, cache_key, row)
        n = min(known, len(row) - 1) - shared  # the last token is always computed: its logits pick the first reply
        if seq is None or n <= 0:
            return None, 0
        self.stats.reused_tokens += n
        return seq, n

    def _prefill(
        self,
        weights: Callable[[slice], Layers],
        own: list[list[int]],
        fresh: list[int],
        shared: int,
        prefix: Sequence,
        cache: Rows,
    ) -> torch.Tensor:
        """Compute each slot's fresh prompt tokens in chunks of similar count; returns each slot's next-token logits.
        ``weights``: the layers a chunk's slots compute under.

        A chunk computes the last ``window`` own tokens of each of its rows (its largest fresh count): a row with
        fewer fresh tokens recomputes a few stored ones, which keeps the chunk one rectangle.
        """
        last = torch.empty(len(own), self.head.out_features)
        start = 0
        while start < len(own):
            end = start + 1  # slots are sorted by fresh count: a chunk's last row has the most
            while end < len(own) and (end + 1 - start) * fresh[end] <= PREFILL_TOKENS:
                end += 1
            window = fresh[end - 1]
            chunk = [x[-window:] for x in own[start:end]]
            ids = torch.tensor([[0] * (window - len(x)) + x for x in chunk])  # left-padded to the window
            ends = [shared + len(x) for x in own[start:end]]
            positions = torch.tensor([range(e - window, e) for e in ends]).clamp(min=0)
            hidden = self._chunk(weights(slice(start, end)), ids, positions, prefix, cache, start)
            last[start:end] = self._logits(hidden[:, -1])
            self.stats.prefill_tokens += sum(len(x) for x in chunk)
            start = end
        return last

    def _chunk(
        self, weights: Layers, ids: torch.Tensor, positions: torch.Tensor, prefix: Sequence, cache: Rows, first: int
    ) -> Any:
        """Hidden states of a prefill chunk (slots ``first``...), its keys and values written to the row cache.

        A query sees the whole prefix, its row's stored tokens before the window, and its row's valid tokens in the
        window up to itself; a padding query sees itself only, so no row of scores is empty (its output is unused).
        """
        rows, window = ids.shape
        slots = slice(first, first + rows)
        earliest = int((~cache.valid[slots]).sum(dim=1).min())  # the first column any row of the chunk uses
        before, columns = slice(earliest, cache.width - window), slice(cache.width - window, cache.width)
        inside = torch.ones(window, window, dtype=torch.bool).tril() & cache.valid[slots, None, columns]
        inside |= torch.eye(window, dtype=torch.bool)
        mask = torch.cat(
            [
                torch.ones(rows, window, prefix.shared, dtype=torch.bool),
                cache.valid[slots, None, before].expand(-1, window, -1),
                inside,
            ],
            dim=-1,
        ).unsqueeze(1)
        x = self.embed(ids)
        cos, sin = self.rotary(x, positions)
        for index, (layer, w) in enumerate(zip(self.layers, weights, strict=True)):
            q, k, v = self._qkv(layer, w, x, cos, sin)
            cache.k[index][slots, :, columns] = k
            cache.v[index][slots, :, columns] = v
            keys, values = [cache.k[index][slots, :, before], k], [cache.v[index][slots, :, before], v]
            if prefix.shared:
                pk, pv = prefix.prefix[index]
                keys.insert(0, pk.expand(rows, -1, -1, -1))
                values.insert(0, pv.expand(rows, -1, -1, -1))
            k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            x = self._finish(layer, w, x, o)
        return x

    def _decode(
        self, weights: Layers, ids: torch.Tensor, start: torch.Tensor, prefix: Sequence, cache: Rows, fed: torch.Tensor
    ) -> Any:
        """Hidden states of each row's next tokens (its last token, then its guesses), at positions ``start`` on.

        Their keys and values go to the generated-token buffer from column ``fed`` of each row; attention reads the
        prefix, the row's own prompt, and its generated tokens up to each query.
        """
        rows, width = ids.shape
        batch, kvh, g, d = rows * self.kv_heads, self.kv_heads, self.groups, self.head_dim
        offsets = torch.arange(width)
        columns = fed.unsqueeze(1) + offsets  # [rows, width]: where each new token's keys and values go
        seen = int(columns.max()) + 1
        later = torch.arange(seen) > columns.unsqueeze(2)  # [rows, width, seen]: after the query, or not written yet
        bias = None  # one stream's single token sees every column written so far: nothing to mask
        if later.any():
            bias = torch.zeros(later.shape, dtype=cache.dtype).masked_fill(later, float("-inf"))
            bias = bias[:, None, None].expand(rows, kvh, g, width, seen).reshape(batch, g * width, seen)
        x = self.embed(ids)
        cos, sin = self.rotary(x, start.unsqueeze(1) + offsets)
        at = (torch.arange(rows).unsqueeze(1).expand(rows, width), columns)
        for index, (layer, w) in enumerate(zip(self.layers, weights, strict=True)):
            q, k, v = self._qkv(layer, w, x, cos, sin)
            cache.gen_k[index][at[0], :, at[1]] = k.transpose(1, 2)
            cache.gen_v[index][at[0], :, at[1]] = v.transpose(1, 2)
            q = (q * self.scale).reshape(batch, g * width, d)  # heads h*g..h*g+g-1 share kv head h
            keys = [cache.k[index].view(batch, -1, d), cache.gen_k[index][:, :, :seen].reshape(batch, -1, d)]
            values = [cache.v[index].view(batch, -1, d), cache.gen_v[index][:, :, :seen].reshape(batch, -1, d)]
            scores = [torch.bmm(q, key.transpose(1, 2)) for key in keys]  # 3-D bmm: no copy of the cache
            if cache.padded:
                scores[0] = scores[0] + cache.bias
            if bias is not None:
                scores[1] = scores[1] + bias
            if prefix.shared:  # one product for every row's queries against the single copy of the prefix
                pk, pv = prefix.prefix[index]
                flat = q.view(rows, kvh, g * width, d).transpose(0, 1).reshape(kvh, rows * g * width, d)
                shared = torch.matmul(flat, pk.transpose(1, 2)).view(kvh, rows, g * width, -1).transpose(0, 1)
                scores.insert(0, shared.reshape(batch, g * width, -1))
                values.insert(0, pv)
            p = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
            parts = p.split([s.shape[-1] for s in scores], dim=-1)
            o = torch.bmm(parts[-2], values[-2]) + torch.bmm(parts[-1], values[-1])
            if prefix.shared:
                shared = parts[0].view(rows, kvh, g * width, -1).transpose(0, 1).reshape(kvh, rows * g * width, -1)
                o = o + torch.matmul(shared, values[0]).view(kvh, rows, g * width, d).transpose(0, 1).reshape(o.shape)
            x = self._finish(layer, w, x, o.view(rows, self.heads, width, d))
        return x

    def _qkv(
        self, layer: Any, w: dict[str, Projection], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[Any, Any, Any]:
        """Queries, keys and values of a layer's input, rotated: [rows, heads, tokens, head_dim]."""
        rows, length, _ = x.shape
        qkv = w["qkv"](_rms_norm(layer.input_layernorm, x)).view(rows, length, -1, self.head_dim)
        rotated = self.heads + self.kv_heads  # queries and keys, rotated together
        qk, v = _rope(qkv[:, :, :rotated], cos.unsqueeze(2), sin.unsqueeze(2)), qkv[:, :, rotated:]
        q, k = qk.transpose(1, 2).split([self.heads, self.kv_heads], dim=1)
        return q, k, v.transpose(1, 2)

    def _finish(self, layer: Any, w: dict[str, Projection], x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer: output projection and residual, then the MLP and residual."""
        rows, length, _ = x.shape
        x = x + w["o"](attended.transpose(1, 2).reshape(rows, length, -1))
        gate, up = w["gate_up"](_rms_norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
        return x + w["down"](layer.mlp.act_fn(gate) * up)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A Llama RMSNorm module's output in one fused call (as the module computes it, up to float rounding)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of [rows, tokens, heads, head_dim] (Llama's rotate-half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
