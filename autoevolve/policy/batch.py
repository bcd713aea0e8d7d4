"""A batch in flight: the rows that decode together, the keys and values they own, and how they pick tokens.

``Decoder.generate`` makes a ``Batch`` for its call's rows and steps it until every row has ended. A step feeds each
live row its last token (and, greedy, its guesses: ``Guesses``), appends what the model picked, and lets the rows
that ended leave (``Rows.keep`` moves only the live rows past the new end). Between steps new rows may join
(continuous batching): they are prefilled against the batch's shared prefix, cut first to what they share with it,
and their buffers appended to the others' (``Rows.widen``, ``Rows.extend``). The model's own computation (prefill,
decode, logits) stays in ``autoevolve.policy.decode``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from autoevolve.policy.kvstore import KV, Sequence
from autoevolve.policy.stream import Stream
from autoevolve.policy.weights import mixed, stack

if TYPE_CHECKING:
    from autoevolve.policy.decode import Decoder

GUESS_TOKENS = 4  # most tokens a row guesses ahead per step (greedy decoding only)
GUESS_BUDGET = 40  # tokens a step may compute across its rows: guessing pays only where rows are few (<= 13)
NGRAMS = (3, 2)  # a guess copies what followed the last occurrence of the row's last 3 (else 2) tokens

Listener = Callable[[list[int]], bool]  # a row's new tokens as generated; False ends the row
Scored = tuple[int, float, list[tuple[int, float]]]  # a generated token, its log-probability, the top alternatives
BATCH = object()  # a Joiner's adapter by default: the batch's own


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
class Joiner:
    """A row for a batch: its prompt's tokens, its own limit, and what hears it (see ``Decoder.generate``)."""

    tokens: list[int]
    max_new: int
    listener: Listener | None = None
    guide: Any = None
    scores: list[Scored] | None = None  # filled as it decodes, when the batch computes scores
    done: Callable[[list[int]], None] | None = None  # called with its new tokens when it ends (a row that joined)
    adapter: Any = BATCH  # the LoRA it decodes under (a name, None for the bare base), if not the batch's


class Batch:
    """Rows decoding together under one set of sampling settings. Rows are added before any step (the call's own)
    and between steps (continuous batching): a step feeds every live row its last token, rows that end leave, and
    rows that join are prefilled against the batch's shared prefix, shortened first to what they share with it (the
    rows already live take the cut tokens' keys and values into their own). The call's rows decode under its
    adapter; a row that joins may bring another (the prefix, computed under the call's adapter, is then cut to
    nothing), and a step or prefill over rows of several adapters adds each row's own LoRA (``weights.Mixed``)."""

    def __init__(
        self,
        decoder: Decoder,
        adapter: str | None,
        kv_adapter: str | None,
        borrowed: bool,
        cache_key: str | None,
        sampling: Sampling,
        seed: int,
        top: int,
    ) -> None:
        self.decoder, self.adapter, self.cache_key, self.top = decoder, adapter, cache_key, top
        self.kv_adapter, self.borrowed = kv_adapter, borrowed  # whose keys and values the prompts start from
        self.sampling = sampling
        self.adapters: list[str | None] = []  # per row: the adapter it decodes under
        self.mix: tuple[tuple, list] | None = None  # the live rows' adapters and the layers made for them
        self.stacked: tuple[list, list] | None = None  # the adapters among them, and their factors side by side
        self.seen: torch.Tensor | None = None  # [live slots, vocabulary]: tokens in each row (repetition penalty)
        self.generator = torch.Generator().manual_seed(seed)
        self.joiners: list[Joiner] = []  # per row, in the order rows came
        self.out: list[list[int]] = []
        self.active: list[int] = []  # row of each live slot
        self.lengths = torch.zeros(0, dtype=torch.long)  # each live slot's prompt length
        self.fed = torch.zeros(0, dtype=torch.long)  # generated tokens whose keys and values are in the cache
        self.new: list[list[int]] = []  # each live slot's tokens picked by the last step, not yet appended
        self.raw: torch.Tensor | None = None  # each live slot's log-probabilities (when scores are computed)
        self.cache: Rows | None = None
        self.prefix: Sequence | None = None
        self.guides: list[Any] | None = None
        self.drafts: Guesses | None = None
        self.stream: tuple[int, Stream] | None = None  # a lone live row and its compiled steps' buffers
        self.scoring = self.guessing = False

    def add(self, joiners: list[Joiner]) -> None:
        """Prefill rows and make them live: their first tokens are appended by the next step."""
        adapters = [self.adapter if j.adapter is BATCH else j.adapter for j in joiners]
        foreign = any(a != self.adapter for a in adapters)  # rows that cannot read the prefix: its keys differ
        d, started = self.decoder, time.perf_counter()
        self.stream = None
        rows = [j.tokens for j in joiners]
        guided, scored = any(j.guide is not None for j in joiners), any(j.scores is not None for j in joiners)
        if self.prefix is None:  # the call's own rows: they set what the batch computes
            self.scoring = scored
            self.guessing = self.sampling.guesses and not guided and not scored
            self.drafts = Guesses() if self.guessing else None
            shared = min(common_prefix(rows), min(len(r) for r in rows) - 1)  # every row keeps a token to feed
            if foreign or len(rows) == 1 and (self.borrowed or self.cache_key is not None):
                shared = 0  # a lone row is not a prefix to compute anew: the stored keys and values cover what they can
            self.prefix = d._prefix(self.kv_adapter, d._layers(self.kv_adapter), rows[0][:shared])
        elif (guided or scored) and self.guessing or scored and not self.scoring or self.borrowed:
            raise ValueError("a row joins only a batch that decodes it alike (guessing, scores, borrowed keys)")
        else:
            known = [] if foreign else self.prefix.tokens.tolist()
            self._shorten(min(common_prefix([known, *rows]), min(len(r) for r in rows) - 1))
        shared = self.prefix.shared
        if self.cache is None:
            d.stats.calls += 1
        d.stats.rows += len(rows)
        kv = [self.kv_adapter if a == self.adapter else a for a in adapters]
        starts = [d._stored(k, self.cache_key, r, shared) for k, r in zip(kv, rows, strict=True)]
        fresh = [len(r) - shared - n for r, (_, n) in zip(rows, starts, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: fresh[i])  # slot s holds row order[s]: chunks are slices
        own = [rows[i][shared:] for i in order]
        cache = Rows.allocate(d, [len(x) for x in own], max(j.max_new for j in joiners))
        for slot, i in enumerate(order):
            cache.load(slot, *starts[i], shared)
        under = [adapters[i] for i in order]  # every adapter's rows in one pass, each row with its own LoRA
        logits = d._prefill(
            lambda slots: self._mixed(tuple(under[slots])), own, [fresh[i] for i in order], shared, self.prefix, cache
        )
        first = len(self.joiners)
        self.joiners += joiners
        self.adapters += adapters
        self.out += [[] for _ in joiners]
        if guided and self.guides is None:
            self.guides = [None] * first
        if self.guides is not None:
            self.guides += [j.guide for j in joiners]
        joined = [first + i for i in order]
        if self.drafts is not None:
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
                    self.cache.sequence(slot, self.adapters[i], self.cache_key, row.tokens + out[:n], self.prefix, n)
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
        if width == 1 and self._streamed():
            return
        ids = torch.tensor([[out[-1], *g] + [0] * (width - 1 - len(g)) for out, g in zip(outs, guesses, strict=True)])
        hidden = d._decode(self._weights(), ids, self.lengths + self.fed, self.prefix, self.cache, self.fed)
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
        if self.stream is not None:  # a lone row's guesses were checked eagerly: its stream takes the tokens kept
            fed = int(self.fed[0])
            if not self.stream[1].follow(self.cache, fed - len(self.new[0]), fed):
                self.stream = None

    def _streamed(self) -> bool:
        """A lone live row's next token from the decoder's compiled step (``autoevolve.policy.stream``), where one is
        ready: its keys and values go to the row's buffers as well; whether it was."""
        d = self.decoder
        if d.streams is None or len(self.active) != 1:
            self.stream = None  # a step of several rows: a lone row later opens a stream afresh
            return False
        row, fed = self.active[0], int(self.fed[0])
        if self.stream is None or self.stream[0] != row:
            adapter = self.adapters[row]
            if adapter not in d.streams.ready:
                return False
            needed = int(self.lengths[0]) + fed + self.joiners[row].max_new - len(self.out[row]) + 1
            stream = d.streams.open(adapter, self.cache.whole(0, self.prefix.prefix, fed), needed)
            if stream is None:
                return False
            self.stream = row, stream
        token = self.out[row][-1]
        logits, new = self.stream[1](d, token)
        for index, (k, v) in enumerate(new):
            self.cache.gen_k[index][0, :, fed] = k[:, 0]
            self.cache.gen_v[index][0, :, fed] = v[:, 0]
        d.stats.decode_steps += 1
        d.stats.compiled_steps += 1
        self.raw = _log_softmax(logits, self.scoring)
        if self.seen is not None:
            self.seen[0, token] = True
        self.new = [[t] for t in self._pick(logits, self.active, self.seen).tolist()]
        self.fed += 1
        return True

    def _weights(self) -> list:
        """The layers the live rows decode under (see ``_mixed``), kept while the rows stay."""
        adapters = tuple(self.adapters[i] for i in self.active)
        if self.mix is None or self.mix[0] != adapters:
            self.mix = adapters, self._mixed(adapters)
        return self.mix[1]

    def _mixed(self, adapters: tuple) -> list:
        """The layers rows of these adapters (one per row) compute under: their adapter's, or each row's own LoRA
        where they differ."""
        if len(set(adapters)) == 1:
            return self.decoder._layers(adapters[0])
        names = sorted({a for a in adapters if a is not None})
        if self.stacked is None or self.stacked[0] != names:  # the factors are stacked anew only when the set changes
            self.stacked = names, stack([self.decoder._layers(a) for a in names])
        owners = torch.tensor([-1 if a is None else names.index(a) for a in adapters])
        return mixed(self.decoder.base, self.stacked[1], owners)

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


class Rows:
    """Each live row's keys and values: its own prompt [rows, kv_heads, width, head_dim] (right-aligned, contiguous)
    and its generated tokens [rows, kv_heads, max_new, head_dim], per layer."""

    def __init__(self, k: list, v: list, gen_k: list, gen_v: list, lengths: list[int], kv_heads: int) -> None:
        self.k, self.v, self.gen_k, self.gen_v, self.kv_heads = k, v, gen_k, gen_v, kv_heads
        self.width, self.dtype = k[0].shape[2], k[0].dtype
        self._lengths(lengths)

    @classmethod
    def allocate(cls, decoder: Decoder, lengths: list[int], max_new: int) -> Rows:
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
        return Sequence(adapter, key, np.asarray(tokens), prefix.prefix, self.whole(slot, [], fed))

    def whole(self, slot: int, prefix: KV, fed: int) -> KV:
        """A row's keys and values per layer, [kv_heads, tokens, head_dim]: ``prefix`` (per layer; or none), its own
        prompt, and its first ``fed`` new tokens."""
        start = self.width - self.lengths[slot]
        out = []
        for index, shared in enumerate(prefix or [None] * len(self.k)):
            k = [self.k[index][slot, :, start:], self.gen_k[index][slot, :, :fed]]
            v = [self.v[index][slot, :, start:], self.gen_v[index][slot, :, :fed]]
            if shared is not None:
                k.insert(0, shared[0])
                v.insert(0, shared[1])
            out.append((torch.cat(k, dim=1), torch.cat(v, dim=1)))
        return out

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

    def extend(self, other: Rows) -> Rows:
        """These rows and another's after them, in one set of buffers (the narrower padded)."""
        width, columns = max(self.width, other.width), max(self.gen_k[0].shape[2], other.gen_k[0].shape[2])

        def both(mine: list, theirs: list, gen: bool) -> list:
            def fit(t: torch.Tensor) -> torch.Tensor:  # own prompts pad on the left, generated tokens on the right
                room = (columns if gen else width) - t.shape[2]
                return F.pad(t, (0, 0, 0, room) if gen else (0, 0, room, 0))

            return [torch.cat([fit(a), fit(b)]) for a, b in zip(mine, theirs, strict=True)]

        return Rows(
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
        self.padded = not bool(self.valid.all())  # a row's own prompt is shorter than the widest
        bias = torch.zeros(self.valid.shape, dtype=self.dtype).masked_fill(~self.valid, float("-inf"))
        self.bias = bias.repeat_interleave(self.kv_heads, dim=0).unsqueeze(1)  # [rows * kv_heads, 1, width]


class Guesses:
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
