"""KV-cached batched decoding for Llama-shaped models, built from the model's own modules (so LoRA layers apply).

Why not ``model.generate``: a batch of rollout prompts shares a long prefix (system prompt, tool list), and
generate attends to a copy of that prefix per row, appends to its cache with a copy every step, and keeps every
row in the batch until the slowest one ends. Here the shared prefix's keys and values are computed once (and kept
across calls, per adapter), and attention reads three segments: the prefix (one matrix product for all rows), each
row's own prompt (computed once at prefill, stored contiguously), and the tokens generated so far (one column per
step in a buffer allocated once). A row leaves the batch as soon as it ends, and a new row may join between steps
(``arrivals``: continuous batching, as a server needs). An episode's next call starts from
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


@dataclass(frozen=True)
class Sampling:
    """How a batch picks its tokens: greedy at temperature 0, else a draw at the temperature from what top-k,
    top-p and min-p keep; the repetition penalty applies in both (1, 0, 1.0 and 0.0: off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def guesses(self) -> bool:
        """Whether prompt-lookup guessing holds: greedy picks from the raw logits alone."""
        return self.temperature <= 0 and self.repetition_penalty == 1


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
        batch = _Batch(self, adapter, kv_adapter, cache_key, sampling or Sampling(), seed, top)
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


@dataclass
class Joiner:
    """A row for a batch: its prompt's tokens, its own limit, and what hears it (see ``Decoder.generate``)."""

    tokens: list[int]
    max_new: int
    listener: Listener | None = None
    guide: Any = None
    scores: list[Scored] | None = None  # filled as it decodes, when the batch computes scores
    done: Callable[[list[int]], None] | None = None  # called with its new tokens when it ends (a row that joined)


class _Batch:
    """Rows decoding together under one adapter and one set of sampling settings. Rows are added before any step
    (the call's own) and between steps (continuous batching): a step feeds every live row its last token, rows
    that end leave, and rows that join are prefilled against the batch's shared prefix, shortened first to what
    they share with it (the rows already live take the cut tokens' keys and values into their own)."""

    def __init__(
        self,
        decoder: Decoder,
        adapter: str | None,
        kv_adapter: Any,
        cache_key: str | None,
        sampling: Sampling,
        seed: int,
        top: int,
    ) -> None:
        self.decoder, self.adapter, self.cache_key, self.top = decoder, adapter, cache_key, top
        self.borrowed, self.kv_adapter = kv_adapter is not OWN, adapter if kv_adapter is OWN else kv_adapter
        self.weights = decoder._layers(adapter)
        self.sampling = sampling
        self.seen: torch.Tensor | None = None  # [live slots, vocabulary]: tokens in each row (repetition penalty)
        self.generator = torch.Generator().manual_seed(seed)
        self.joiners: list[Joiner] = []  # per row, in the order rows came
        self.out: list[list[int]] = []
        self.active: list[int] = []  # row of each live slot
        self.lengths = torch.zeros(0, dtype=torch.long)  # each live slot's prompt length
        self.fed = torch.zeros(0, dtype=torch.long)  # generated tokens whose keys and values are in the cache
        self.new: list[list[int]] = []  # each live slot's tokens picked by the last step, not yet appended
        self.raw: torch.Tensor | None = None  # each live slot's log-probabilities (when scores are computed)
        self.cache: _Rows | None = None
        self.prefix: Sequence | None = None
        self.guides: list[Any] | None = None
        self.drafts: _Guesses | None = None
        self.scoring = self.guessing = False

    def add(self, joiners: list[Joiner]) -> None:
        """Prefill rows and make them live: their first tokens are appended by the next step."""
        d, started = self.decoder, time.perf_counter()
        rows = [j.tokens for j in joiners]
        guided, scored = any(j.guide is not None for j in joiners), any(j.scores is not None for j in joiners)
        if self.prefix is None:  # the call's own rows: they set what the batch computes
            self.scoring = scored
            self.guessing = self.sampling.guesses and not guided and not scored
            shared = min(common_prefix(rows), min(len(r) for r in rows) - 1)  # every row keeps a token to feed
            if self.borrowed and len(rows) == 1:
                shared = 0  # a lone row is not a prefix to compute anew: the stored keys and values cover it
            self.prefix = d._prefix(self.kv_adapter, d._layers(self.kv_adapter), rows[0][:shared])
        elif (guided or scored) and self.guessing or scored and not self.scoring or self.borrowed:
            raise ValueError("a row joins only a batch that decodes it alike (guessing, scores, borrowed keys)")
        else:
            known = self.prefix.tokens.tolist()
            self._shorten(min(common_prefix([known, *rows]), min(len(r) for r in rows) - 1))
        shared = self.prefix.shared
        if self.cache is None:
            d.stats.calls += 1
        d.stats.rows += len(rows)
        starts = [d._stored(self.kv_adapter, self.cache_key, r, shared) for r in rows]
        fresh = [len(r) - shared - n for r, (_, n) in zip(rows, starts, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: fresh[i])  # slot s holds row order[s]: chunks are slices
        own = [rows[i][shared:] for i in order]
        cache = _Rows.allocate(d, [len(x) for x in own], max(j.max_new for j in joiners))
        for slot, i in enumerate(order):
            cache.load(slot, *starts[i], shared)
        logits = d._prefill(self.weights, own, [fresh[i] for i in order], shared, self.prefix, cache)
        first = len(self.joiners)
        self.joiners += joiners
        self.out += [[] for _ in joiners]
        if guided and self.guides is None:
            self.guides = [None] * first
        if self.guides is not None:
            self.guides += [j.guide for j in joiners]
        joined = [first + i for i in order]
        if self.guessing:
            if self.drafts is None:
                self.drafts = _Guesses()
            self.drafts.add([rows[i] for i in order])
        self.cache = cache if self.cache is None else self.cache.extend(cache)
        self.active += joined
        self.lengths = torch.cat([self.lengths, torch.tensor([len(rows[i]) for i in order])])
        self.fed = torch.cat([self.fed, torch.zeros(len(rows), dtype=torch.long)])
        raw = _log_softmax(logits, self.scoring)
        self.raw = raw if self.raw is None or raw is None else torch.cat([self.raw, raw])
        if self.sampling.repetition_penalty != 1:
            seen = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
            for slot, i in enumerate(order):
                seen[slot, rows[i]] = True
            self.seen = seen if self.seen is None else torch.cat([self.seen, seen])
        picks = self._pick(logits, joined, self.seen[-len(rows) :] if self.seen is not None else None)
        self.new += [[t] for t in picks.tolist()]
        d.stats.prefill_s += time.perf_counter() - started

    def step(self) -> bool:
        """Append the tokens the last step picked, let ended rows leave, and decode the live rows' next tokens;
        whether any row is live."""
        d, started = self.decoder, time.perf_counter()
        keep = []
        pending = _scored(self.raw, self.new, self.top) if self.scoring else None
        for slot, (i, tokens) in enumerate(zip(self.active, self.new, strict=True)):
            row, out = self.joiners[i], self.out[i]
            if self.guides is not None and self.guides[i] is not None:
                self.guides[i].take(tokens)
            before = len(out)
            goes_on = d._append(out, tokens, row.max_new)
            if pending is not None and row.scores is not None and len(out) > before:
                row.scores.append(pending[slot])
            if row.listener is not None and len(out) > before:
                goes_on = row.listener(out[before:]) and goes_on
            if goes_on:
                keep.append(slot)
                continue
            if self.cache_key is not None and self.kv_adapter == self.adapter:  # keep its prompt and fed tokens
                n = min(int(self.fed[slot]), len(out))
                d.store.add(
                    self.cache.sequence(slot, self.adapter, self.cache_key, row.tokens + out[:n], self.prefix, n)
                )
            if row.done is not None:
                row.done(out)
        if len(keep) < len(self.active):  # ended rows leave: every later step computes live rows only
            if not keep:
                d.stats.decode_s += time.perf_counter() - started
                return False
            moved = self.cache.keep(keep)
            self.active, self.lengths, self.fed = [self.active[s] for s in moved], self.lengths[moved], self.fed[moved]
            if self.seen is not None:
                self.seen = self.seen[moved]
            if self.drafts is not None:
                self.drafts.keep(moved)
        self._decode()
        d.stats.decode_s += time.perf_counter() - started
        return True

    def _decode(self) -> None:
        """One forward pass over each live row's last token and its guesses: the tokens each row takes next."""
        d, outs = self.decoder, [self.out[i] for i in self.active]
        limits = [self.joiners[i].max_new for i in self.active]
        guesses = self.drafts.guess(outs, limits) if self.drafts is not None else [[]] * len(outs)
        width = 1 + max(len(g) for g in guesses)
        ids = torch.tensor([[out[-1], *g] + [0] * (width - 1 - len(g)) for out, g in zip(outs, guesses, strict=True)])
        hidden = d._decode(self.weights, ids, self.lengths + self.fed, self.prefix, self.cache, self.fed)
        d.stats.decode_steps += 1
        if width == 1:
            logits = d._logits(hidden[:, 0])
            self.raw = _log_softmax(logits, self.scoring)
            if self.seen is not None:  # the tokens fed this step are in their rows now
                self.seen[torch.arange(len(outs)), ids[:, 0]] = True
            self.new = [[t] for t in self._pick(logits, self.active, self.seen).tolist()]
            self.fed += 1
            return
        best = d._logits(hidden).argmax(dim=-1).tolist()  # greedy: a guess stands while it is the argmax
        self.new = []
        for slot, (guess, picks) in enumerate(zip(guesses, best, strict=True)):
            taken = next((j for j, t in enumerate(guess) if t != picks[j]), len(guess))
            self.new.append(guess[:taken] + [picks[taken]])
            self.fed[slot] += 1 + taken
            self.drafts.judge(slot, len(guess), taken)
        d.stats.guessed_tokens += sum(len(t) - 1 for t in self.new)

    def _pick(self, logits: torch.Tensor, rows: list[int], seen: torch.Tensor | None) -> torch.Tensor:
        """Each slot's next token: the repetition penalty on the tokens its row holds, its grammar, then the pick."""
        if seen is not None:
            p = self.sampling.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        return _pick(_masked(logits, rows, self.guides), self.sampling, self.generator)

    def _shorten(self, shared: int) -> None:
        """Cut the shared prefix to its first ``shared`` tokens; the live rows keep the rest as their own."""
        if shared >= self.prefix.shared:
            return
        self.cache.widen([(k[:, shared:], v[:, shared:]) for k, v in self.prefix.prefix])
        layers = [(k[:, :shared], v[:, :shared]) for k, v in self.prefix.prefix] if shared else []
        self.prefix = Sequence(self.kv_adapter, "", self.prefix.tokens[:shared], layers)


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

    def widen(self, before: KV) -> None:
        """Put the same tokens' keys and values (per layer [kv_heads, tokens, head_dim]) before every row's own."""
        extra = before[0][0].shape[1] if before else 0
        if not extra:
            return
        for held, layer in ((self.k, 0), (self.v, 1)):
            for index, t in enumerate(held):
                wide = torch.zeros(t.shape[0], t.shape[1], self.width + extra, t.shape[3], dtype=t.dtype)
                wide[:, :, extra:] = t
                for slot, length in enumerate(self.lengths):
                    end = self.width - length + extra  # where the row's own tokens begin
                    wide[slot, :, end - extra : end] = before[index][layer]
                held[index] = wide
        self.width += extra
        self._lengths([n + extra for n in self.lengths])

    def extend(self, other: _Rows) -> _Rows:
        """These rows and another's after them, in one set of buffers (the narrower padded)."""
        width, columns = max(self.width, other.width), max(self.gen_k[0].shape[2], other.gen_k[0].shape[2])

        def both(mine: list, theirs: list, gen: bool) -> list:
            def fit(t: torch.Tensor) -> torch.Tensor:  # own prompts pad on the left, generated tokens on the right
                room = (columns if gen else width) - t.shape[2]
                return F.pad(t, (0, 0, 0, room) if gen else (0, 0, room, 0))

            return [torch.cat([fit(a), fit(b)]) for a, b in zip(mine, theirs, strict=True)]

        return _Rows(
            both(self.k, other.k, False),
            both(self.v, other.v, False),
            both(self.gen_k, other.gen_k, True),
            both(self.gen_v, other.gen_v, True),
            self.lengths + other.lengths,
            self.kv_heads,
        )

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

    def __init__(self) -> None:
        self.context: list[list[int]] = []
        self.prompt: list[int] = []
        self.size: list[int] = []  # each row's guess length, grown and shrunk by its record
        self.index: list[dict[int, dict[tuple, int]]] = []

    def add(self, prompts: list[list[int]]) -> None:
        """Rows that join, after the others."""
        for p in prompts:
            context, index = list(p), {n: {} for n in NGRAMS}
            for at in range(1, len(context)):
                self._note(context, index, at)
            self.context.append(context)
            self.prompt.append(len(p))
            self.size.append(GUESS_TOKENS // 2)
            self.index.append(index)

    def guess(self, outs: list[list[int]], limits: list[int]) -> list[list[int]]:
        """Each row's guess of its next tokens (empty where it has none), bounded by the step's budget and the
        row's ``max_new``."""
        budget = GUESS_BUDGET // len(outs) - 1  # below 2 tokens a guess costs more than it saves (measured)
        guesses = []
        for context, index, prompt, out, size, limit in zip(
            self.context, self.index, self.prompt, outs, self.size, limits, strict=True
        ):
            while len(context) < prompt + len(out):  # the reply's new tokens join the searchable context
                context.append(out[len(context) - prompt])
                self._note(context, index, len(context) - 1)
            room = min(size, budget, limit - len(out) - 1)  # a step adds its confirmed guesses and one more
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


def _log_softmax(logits: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    """Log-probabilities of raw logits, when scores are asked for (before a grammar masks the logits in place)."""
    return torch.log_softmax(logits, dim=-1) if wanted else None


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


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row: argmax, or a draw at the temperature from the tokens top-k, top-p and min-p
    keep (in vLLM's order)."""
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > sampling.top_p  # keep the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if sampling.min_p > 0:
        probs = probs.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def common_prefix(rows: list[list[int]]) -> int:
    """Length of the token prefix every row shares."""
    first, n = rows[0], min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != first[i] for r in rows):
            return i
    return n
