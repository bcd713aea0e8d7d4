"""One stream's decode step, compiled: a lone row's next token on a CPU (a server's single client).

A step of one row and one token is bound by dispatching operations as much as by reading the weights: eager, each
of the decoder's few dozen operations per layer leaves Python on its own, and the products are about half of the step
(``bench/decode_step.py``). ``torch.compile`` (inductor) fuses the rest, but wants shapes it can name, while the
decoder's keys and values grow every step in three segments (prefix, own prompt, generated tokens). So a lone row's
keys and values are mirrored into one buffer per layer, [kv_heads, columns, head_dim], ``columns`` its context and
whole reply rounded up to ``COLUMNS`` and marked dynamic (one compile serves every length); columns not written yet
are masked. The compiled step writes the new token's keys and values into the buffer, attends over every column and
returns the logits with those keys and values, which the batch writes into its own rows too: the rows stay what
counts, so a row that joins drops the mirror and loses nothing, and a step that checks guesses eagerly hands the
mirror the tokens it kept (``Stream.follow``). The weights are inputs of the compiled step, not constants: adapters
whose LoRA factors have the same shapes share one compile.

Compiling takes seconds to minutes (SmolLM2-135M on 2 cores: about 80 s the first time on a machine, 10-15 s once
inductor's cache holds it), and while it runs every other decode slows by an order of magnitude: the compiler holds
Python's lock most of the time. So it runs only when asked (``Streams.warm``: a server warms the base and the
adapters it starts with before it listens); an adapter loaded later is adopted where its shapes were compiled
(``Streams.adopt``), and a row under an adapter neither warmed nor adopted decodes eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from autoevolve.policy.weights import Unsupported

if TYPE_CHECKING:
    from autoevolve.policy.batch import Rows
    from autoevolve.policy.decode import Decoder, Layers
    from autoevolve.policy.kvstore import KV

COLUMNS = 256  # a row's buffers hold its context and reply, rounded up to a multiple of this

Buffers = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]  # keys and values per layer, the mask


class Stream:
    """A lone row's keys and values in buffers of their own (see the module docstring): the next column to write, and
    the compiled step."""

    def __init__(self, step: Callable, weights: Layers, buffers: Buffers, written: int) -> None:
        self.step, self.weights, self.written = step, weights, written
        self.keys, self.values, self.bias = buffers

    def __call__(self, decoder: Decoder, token: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The next-token logits [1, vocabulary] after feeding ``token``, and its keys and values per layer."""
        at = torch.tensor([self.written])
        self.bias[self.written] = 0
        logits, new = self.step(decoder, self.weights, torch.tensor([[token]]), at, self.keys, self.values, self.bias)
        self.written += 1
        return logits, new

    def follow(self, rows: Rows, start: int, end: int) -> bool:
        """Take the keys and values of the lone row's generated tokens ``start``..``end`` from its rows (a step that
        checked guesses computed them eagerly); False where they do not fit (the stream is then dropped)."""
        at = slice(self.written, self.written + end - start)
        if at.stop > self.bias.shape[0]:
            return False
        for k, v, gk, gv in zip(self.keys, self.values, rows.gen_k, rows.gen_v, strict=True):
            k[:, at] = gk[0, :, start:end]
            v[:, at] = gv[0, :, start:end]
        self.bias[at] = 0
        self.written = at.stop
        return True


class Streams:
    """A decoder's compiled one-row step: compiled once per adapter by ``warm`` (the buffers' length is a dynamic
    dimension, so one compile serves every length), used for the adapters warmed or adopted."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        # Dynamo's guards check every input's size already: inductor's own checks cost ~1 ms a step over ~600 inputs.
        self.compiled = torch.compile(_step, fullgraph=True, options={"size_asserts": False})
        self.ready: set[str | None] = set()
        self.shapes: set[tuple] = set()  # the LoRA factors' shapes of the adapters warmed (the base's: none)

    @torch.inference_mode()
    def warm(self, adapter: str | None) -> float:
        """Compile the step for an adapter (None: the base) by running it once; the seconds it took. An adapter whose
        factors have the shapes of one compiled before takes seconds at most: the compiled step is shared."""
        started = time.perf_counter()
        weights = self.decoder._layers(adapter)
        keys, values, bias = self._buffers(COLUMNS)
        self.compiled(self.decoder, weights, torch.tensor([[0]]), torch.tensor([0]), keys, values, bias)
        self.shapes.add(_shapes(weights))
        self.ready.add(adapter)
        return time.perf_counter() - started

    def adopt(self, adapter: str) -> bool:
        """Use the compiled step for an adapter whose LoRA factors have the shapes of one warmed before (nothing is
        compiled: a server loading adapters at runtime must not stall); whether it does."""
        try:
            shapes = _shapes(self.decoder._layers(adapter))
        except Unsupported:
            return False
        if shapes in self.shapes:
            self.ready.add(adapter)
        return adapter in self.ready

    def open(self, adapter: str | None, context: KV, needed: int) -> Stream | None:
        """A stream for a row under a warmed adapter, holding its keys and values so far (``context``: per layer
        [kv_heads, tokens, head_dim]) with room for ``needed`` columns in all; None where the adapter is not warmed
        or ``needed`` is beyond the model's positions."""
        limit = getattr(self.decoder.rotary, "max_seq_len_cached", None) or needed
        if adapter not in self.ready or needed > limit:
            return None
        keys, values, bias = self._buffers(-(-needed // COLUMNS) * COLUMNS)
        written = context[0][0].shape[1]
        for k, v, (ck, cv) in zip(keys, values, context, strict=True):
            k[:, :written] = ck
            v[:, :written] = cv
        bias[:written] = 0
        return Stream(self.compiled, self.decoder._layers(adapter), (keys, values, bias), written)

    def forget(self, adapter: str | None) -> None:
        """Stop using the step for an adapter whose weights changed (None: every adapter's; the base's stays)."""
        self.ready = {a for a in self.ready if a is None or adapter is not None and a != adapter}

    def _buffers(self, columns: int) -> Buffers:
        """Zeroed keys and values per layer and a mask hiding every column, their length marked dynamic."""
        d = self.decoder
        shape = (d.kv_heads, columns, d.head_dim)
        dtype = d.head.weight.dtype
        keys = [torch.zeros(shape, dtype=dtype) for _ in d.layers]
        values = [torch.zeros(shape, dtype=dtype) for _ in d.layers]
        bias = torch.full((columns,), float("-inf"), dtype=dtype)
        for t in (*keys, *values):
            torch._dynamo.mark_dynamic(t, 1)
        torch._dynamo.mark_dynamic(bias, 0)
        return keys, values, bias


def _shapes(weights: Layers) -> tuple:
    """Per layer and group, the shapes and dtype of an adapter's factors (None for the base weights alone)."""
    return tuple(
        tuple(None if p.a is None else (p.a.shape, p.b.shape, p.a.dtype) for p in layer.values()) for layer in weights
    )


def _step(
    d: Decoder, weights: Layers, ids: torch.Tensor, at: torch.Tensor, keys: list, values: list, bias: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One token through every layer, attending over the buffers: its logits, and its keys and values per layer."""
    x = d.embed(ids)
    cos, sin = d.rotary(x, at.unsqueeze(0))
    new = []
    for layer, w, k_all, v_all in zip(d.layers, weights, keys, values, strict=True):
        q, k, v = d._qkv(layer, w, x, cos, sin)  # the decoder's own layer, around attention over the buffer
        k_all.index_copy_(1, at, k[0])
        v_all.index_copy_(1, at, v[0])
        q = (q[0] * d.scale).view(d.kv_heads, d.groups, d.head_dim)  # heads h*g..h*g+g-1 share kv head h
        p = torch.softmax((torch.bmm(q, k_all.transpose(1, 2)) + bias).float(), dim=-1).to(q.dtype)
        x = d._finish(layer, w, x, torch.bmm(p, v_all).view(1, d.heads, 1, d.head_dim))
        new.append((k[0], v[0]))
    return d._logits(x[:, 0]), new
