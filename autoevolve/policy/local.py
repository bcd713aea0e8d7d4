"""LocalPolicy: transformers + PEFT in this process, batched generation, many named LoRAs on one base.

Llama-shaped models decode with ``autoevolve.policy.decode`` (shared-prefix cache, rows leave the batch when they
end); any other architecture, or ``engine="hf"``, uses ``model.generate``.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from autoevolve import model as model_loader
from autoevolve.policy import CallConstraint, ChatRequest, Completion
from autoevolve.policy.batch import Joiner, Listener, Sampling, common_prefix
from autoevolve.policy.decode import OWN, Decoder, supports

Engine = Literal["auto", "hf"]
# A request, its listener, its answer, and the adapter it is for (a name, None for the base model).
Arrival = tuple[ChatRequest, Listener | None, Callable[[Completion], None], str | None]
Fits = Callable[[ChatRequest, str | None], bool]  # whether a request for an adapter can join the running batch
Arrivals = Callable[[Fits, int], list[Arrival]]  # (which fit, how many) -> requests


class LocalPolicy:
    """Serves a base model and named LoRA adapters from one copy of the base weights."""

    def __init__(
        self,
        model: str = model_loader.EMBEDDED,
        batch_size: int = 16,
        dtype: str = "auto",
        engine: Engine = "auto",
        compact_weights: bool = False,
        compiled_steps: bool = False,
    ) -> None:
        """``compact_weights``: the decoder's steps of a few rows read compact copies of fp32 weights;
        ``compiled_steps``: a lone row decodes through a compiled step once it is compiled (see ``Decoder``)."""
        self.model_name = model
        if compact_weights and dtype == "auto" and not torch.cuda.is_available():
            # The compact copies are made from fp32 weights (a 4-bit weight is recognised in its dequantised fp32
            # values); a bf16 load, "auto" on a CPU with native bf16, would leave every step reading bf16 weights.
            dtype = "float32"
        self.base, self.tokenizer = model_loader.load(model, dtype)
        # Served, never trained (training loads a fresh copy). Frozen now, as PEFT freezes it on the first adapter:
        # the compiled step's guards check the parameters, so a runtime load must not change them (a recompile).
        self.base.requires_grad_(False)
        self.lm: Any = self.base  # becomes a PeftModel once an adapter is added
        self.batch_size = batch_size
        self.adapters: dict[str, str] = {}
        self.share_prefix = True  # without the decoder: a batch's common prompt prefix is computed once
        self.decoder = None
        if engine == "auto" and supports(self.base):
            self.decoder = Decoder(
                self.base, self._stop_ids, compact_weights=compact_weights, compiled_steps=compiled_steps
            )
        self._grammars: Any = None  # autoevolve.policy.grammar.Grammars, made on the first constrained request

    def add_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder under a name (a name already loaded is replaced)."""
        from peft import PeftModel

        if self.lm is self.base:
            self.lm = PeftModel.from_pretrained(self.base, path, adapter_name=name)
        else:
            if name in self.adapters:
                self.lm.delete_adapter(name)
            self.lm.load_adapter(path, adapter_name=name)
        if self.decoder is not None:
            self.decoder.forget(name)  # cached prefixes of a replaced adapter are stale
        self.lm.eval()
        self.adapters[name] = path
        if self.decoder is not None and self.decoder.streams is not None:
            self.decoder.streams.adopt(name)

    def warm_steps(self) -> float:
        """Compile the decoder's one-row step (``compiled_steps``) for the base and every adapter loaded; the seconds
        it took (0 without one)."""
        if self.decoder is None or self.decoder.streams is None:
            return 0.0
        return sum(self.decoder.streams.warm(a) for a in [None, *self.adapters] if self.decoder.serves(a))

    def remove_adapter(self, name: str) -> None:
        """Unload a named adapter and what the decoder keeps of it."""
        if name not in self.adapters:
            return
        del self.adapters[name]
        if self.decoder is not None:
            self.decoder.forget(name)
        if self.adapters:
            self.lm.delete_adapter(name)
        else:  # PEFT keeps at least one adapter: serve the bare base again
            self.lm = self.base = self.lm.unload()

    @property
    def context_tokens(self) -> int:
        """The model's context: prompt and completion tokens together."""
        return int(getattr(self.base.config, "max_position_embeddings", 0) or 0)

    def check(self, request: ChatRequest) -> None:
        """ValueError when a request's constraint does not compile (so a server can refuse it before it is batched)."""
        if request.constrain is not None:
            self._guides([request.constrain])

    def prompt_tokens(self, request: ChatRequest) -> int:
        """Tokens of a request's prompt under the chat template."""
        return len(self._encode_text(request))

    def generate(
        self,
        requests: list[ChatRequest],
        adapter: str | None = None,
        listeners: list[Listener | None] | None = None,
        arrivals: Arrivals | None = None,
    ) -> list[Completion]:
        """Complete requests in text-sorted batches; requests with equal decoding knobs share a batch. ``listeners``
        (per request): called with its new tokens as they are generated, as the decoder's are (see
        ``Decoder.generate``); with ``model.generate`` once, at the end.

        ``arrivals`` (continuous batching, the decoder only): called between decode steps with a test of which
        requests fit the running batch (its sampling settings; any adapter the decoder computes) and how many rows
        it has room for; the requests it returns join the batch at once, each under its own adapter, and each one's
        completion goes to its own callback when it ends."""
        if adapter and adapter not in self.adapters:
            return [Completion(error=f"adapter {adapter!r} is not loaded") for _ in requests]
        texts = [self._template(r) for r in requests]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            groups[(_sampling(r), r.max_new_tokens, r.cache_key, r.reuse_kv_of, r.logprobs)].append(i)
        out: list[Completion | None] = [None] * len(requests)
        for (sampling, max_new, cache_key, reuse, logprobs), idx in groups.items():
            # Sorting by text puts prompts that share demos side by side, so each batch shares a longer prefix.
            idx.sort(key=lambda i: texts[i])
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start : start + self.batch_size]
                seed = requests[chunk[0]].seed
                batch = [texts[i] for i in chunk]
                constraints = [requests[i].constrain for i in chunk]
                heard = [listeners[i] for i in chunk] if listeners else None
                results = self._batch(
                    batch,
                    adapter,
                    sampling,
                    max_new,
                    seed,
                    cache_key,
                    constraints,
                    reuse,
                    heard,
                    logprobs,
                    arrivals,
                )
                for i, result in zip(chunk, results, strict=True):
                    out[i] = result
        return [c for c in out if c is not None]

    def _template(self, request: ChatRequest) -> str:
        """The prompt text under the model's chat template (a raw prompt as it is)."""
        if request.prompt is not None:
            return request.prompt
        return model_loader.chat_text(self.tokenizer, request.messages, request.tools, generation_prompt=True)

    def _encode_text(self, request: ChatRequest) -> list[int]:
        """Token ids of a request's prompt."""
        return self.tokenizer(self._template(request), add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def _batch(
        self,
        texts: list[str],
        adapter: str | None,
        sampling: Sampling,
        max_new: int,
        seed: int,
        cache_key: str | None = None,
        constraints: list[CallConstraint | None] | None = None,
        reuse_kv_of: str | None = None,
        listeners: list[Listener | None] | None = None,
        logprobs: int | None = None,
        arrivals: Arrivals | None = None,
    ) -> list[Completion]:
        """Generate for one batch; an exception fails the batch's requests, not the caller."""
        started = time.perf_counter()
        scores: list[list[Any]] | None = [[] for _ in texts] if logprobs is not None else None
        joining = None
        if arrivals is not None and reuse_kv_of is None and self.decoder is not None and self.decoder.serves(adapter):
            joining = _Joining(self, arrivals, (sampling, cache_key, reuse_kv_of, logprobs), any(constraints or []))
        try:
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            guides = self._guides(constraints or [])
            torch.manual_seed(seed)
            kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": self.tokenizer.pad_token_id}
            kwargs["repetition_penalty"] = sampling.repetition_penalty
            if sampling.temperature > 0:
                kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
                kwargs.update(top_k=sampling.top_k or None, min_p=sampling.min_p or None)
            else:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            if self.decoder is not None and self.decoder.serves(adapter):  # its own weights: no PEFT switch
                new = self.decoder.generate(
                    ids,
                    adapter=adapter,
                    max_new=max_new,
                    sampling=sampling,
                    seed=seed,
                    cache_key=cache_key,
                    guides=guides,
                    kv_adapter=OWN if reuse_kv_of is None else (reuse_kv_of or None),
                    listeners=listeners,
                    scores=scores,
                    top=logprobs or 0,
                    arrivals=joining,
                )
            else:
                with self._adapter(adapter):
                    if scores is not None:
                        raise ValueError("log-probabilities are computed by the decoder only (Llama-shaped models)")
                    if guides:
                        from transformers import LogitsProcessorList

                        kwargs["logits_processor"] = LogitsProcessorList([GuidedLogits(guides)])
                    new = self._generate_shared_prefix(ids, kwargs).tolist()
                    for row, listener in zip(new, listeners or [None] * len(new), strict=True):
                        if listener is not None:
                            listener(row[: next((k for k, t in enumerate(row) if t in self._stop_ids), len(row))])
        except Exception as exc:  # noqa: BLE001 - a broken batch becomes failed completions
            error = f"generation failed: {type(exc).__name__}: {exc}"
            if joining is not None:
                joining.fail(error)
            return [Completion(error=error) for _ in texts]
        elapsed = time.perf_counter() - started
        return [
            self._completion(row, len(prompt), elapsed, scores[k] if scores is not None else None)
            for k, (row, prompt) in enumerate(zip(new, ids, strict=True))
        ]

    def _completion(self, row: list[int], prompt: int, elapsed: float, scored: list | None) -> Completion:
        """A row's new tokens as a completion (cut at its stop token)."""
        n = next((k for k, t in enumerate(row) if t in self._stop_ids), len(row))
        text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
        return Completion(
            text=text,
            prompt_tokens=prompt,
            completion_tokens=n,
            latency_s=elapsed,
            logprobs=scored[:n] if scored is not None else None,
        )

    def _guides(self, constraints: list[CallConstraint | None]) -> list[Any] | None:
        """A grammar matcher per constrained row (None for a free one); None when no row is constrained."""
        if not any(constraints):
            return None
        if self._grammars is None:
            from autoevolve.policy.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.base.lm_head.out_features)
        return [self._grammars.guide(c) if c is not None else None for c in constraints]

    def _generate_shared_prefix(self, ids: list[list[int]], kwargs: dict[str, Any]) -> torch.Tensor:
        """Generate, computing the batch's common token prefix (system prompt, demos) once.

        Prompts under one config share a long prefix; prefill dominates CPU time, so the prefix's KV cache is
        computed for one row and repeated. Suffixes are left-padded after the prefix; the attention mask hides
        the pads and positions follow the mask, so outputs equal those of plain padded generation.
        """
        device = self.base.device
        shared = min(common_prefix(ids), min(len(x) for x in ids) - 1)  # every row keeps a token to feed
        if shared < 16 or not self.share_prefix:
            shared = 0  # too short to pay for a cache of its own: plain padded generation
        width = max(len(x) for x in ids) - shared
        pad = self.tokenizer.pad_token_id
        rows = [[pad] * (width - len(x) + shared) + x[shared:] for x in ids]
        masks = [[0] * (width - len(x) + shared) + [1] * (len(x) - shared) for x in ids]
        suffix = torch.tensor(rows, device=device)
        suffix_mask = torch.tensor(masks, device=device)
        if not shared:
            out = self.lm.generate(input_ids=suffix, attention_mask=suffix_mask, **kwargs)
            return out[:, suffix.shape[1] :]
        prefix = torch.tensor([ids[0][:shared]], device=device)
        cache = self.lm(input_ids=prefix, use_cache=True).cache
        cache.batch_repeat_interleave(len(ids))
        input_ids = torch.cat([prefix.expand(len(ids), -1), suffix], dim=1)
        mask = torch.cat([torch.ones_like(input_ids[:, :shared]), suffix_mask], dim=1)
        out = self.lm.generate(input_ids=input_ids, attention_mask=mask, cache=cache, **kwargs)
        return out[:, input_ids.shape[1] :]

    @contextmanager
    def _adapter(self, adapter: str | None) -> Iterator[None]:
        """Activate a named adapter, or disable every adapter to serve the bare base."""
        if self.lm is self.base:
            yield
        elif adapter is None:
            with self.lm.disable_adapter():
                yield
        else:
            self.lm.set_adapter(adapter)
            yield

    @property
    def _stop_ids(self) -> set[int]:
        """Token ids that end a completion."""
        eos = self.base.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        return {i for i in ids if i is not None} | ({self.tokenizer.pad_token_id} - {None})


class _Joining:
    """The decoder's ``arrivals`` for one running batch: the requests the caller hands over that decode alike (equal
    sampling settings; no grammar where the batch guesses ahead) become rows, each answered when it ends, or with
    the batch's error if the batch breaks first."""

    def __init__(self, policy: LocalPolicy, arrivals: Arrivals, knobs: tuple, guided: bool) -> None:
        self.policy, self.arrivals, self.knobs = policy, arrivals, knobs
        self.guessing = knobs[0].guesses and not guided and knobs[-1] is None
        self.open: dict[int, Callable[[Completion], None]] = {}  # rows joined and not ended (by number) -> answer
        self.numbers = itertools.count()

    def fits(self, r: ChatRequest, adapter: str | None) -> bool:
        alike = (_sampling(r), r.cache_key, r.reuse_kv_of, r.logprobs) == self.knobs
        loaded = adapter is None or adapter in self.policy.adapters
        served = loaded and self.policy.decoder is not None and self.policy.decoder.serves(adapter)
        return alike and served and not (self.guessing and r.constrain is not None)

    def __call__(self, live: int) -> list[Joiner]:
        rows = []
        for request, listener, answer, adapter in self.arrivals(self.fits, self.policy.batch_size - live):
            try:
                tokens = self.policy._encode_text(request)
                guide = (self.policy._guides([request.constrain]) or [None])[0]
            except Exception as exc:  # noqa: BLE001 - a request that cannot join fails alone
                answer(Completion(error=f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            scores: list | None = [] if request.logprobs is not None else None
            done = self._done(answer, len(tokens), scores)
            rows.append(Joiner(tokens, request.max_new_tokens, listener, guide, scores, done, adapter))
        return rows

    def fail(self, error: str) -> None:
        """The batch broke: every row that joined it and is still open fails with its error."""
        for answer in self.open.values():
            answer(Completion(error=error))
        self.open.clear()

    def _done(
        self, answer: Callable[[Completion], None], prompt: int, scores: list | None
    ) -> Callable[[list[int]], None]:
        key, started = next(self.numbers), time.perf_counter()
        self.open[key] = answer

        def done(out: list[int]) -> None:
            del self.open[key]
            answer(self.policy._completion(out, prompt, time.perf_counter() - started, scores))

        return done


class GuidedLogits:
    """``model.generate``'s view of per-row grammars: each step takes the row's last token, then masks its logits."""

    def __init__(self, guides: list[Any]) -> None:
        self.guides, self.started = guides, False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, guide in enumerate(self.guides):
            if guide is None:
                continue
            if self.started:
                guide.take([int(input_ids[row, -1])])
            guide.mask(scores[row])
        self.started = True
        return scores


def _sampling(request: ChatRequest) -> Sampling:
    """How a request picks its tokens (requests alike share a batch; greedy ones whatever their top-p, -k, min-p)."""
    if request.temperature <= 0:
        return Sampling(repetition_penalty=request.repetition_penalty)
    return Sampling(request.temperature, request.top_p, request.top_k, request.min_p, request.repetition_penalty)
