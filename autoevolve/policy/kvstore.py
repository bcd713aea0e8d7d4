"""Keys and values of token sequences the decoder has already computed, kept for the next call to start from.

An episode's next request is its last request plus the reply, the tool result and a new generation prompt, so its
first few hundred tokens were computed one call earlier. Each finished row is kept here as a sequence: its tokens
(prompt and the generated ones that went through the model) and their keys and values, split at the batch's shared
prefix, which several sequences hold by reference. A new prompt starts from the stored sequence that shares the
longest token prefix with it, among those of the same adapter (keys and values depend on its weights) and the same
cache key. The store holds one cache key at a time: a request with another key empties it. So what a call reuses
depends only on the earlier calls with its key (one rollout batch), never on what else the process ran: a batch
rerun after a crash computes what the first run computed. Least recently used sequences leave first once the
store holds more than its byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [kv_heads, tokens, head_dim]


@dataclass(eq=False)
class Sequence:
    """Tokens whose keys and values are known: ``prefix`` holds the first ``shared`` of them, ``own`` the rest."""

    adapter: str | None
    key: str
    tokens: np.ndarray
    prefix: KV
    own: KV = field(default_factory=list)

    @property
    def shared(self) -> int:
        """Tokens held in ``prefix``."""
        return self.prefix[0][0].shape[1] if self.prefix else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values this sequence holds alone (a shared prefix counts where it was stored)."""
        layers = self.own or self.prefix
        return sum(k.nbytes + v.nbytes for k, v in layers)

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [start, end) at one layer."""
        p = self.shared
        if end <= p:
            k, v = self.prefix[layer]
            return k[:, start:end], v[:, start:end]
        k, v = self.own[layer]
        if start >= p:
            return k[:, start - p : end - p], v[:, start - p : end - p]
        pk, pv = self.prefix[layer]
        return torch.cat([pk[:, start:], k[:, : end - p]], dim=1), torch.cat([pv[:, start:], v[:, : end - p]], dim=1)


class KVStore:
    """Sequences of one cache key, least recently used first out beyond ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self.entries: OrderedDict[int, Sequence] = OrderedDict()

    def add(self, seq: Sequence) -> None:
        """Keep a sequence (another key's are dropped; the oldest leave while over budget)."""
        if any(s.key != seq.key for s in self.entries.values()):
            self.forget()
        self.entries[id(seq)] = seq
        self.used += seq.nbytes
        while self.used > self.budget and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.used -= old.nbytes

    def longest(self, adapter: str | None, key: str, tokens: list[int]) -> tuple[Sequence | None, int]:
        """The sequence sharing the longest token prefix with ``tokens`` (and its length), marked as just used."""
        probe = np.asarray(tokens)
        best, best_n = None, 0
        for seq in self.entries.values():
            if seq.adapter != adapter or seq.key != key:
                continue
            n = min(len(seq.tokens), len(probe))
            differ = np.flatnonzero(seq.tokens[:n] != probe[:n])
            same = int(differ[0]) if len(differ) else n
            if same > best_n:
                best, best_n = seq, same
        if best is not None:
            self.entries.move_to_end(id(best))
        return best, best_n

    def forget(self, adapter: str | None = None) -> None:
        """Drop the sequences of one adapter (all when None): its weights changed."""
        for key in [k for k, s in self.entries.items() if adapter is None or s.adapter == adapter]:
            self.used -= self.entries.pop(key).nbytes
