"""KV-cached batched decoding for Llama-shaped models, built from the model's own modules (so LoRA layers apply).

Why not ``model.generate``: a batch of rollout prompts shares a long prefix (system prompt, tool list), and
generate attends to a copy of that prefix per row, appends to its cache with a copy every step, and keeps every
row in the batch until the slowest one ends. Here the shared prefix's keys and values are computed once (and kept
across calls, per adapter), and attention reads three segments: the prefix (one matrix product for all rows), each
row's own prompt (computed once at prefill, stored contiguously), and the tokens generated so far (one column per
step in a buffer allocated once). A row leaves the batch as soon as it ends. An episode's next call starts from
the keys and values its rows left in the store (``autoevolve.policy.kvstore``), so only the reply, the tool result
and the new generation prompt are computed again.

Greedy decoding gives the tokens ``generate`` gives, up to float rounding (the tests compare them). Sampling applies
temperature and top-p and draws from a generator seeded per call.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from autoevolve.policy.kvstore import KV, KVStore, Sequence
from autoevolve.policy.weights import Projection, Unsupported, adapter_projections, base_projections, pack

SUPPORTED = ("llama", "mistral", "qwen2")  # decoder layers of exactly this shape; others use model.generate
PREFILL_TOKENS = 2048  # tokens per prefill chunk: bounds the attention's memory
GUESS_TOKENS = 4  # most tokens a row guesses ahead per step (greedy decoding only)
GUESS_BUDGET = 40  # tokens a step may compute across its rows: guessing pays only where rows are few (<= 13)
NGRAMS = (3, 2)  # a guess copies what followed the last occurrence of the row's last 3 (else 2) tokens
PREFIXES_KEPT = 8  # shared prefixes kept: one per config and adapter in use is plenty
ADAPTERS_KEPT = 4  # adapters whose stacked LoRA factors are kept

OWN = object()  # Decoder.generate's kv_adapter default: the keys and values of the adapter that generates
Listener = Callable[[list[int]], bool]  # a row's new tokens as generated; False ends the row
Scored = tuple[int, float, list[tuple[int, float]]]  # a generated token, its log-probability, the top alternatives
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
    guessed_tokens: int = 0  # of those, prompt-lookup guesses the model confirmed (see _Guesses)
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Decoder:
    """Batched decoding over a (possibly LoRA-wrapped) Llama-shaped model; see the module docstring."""

    def __init__(self, model: Any, stop_ids: set[int], store_bytes: int = STORE_BYTES) -> None:
        inner = model.model  # PEFT wraps the linear layers in place, so every call sees the active adapter
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.head = model.lm_head
        self.logits = pack(self.head.weight.detach(), None if self.head.bias is None else self.head.bias.detach())
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.groups = self.heads // self.kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.scale = self.layers[0].self_attn.scaling
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.stop_ids = stop_ids
        self.store = KVStore(store_bytes)
        self.prefixes: OrderedDict[tuple, Sequence] = OrderedDict()  # computed from scratch: the same in any process
        self.base: Layers = [base_projections(layer) for layer in self.layers]
        self.adapters: OrderedDict[str, Layers] = OrderedDict()
        self.stats = Stats()

    def forget(self, adapter: str | None = None) -> None:
        """Drop what depends on an adapter's weights (or on every adapter's): keys, values and LoRA factors."""
        self.store.forget(adapter)
        for key in [k for k in self.prefixes if adapter is None or k[0] == adapter]:
            del self.prefixes[key]
        for name in [n for n in self.adapters if adapter is None or n == adapter]:
            del self.adapters[name]

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
        if adapter not in self.adapters:
            self.adapters[adapter] = [
                adapter_projections(layer, base, adapter) for layer, base in zip(self.layers, self.base, strict=True)
            ]
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
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        cache_key: str | None = None,
        guides: list[Any] | None = None,
        kv_adapter: Any = OWN,
        listeners: list[Listener | None] | None = None,
        scores: list[list[Scored]] | None = None,
        top: int = 0,
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
        """
        self.stats.calls += 1
        self.stats.rows += len(rows)
        started = time.perf_counter()
        weights = self._layers(adapter)
        borrowed, kv_adapter = kv_adapter is not OWN, adapter if kv_adapter is OWN else kv_adapter
        shared = min(common_prefix(rows), min(len(r) for r in rows) - 1)  # every row keeps a token to feed
        if borrowed and len(rows) == 1:
            shared = 0  # a lone row is not a prefix to compute anew: the stored keys and values cover what they can
        prefix = self._prefix(kv_adapter, self._layers(kv_adapter), rows[0][:shared])
        starts = [self._stored(kv_adapter, cache_key, r, shared) for r in rows]
        fresh = [len(r) - shared - n for r, (_, n) in zip(rows, starts, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: fresh[i])  # slot s holds row order[s]: chunks are slices
        own = [rows[i][shared:] for i in order]
        cache = _Rows.allocate(self, [len(x) for x in own], max_new)
        for slot, i in enumerate(order):
            cache.load(slot, *starts[i], shared)
        logits = self._prefill(weights, own, [fresh[i] for i in order], shared, prefix, cache)
        self.stats.prefill_s += time.perf_counter() - started

        started = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        guides = guides if guides and any(guides) else None
        guessing = temperature <= 0 and guides is None and scores is None
        drafts = _Guesses([rows[i] for i in order]) if guessing else None
        out: list[list[int]] = [[] for _ in rows]
        active = order  # row of each live slot
        lengths = torch.tensor([len(rows[i]) for i in order])
        fed = torch.zeros(len(order), dtype=torch.long)  # generated tokens whose keys and values are in the cache
        raw = _log_softmax(logits, scores)
        new = [[t] for t in _pick(_masked(logits, order, guides), temperature, top_p, generator).tolist()]
        while True:
            keep = []
            pending = _scored(raw, new, top) if scores is not None else None
            for slot, (i, tokens) in enumerate(zip(active, new, strict=True)):
                if guides is not None and guides[i] is not None:
                    guides[i].take(tokens)
                before = len(out[i])
                goes_on = self._append(out[i], tokens, max_new)
                if pending is not None and len(out[i]) > before:
                    scores[i].append(pending[slot])
                if listeners is not None and listeners[i] is not None and len(out[i]) > before:
                    goes_on = listeners[i](out[i][before:]) and goes_on
                if goes_on:
                    keep.append(slot)
                elif cache_key is not None and kv_adapter == adapter:  # the row ends: keep its prompt and fed tokens
                    n = min(int(fed[slot]), len(out[i]))
                    self.store.add(cache.sequence(slot, adapter, cache_key, rows[i] + out[i][:n], prefix, n))
            if not keep:
                break
            if len(keep) < len(active):  # ended rows leave: every later step computes live rows only
                moved = cache.keep(keep)
                active, lengths, fed = [active[s] for s in moved], lengths[moved], fed[moved]
                if drafts is not None:
                    drafts.keep(moved)
            guesses = drafts.guess([out[i] for i in active], max_new) if drafts is not None else [[]] * len(active)
            width = 1 + max(len(d) for d in guesses)
            ids = torch.tensor(
                [[out[i][-1], *d] + [0] * (width - 1 - len(d)) for i, d in zip(active, guesses, strict=True)]
            )
            hidden = self._decode(weights, ids, lengths + fed, prefix, cache, fed)
            self.stats.decode_steps += 1
            if width == 1:
                logits = self._logits(hidden[:, 0])
                raw = _log_softmax(logits, scores)
                new = [[t] for t in _pick(_masked(logits, active, guides), temperature, top_p, generator).tolist()]
                fed += 1
                continue
            best = self._logits(hidden).argmax(dim=-1).tolist()  # greedy: a guess stands while it is the argmax
            new = []
            for slot, (guess, picks) in enumerate(zip(guesses, best, strict=True)):
                taken = next((j for j, t in enumerate(guess) if t != picks[j]), len(guess))
                new.append(guess[:taken] + [picks[taken]])
                fed[slot] += 1 + taken
                drafts.judge(slot, len(guess), taken)
            self.stats.guessed_tokens += sum(len(t) - 1 for t in new)
        self.stats.decode_s += time.perf_counter() - started
        return out

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
        return self.logits(self.norm(hidden)).float()

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
        self, weights: Layers, own: list[list[int]], fresh: list[int], shared: int, prefix: Sequence, cache: _Rows
    ) -> torch.Tensor:
        """Compute each slot's fresh prompt tokens in chunks of similar count; returns each slot's next-token logits.

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
            hidden = self._chunk(weights, ids, positions, prefix, cache, start)
            last[start:end] = self._logits(hidden[:, -1])
            self.stats.prefill_tokens += sum(len(x) for x in chunk)
            start = end
        return last

    def _chunk(
        self, weights: Layers, ids: torch.Tensor, positions: torch.Tensor, prefix: Sequence, cache: _Rows, first: int
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
        self, weights: Layers, ids: torch.Tensor, start: torch.Tensor, prefix: Sequence, cache: _Rows, fed: torch.Tensor
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
            scores[0] = scores[0] + cache.bias
            scores[1] = scores[1] + bias
            if prefix.shared:  # one product for every row's queries against the single copy of the prefix
                pk, pv = prefix.prefix[index]
                flat = q.view(rows, kvh, g * width, d).transpose(0, 1).reshape(kvh, rows * g * width, d)
                shared = torch.matmul(flat, pk.transpose(1, 2)).view(kvh, rows, g * width, -1).transpose(0, 1)
                scores.insert(0, shared.reshape(batch, g * width, -1))
                values.insert(0, pv)
            p = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
            parts = p.split([s.shape[-1] for s in scores], dim=-1)
            o = sum(torch.bmm(part, value) for part, value in zip(parts[-2:], values[-2:], strict=True))
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
        q, k, v = w["qkv"](layer.input_layernorm(x)).split(self.split, dim=-1)
        q = q.view(rows, length, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(rows, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(rows, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        return q, k, v

    def _finish(self, layer: Any, w: dict[str, Projection], x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer: output projection and residual, then the MLP and residual."""
        rows, length, _ = x.shape
        x = x + w["o"](attended.transpose(1, 2).reshape(rows, length, -1))
        gate, up = w["gate_up"](layer.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + w["down"](layer.mlp.act_fn(gate) * up)


class _Rows:
    """Each live row's keys and values: its own prompt [rows, kv_heads, width, head_dim] (right-aligned, contiguous)
    and its generated tokens [rows, kv_heads, max_new, head_dim], per layer."""

    def __init__(self, k: list, v: list, gen_k: list, gen_v: list, lengths: list[int], kv_heads: int) -> None:
        self.k, self.v, self.gen_k, self.gen_v, self.kv_heads = k, v, gen_k, gen_v, kv_heads
        self.width, self.dtype = k[0].shape[2], k[0].dtype
        self._lengths(lengths)

    @classmethod
    def allocate(cls, decoder: Decoder, lengths: list[int], max_new: int) -> _Rows:
        """Buffers for rows whose own prompts have these lengths."""
        n, width, dtype = len(lengths), max(lengths), decoder.head.weight.dtype
        columns = max_new + GUESS_TOKENS  # a step may write guesses past max_new (they are then discarded)
        shape, gen = (n, decoder.kv_heads, width, decoder.head_dim), (n, decoder.kv_heads, columns, decoder.head_dim)
        layers = range(len(decoder.layers))
        # Zeros, not empty: a padding column gets probability 0, and 0 * garbage may be NaN.
        return cls(
            [torch.zeros(shape, dtype=dtype) for _ in layers],
            [torch.zeros(shape, dtype=dtype) for _ in layers],
            [torch.zeros(gen, dtype=dtype) for _ in layers],
            [torch.zeros(gen, dtype=dtype) for _ in layers],
            lengths,
            decoder.kv_heads,
        )

    def load(self, slot: int, seq: Sequence | None, n: int, shared: int) -> None:
        """Copy the keys and values of a row's first ``n`` own tokens from a stored sequence."""
        if seq is None:
            return
        start = self.width - self.lengths[slot]
        for index in range(len(self.k)):
            k, v = seq.kv(index, shared, shared + n)
            self.k[index][slot, :, start : start + n] = k
            self.v[index][slot, :, start : start + n] = v

    def sequence(
        self, slot: int, adapter: str | None, key: str, tokens: list[int], prefix: Sequence, fed: int
    ) -> Sequence:
        """A row as a stored sequence: the prefix by reference, its own prompt and its first ``fed`` new tokens."""
        start = self.width - self.lengths[slot]
        own = [
            (torch.cat([k[slot, :, start:], gk[slot, :, :fed]], dim=1),
             torch.cat([v[slot, :, start:], gv[slot, :, :fed]], dim=1))
            for k, v, gk, gv in zip(self.k, self.v, self.gen_k, self.gen_v, strict=True)
        ]  # fmt: skip
        return Sequence(adapter, key, np.asarray(tokens), prefix.prefix, own)

    def keep(self, slots: list[int]) -> list[int]:
        """Keep only these rows (ascending); returns the old slot of each row kept, in its new order.

        Live rows past the new end move into the holes ended rows left, and the buffers are cut to the live rows
        as views: only the moved rows are copied, not every row's keys and values.
        """
        live = len(slots)
        holes = sorted(set(range(live)) - set(slots))
        movers = [s for s in slots if s >= live]
        moved = list(range(live))
        for hole, mover in zip(holes, movers, strict=True):
            moved[hole] = mover
        if holes:
            src, dst = torch.tensor(movers), torch.tensor(holes)
            for t in (*self.k, *self.v, *self.gen_k, *self.gen_v):
                t[dst] = t[src]
        self.k, self.v = [t[:live] for t in self.k], [t[:live] for t in self.v]
        self.gen_k, self.gen_v = [t[:live] for t in self.gen_k], [t[:live] for t in self.gen_v]
        self._lengths([self.lengths[s] for s in moved])
        return moved

    def _lengths(self, lengths: list[int]) -> None:
        """Set the rows' own lengths, their valid columns and the decode scores' bias (-inf on padding)."""
        self.lengths = lengths
        self.valid = torch.arange(self.width).unsqueeze(0) >= self.width - torch.tensor(lengths).unsqueeze(1)
        bias = torch.zeros(self.valid.shape, dtype=self.dtype).masked_fill(~self.valid, float("-inf"))
        self.bias = bias.repeat_interleave(self.kv_heads, dim=0).unsqueeze(1)  # [rows * kv_heads, 1, width]


class _Guesses:
    """Prompt-lookup decoding: each row guesses its next tokens by copying what followed the latest earlier
    occurrence of its last few tokens in its prompt or reply. Tool calls copy names, argument keys and values from
    the prompt, so many guesses hold. A step checks the guesses with the model (one forward pass over each row's last
    token and its guesses) and keeps those that equal the model's own greedy choice, plus the model's next token:
    the output is what one-token-at-a-time greedy decoding gives, in fewer steps."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.context = [list(p) for p in prompts]
        self.prompt = [len(p) for p in prompts]
        self.size = [GUESS_TOKENS // 2] * len(prompts)  # each row's guess length, grown and shrunk by its record
        self.index: list[dict[int, dict[tuple, int]]] = [{n: {} for n in NGRAMS} for _ in prompts]
        for context, index in zip(self.context, self.index, strict=True):
            for at in range(1, len(context)):
                self._note(context, index, at)

    def guess(self, outs: list[list[int]], max_new: int) -> list[list[int]]:
        """Each row's guess of its next tokens (empty where it has none), bounded by the step's budget."""
        budget = GUESS_BUDGET // len(outs) - 1  # below 2 tokens a guess costs more than it saves (measured)
        guesses = []
        for context, index, prompt, out, size in zip(
            self.context, self.index, self.prompt, outs, self.size, strict=True
        ):
            while len(context) < prompt + len(out):  # the reply's new tokens join the searchable context
                context.append(out[len(context) - prompt])
                self._note(context, index, len(context) - 1)
            room = min(size, budget, max_new - len(out) - 1)  # a step adds its confirmed guesses and one more
            found = next((index[n][k] for n in NGRAMS if (k := tuple(context[-n:])) in index[n]), None)
            guesses.append(context[found : found + room] if found is not None and budget >= 2 and room > 0 else [])
        return guesses

    def judge(self, slot: int, guessed: int, taken: int) -> None:
        """Grow a row's guesses while they hold, shrink them when they fail (a wrong guess costs compute)."""
        if guessed and taken == guessed:
            self.size[slot] = min(GUESS_TOKENS, self.size[slot] + 2)
        elif guessed and taken == 0:
            self.size[slot] = max(1, self.size[slot] // 2)

    def keep(self, slots: list[int]) -> None:
        """Keep only these rows."""
        self.context = [self.context[s] for s in slots]
        self.prompt = [self.prompt[s] for s in slots]
        self.index = [self.index[s] for s in slots]
        self.size = [self.size[s] for s in slots]

    @staticmethod
    def _note(context: list[int], index: dict[int, dict[tuple, int]], at: int) -> None:
        """Record that the n tokens before position ``at`` were followed by the token at ``at``."""
        for n in NGRAMS:
            if at >= n:
                index[n][tuple(context[at - n : at])] = at


def _log_softmax(logits: torch.Tensor, scores: list | None) -> torch.Tensor | None:
    """Log-probabilities of raw logits, when scores are asked for (before a grammar masks the logits in place)."""
    return torch.log_softmax(logits, dim=-1) if scores is not None else None


def _scored(raw: torch.Tensor, new: list[list[int]], top: int) -> list[Scored]:
    """Each live slot's picked token with its log-probability, and the ``top`` likeliest tokens with theirs."""
    best = raw.topk(top, dim=-1) if top else None
    out = []
    for slot, (token,) in enumerate(new):
        alternatives = list(zip(best.indices[slot].tolist(), best.values[slot].tolist(), strict=True)) if best else []
        out.append((token, float(raw[slot, token]), alternatives))
    return out


def _masked(logits: torch.Tensor, rows: list[int], guides: list[Any] | None) -> torch.Tensor:
    """Logits (one per live slot, slot s holding row ``rows[s]``) with each guided row's forbidden tokens at -inf."""
    if guides is not None:
        for slot, i in enumerate(rows):
            if guides[i] is not None:
                guides[i].mask(logits[slot])
    return logits


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row: argmax, or a draw at the temperature from the top-p nucleus."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def common_prefix(rows: list[list[int]]) -> int:
    """Length of the token prefix every row shares."""
    first, n = rows[0], min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows):
            return i
    return n
