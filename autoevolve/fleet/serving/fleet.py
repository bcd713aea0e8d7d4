"""The served fleet: the base model and every LoRA version on one LocalPolicy, each behind its own harness.

A served name is the base model, an expert (its live version), or one version (``NAME@vN``). Each adapter is served
under the HCP config its training rendered under (``hcp.json`` in its folder, else the store's record of it), so a
conversation reaches the model as the same tokens stage 3 trained on. A request that opens with a system message
brings its own harness instead: its messages go to the chat template as sent, as vLLM serves them (the rollout
engine's requests are of this kind). Requesting ``router`` (or the entry expert by name) serves the Mixture of
LoRA: the entry expert gets ``change_model`` from the registry and may hand the turn to another expert. How the
chosen expert takes over is the ``switch``: ``own`` (default) renders the conversation under its own harness, the
tokens it was trained on, computed anew under its adapter; ``shared`` has it continue the entry expert's context (the
entry's harness and routing call) computed anew; ``shared_kv`` continues that context from the keys and values the
entry expert's adapter already computed, so only the routing result is prefilled (``bench/router_kv.py`` measures
the latency saved and the score lost).

One worker thread owns the model (``autoevolve.fleet.serving.worker``): it batches the requests waiting, lets
requests for any served adapter that sample alike join a running batch (continuous batching; not while a load or
unload waits), and runs adapter loads and unloads between batches, so a batch never sees two versions of an
adapter. A request names a served name, not a version: it is resolved when its batch starts. A name unloaded to be
loaded again (vLLM's promotion hook unloads, then loads) keeps its requests waiting for the reload, up to
``swap_grace_s``, instead of failing them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autoevolve.fleet import registry
from autoevolve.fleet.router import latest_turn
from autoevolve.fleet.serving.calls import View, cut, harnessed_call, in_context, read_calls
from autoevolve.fleet.serving.live import Live
from autoevolve.fleet.serving.wire import ChatBody, CompletionBody, Reply, SamplingBody, WireError, conversation
from autoevolve.fleet.serving.worker import Control, Job, Worker
from autoevolve.harness.change_model import CHANGE_MODEL, Routing, change_model_tool
from autoevolve.harness.hcp import HCPConfig
from autoevolve.model import base_model_id, chat_text
from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import Expert, Message, Trajectory

ROUTER = "router"  # the served name of the Mixture of LoRA (the entry expert's name serves it too)
log = logging.getLogger(__name__)
SWAP_GRACE_S = 10.0  # how long requests for an unloaded name wait for it to be loaded again
MAX_WAITING = 256  # requests admitted and not yet answered; past it a request is answered 429 at once
REPLY_TIMEOUT_S = 600.0  # how long a request waits for its batch before it is answered 503
TEXT_MAX_TOKENS = 16  # a text completion's limit when the request sets none (the reference's default)
CALLERS_KEPT = 65536  # tool call ids whose served name is kept, for the turn that sends their result
Switch = Literal["own", "shared", "shared_kv"]


@dataclass(frozen=True)
class Slot:
    """One served name: the adapter behind it ('' for the bare base model), its folder, and its harness."""

    name: str
    ref: str
    path: str = ""
    hcp: HCPConfig | None = None
    version: int | None = None

    def card(self, base: str, created: int) -> dict[str, Any]:
        """The model card of ``/v1/models``, as vLLM writes it (a LoRA's ``root`` is its folder)."""
        lora = bool(self.path)
        return {
            "id": self.name,
            "object": "model",
            "created": created,
            "owned_by": "autoevolve",
            "root": self.path if lora else base,
            "parent": base if lora else None,
        }


class Fleet:
    """Serves chat completions over a LocalPolicy's base model and adapters (see the module docstring)."""

    def __init__(
        self,
        policy: Any,
        base: str,
        *,
        experts: list[Expert] = (),
        entry: str | None = None,
        harnesses: dict[str, HCPConfig] | None = None,
        wait_s: float = 0.005,
        swap_grace_s: float = SWAP_GRACE_S,
        recorder: Callable[[Trajectory], None] | None = None,
        switch: Switch = "own",
        max_waiting: int = MAX_WAITING,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.policy, self.base = policy, base
        self.experts = {e.name: e for e in experts}
        self.entry = entry
        self.harnesses = dict(harnesses or {})  # an expert's harness when its folder and the store hold none
        self.swap_grace_s, self.recorder = swap_grace_s, recorder
        self.switch = switch  # how the expert the router chose takes the turn over (see the module docstring)
        self.slots: dict[str, Slot] = {base: Slot(base, "")}
        self.aliases = {policy.model_name: base}  # the base model by the name its policy was made with, too
        self.created = int(time.time())
        self.unloaded: dict[str, float] = {}  # name -> when it was unloaded
        self.stats = {"batches": 0, "calls": 0, "largest_batch": 0, "joined": 0, "loads": 0, "unloads": 0}
        self.context = int(getattr(policy, "context_tokens", 0) or 0)  # prompt + completion tokens (0: unknown)
        self.max_waiting, self.reply_timeout_s = max_waiting, reply_timeout_s
        self.callers: OrderedDict[str, str] = OrderedDict()  # tool call id -> the served name that made it
        self._waiting = threading.BoundedSemaphore(max_waiting)
        self.in_flight, self._lock = 0, threading.Lock()  # requests admitted and not yet answered; guards callers
        self.worker = Worker(policy, self._slot, self._swapping, self._not_served, self.stats, wait_s)

    # -- the adapters served ------------------------------------------------------------------------------

    def load(
        self,
        name: str,
        path: str,
        inplace: bool = False,
        hcp: HCPConfig | None = None,
        ref: str | None = None,
        limit: int | None = None,
    ) -> Slot:
        """Serve an adapter folder under ``name`` (vLLM's ``load_lora_adapter``) as the adapter ``ref`` (its
        registered ``NAME@vN``; default ``name``), under the harness its folder holds (else ``hcp``, else the
        expert's in ``harnesses``); WireError when the name is taken (unless ``inplace``), is the base model's, the
        folder is no adapter, or ``limit`` adapters are loaded already."""
        return self._wait(self.worker.put(Control(lambda: self._load(name, path, inplace, hcp, ref or name, limit))))

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (vLLM's ``unload_lora_adapter``); its requests wait ``swap_grace_s`` for a reload."""
        self._wait(self.worker.put(Control(lambda: self._unload(name))))

    def on_worker(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` on the worker's thread, between batches, and return its result (or raise its exception): the
        thread that decodes is the one that should compute anything else (see ``autoevolve.fleet.serving.worker``)."""
        return self.worker.put(Control(run)).result()

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: the base model, each expert and each version served, and the router when there is one."""
        cards = [
            s.card(self.base, self.created)
            for s in sorted(list(self.slots.values()), key=lambda s: (s.name != self.base, s.name))
        ]
        if self._router_ready():
            cards.append({**self.slots[self.base].card(self.base, self.created), "id": ROUTER})
        return cards

    def _load(self, name: str, path: str, inplace: bool, hcp: HCPConfig | None, ref: str, limit: int | None) -> Slot:
        if name in (self.base, ROUTER):
            raise WireError(f"lora_name: {name!r} is the base model's or the router's name; pick another")
        if name in self.slots and not inplace:
            raise WireError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if limit is not None and ref not in self.policy.adapters and len(self.policy.adapters) >= limit:
            raise WireError(f"lora_name: {limit} adapters are loaded, the most this server keeps; unload one first")
        try:
            registry.check_adapter_folder(Path(path), base_model_id(self.policy.model_name))
        except ValueError as exc:
            raise WireError(f"lora_path: {exc}", param="lora_path") from None
        expert, _, version = ref.partition("@v")
        hcp = registry.folder_harness(path) or hcp or self.harnesses.get(expert)
        if self.policy.adapters.get(ref) != str(path):
            self.policy.add_adapter(ref, str(path))
        slot = Slot(name, ref, str(path), hcp, int(version) if version.isdigit() else None)
        self.slots[name] = slot
        if ref != name and ref not in self.slots:  # the version is served under its own name too
            self.slots[ref] = Slot(ref, ref, str(path), hcp, slot.version)
        self.unloaded.pop(name, None)
        self.stats["loads"] += 1
        return slot

    def _unload(self, name: str) -> None:
        if name == self.base:
            raise WireError("lora_name: the base model cannot be unloaded", param="lora_name")
        if name not in self.slots:
            raise WireError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name")
        ref = self.slots.pop(name).ref
        if ref and not any(s.ref == ref for s in self.slots.values()):
            self.policy.remove_adapter(ref)  # its weights are freed; a reload within the grace loads them again
        self.unloaded[name] = time.monotonic()
        self.stats["unloads"] += 1

    def serve_base_as(self, name: str, hcp: HCPConfig) -> None:
        """Serve an expert with no live version: the bare base model under its harness (startup only)."""
        self.slots[name] = Slot(name, "", "", hcp)

    # -- tokens ---------------------------------------------------------------------------------------------

    def served(self, name: str) -> None:
        """WireError 404 unless ``name`` is served here."""
        if self._slot(name) is None and not (name == ROUTER and self._router_ready()):
            raise self._not_served(name)

    def tokens(
        self, prompt: str | None, messages: list[dict[str, Any]] | None, generation_prompt: bool, special: bool
    ) -> list[int]:
        """Token ids of a prompt as it is, or of messages under the chat template as sent (vLLM's /tokenize)."""
        tokenizer = self.policy.tokenizer
        if prompt is not None:
            return tokenizer(prompt, add_special_tokens=special)["input_ids"]
        try:
            text = chat_text(tokenizer, messages or [], None, generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint names what it could not render
            raise WireError(f"messages: the chat template cannot render them: {exc}", param="messages") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def text(self, ids: list[int]) -> str:
        """The text of token ids (vLLM's /detokenize); WireError for an id outside the vocabulary."""
        size = len(self.policy.tokenizer)
        if any(not 0 <= i < size for i in ids):
            raise WireError(f"tokens: every id is in [0, {size})", param="tokens")
        return self.policy.tokenizer.decode(ids)

    # -- answering ------------------------------------------------------------------------------------------

    def reply(self, body: ChatBody, live: Live | None = None) -> Reply:
        """Answer one chat-completion request (blocks until its batch ran); WireError for a request it refuses, 429
        when ``max_waiting`` requests wait already. ``live`` hears each decode step's tokens (the text of a stream)
        and ends generation when its client leaves."""
        return self._admitted(body, lambda: self._reply(body, live))

    def complete(self, body: CompletionBody, live: Live | None = None) -> Reply:
        """Answer one text completions request: its prompt as it is, no chat template and no harness, under the
        served name's adapter (otherwise as ``reply``)."""

        def raw(slot: Slot) -> tuple[ChatRequest, View]:
            request = ChatRequest(
                messages=[],
                prompt=body.text,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=body.top_p or 1.0,
                max_new_tokens=body.max_new or TEXT_MAX_TOKENS,
                seed=body.seed or 0,
                logprobs=body.scores(),
                **body.extras(),
            )
            return request, View(None, None, [], False)

        return self._admitted(body, lambda: self._call(body.model, body, raw, live=live))

    def _admitted(self, body: SamplingBody, answer: Callable[[], Reply]) -> Reply:
        """``answer()`` for a request within the limits: a completion shorter than the context, a place to wait."""
        if self.context and body.max_new and body.max_new >= self.context:
            raise WireError(
                f"max_tokens: {body.max_new} is not below the model's context of {self.context} tokens",
                param="max_tokens",
            )
        if not self._waiting.acquire(blocking=False):
            raise WireError(f"{self.max_waiting} requests are waiting; retry shortly", status=429, retry_after=1)
        with self._lock:
            self.in_flight += 1
        try:
            return answer()
        finally:
            with self._lock:
                self.in_flight -= 1
            self._waiting.release()

    def live(self, body: SamplingBody, loop: Any = None) -> Live:
        """What follows a request's generation step by step (``reply``'s ``live``); ``loop``: where its text goes."""
        return Live(self.policy.tokenizer, body.stops, loop, stream=body.stream)

    def _reply(self, body: ChatBody, live: Live | None) -> Reply:
        history, system = conversation(body.messages)
        routed = body.model == ROUTER or (body.model == self.entry and system is None and self._router_ready())
        if routed:
            reply = self._routed(body, history, live)
        else:
            reply = self._call(body.model, body, history=history, system=system, live=live)
        with self._lock:
            for call in reply.calls:
                self.callers[call.id] = reply.served
            while len(self.callers) > CALLERS_KEPT:
                self.callers.popitem(last=False)
        if self.recorder is not None and not (live and live.cancelled.is_set()):  # a reply its client left: unsaid
            try:
                self.recorder(self._trajectory(body, history, reply))
            except Exception:  # noqa: BLE001 - the answer stands when it cannot be recorded
                log.exception("could not record a served conversation")
        return reply

    def _routed(self, body: ChatBody, history: list[Message], live: Live | None) -> Reply:
        """The Mixture of LoRA: the entry expert answers or calls change_model; a call hands the turn to that expert.
        A turn an expert left with a tool call goes on with that expert when the client sends the result."""
        if not self._router_ready():
            raise WireError(
                f"model: no router here (it needs an entry expert and another expert: {self._names()})",
                status=404,
                param="model",
            )
        if body.messages[0].get("role") in ("system", "developer"):
            raise WireError("messages: the router serves each expert under its own harness; send no system message")
        entry, turn = self.slots.get(self.entry or ""), latest_turn(history)
        if entry is None:  # unloaded since the check above
            raise WireError(f"model: the entry expert {self.entry!r} is being swapped; retry", status=503)
        tool = change_model_tool(list(self.experts.values()), self.entry)
        shared, keep = self.switch != "own", self.switch == "shared_kv"

        def harnessed(messages: list[Message], answering: bool, reuse: str | None = None) -> Callable:
            if shared:
                return lambda slot: in_context(entry.hcp, body, messages, tool, answering, keep, reuse)
            return lambda slot: harnessed_call(slot.hcp, body, messages, None, None if answering else tool)

        last = history[-1]
        with self._lock:
            owner = self.callers.get(last.tool_call_id or "") if last.role == "tool" else None
        if owner and owner != self.entry and owner in self.slots:
            return self._call(owner, body, harnessed(turn if shared else history, True), live=live)
        reply = self._call(self.entry, body, harnessed(turn, False), live=live)
        if not reply.calls or reply.calls[0].name != CHANGE_MODEL:
            return reply
        call, routed = reply.calls[0], Routing()
        result = routed.route(call.arguments)
        chosen = str(routed.chosen)
        if chosen == self.entry or chosen not in self.slots:  # a route to nowhere: the entry's reply stands
            return Reply(
                model=reply.model,
                text=json.dumps({"name": CHANGE_MODEL, "arguments": call.arguments}),
                prompt_tokens=reply.prompt_tokens,
                completion_tokens=reply.completion_tokens,
            )
        routing = [
            Message(role="assistant", tool_calls=[call], adapter=entry.ref or None),
            Message(role="tool", content=result, tool_call_id=call.id),
        ]
        reuse = entry.ref if self.switch == "shared_kv" else None
        answer = self._call(chosen, body, harnessed([*turn, *routing] if shared else history, True, reuse), live=live)
        answer.routing = routing
        answer.prompt_tokens += reply.prompt_tokens
        answer.completion_tokens += reply.completion_tokens
        return answer

    def _call(
        self,
        name: str,
        body: SamplingBody,
        make: Callable[[Slot], tuple[ChatRequest, View]] | None = None,
        history: list[Message] | None = None,
        system: str | None = None,
        live: Live | None = None,
    ) -> Reply:
        """One model call for a served name (its request made by ``make`` once the slot is known; by default the
        slot's harness over ``history``) and its reply in the wire's terms."""
        views: list[View] = []

        def build(slot: Slot) -> ChatRequest:
            request, view = make(slot) if make else harnessed_call(slot.hcp, body, history or [], system, None)
            views.append(view)
            request = self._fitted(request, body)
            if live is not None:
                live.begin(slot.ref or slot.name, text_only=not view.tools)
            return request

        job = Job(name, build, listener=live.take if live is not None else None)
        completion: Completion = self._wait(self.worker.put(job))
        if completion.error:
            log.error("generation failed for %s: %s", name, completion.error)
            raise WireError("generation failed; the server's log says why", status=500)
        slot, view = job.slot, views[0]
        text = cut(completion.text, body.stops)
        calls = read_calls(Completion(text=text), view)
        length = completion.completion_tokens >= (job.request.max_new_tokens if job.request else 0)
        return Reply(
            model=slot.ref or slot.name,
            text="" if calls else text,
            calls=calls,
            finish_reason="tool_calls" if calls else ("length" if length and text == completion.text else "stop"),
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            served=slot.name,
            logprobs=self._scored(completion.logprobs),
        )

    def _scored(self, scored: list[tuple[int, float, list[tuple[int, float]]]] | None) -> list[dict] | None:
        """Generated tokens' log-probabilities in the chat reference's shape (each token as text and bytes)."""
        if scored is None:
            return None
        decode = self.policy.tokenizer.decode

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]} for t, lp, top in scored]

    def _fitted(self, request: ChatRequest, body: SamplingBody) -> ChatRequest:
        """The request as it can run, else a 400 naming the field: a JSON schema that compiles, log-probabilities
        where the decoder computes them, a prompt that is not empty, within the model's context (a completion limit
        the client set must fit after the prompt, as vLLM answers; the server's own default is cut to what fits)."""
        if request.constrain is not None and request.constrain.json_value is not None:
            try:
                self.policy.check(request)
            except ValueError as exc:
                raise WireError(f"response_format: {exc}", param="response_format") from None
        if request.logprobs is not None and getattr(self.policy, "decoder", None) is None:
            raise WireError("logprobs: computed for Llama-shaped models only", param="logprobs")
        prompt = self.policy.prompt_tokens(request)
        if prompt == 0:
            raise WireError("prompt: it is empty; send at least one token to continue", param="prompt")
        if not self.context:
            return request
        room = self.context - prompt
        if room <= 0:
            where = "prompt" if request.prompt is not None else "messages"
            raise WireError(f"{where}: the prompt fills the model's context of {self.context} tokens", param=where)
        if request.max_new_tokens <= room:
            return request
        if body.max_new:
            raise WireError(
                f"max_tokens: {body.max_new} new tokens do not fit after the prompt's {self.context - room} in the "
                f"model's context of {self.context}; ask for at most {room}",
                param="max_tokens",
            )
        return request.model_copy(update={"max_new_tokens": room})

    def _wait(self, future: Future) -> Any:
        """A job's result, or 503 once ``reply_timeout_s`` has passed without it."""
        try:
            return future.result(timeout=self.reply_timeout_s)
        except TimeoutError:
            raise WireError(
                f"no reply within {self.reply_timeout_s:g} s: the server is busy; retry", status=503, retry_after=5
            ) from None

    def _router_ready(self) -> bool:
        """Whether the router can be served: an entry expert with a harness, and another expert to route to."""
        slot = self.slots.get(self.entry or "")
        return slot is not None and slot.hcp is not None and any(n != self.entry for n in self.experts)

    def _names(self) -> str:
        return ", ".join(sorted(self.slots))

    def _slot(self, name: str) -> Slot | None:
        """The slot a served name (or the base model's other name) resolves to; None when it is not served."""
        return self.slots.get(self.aliases.get(name, name))

    def _swapping(self, name: str) -> bool:
        """Whether a name not served now was unloaded within ``swap_grace_s`` (its requests wait for the reload)."""
        return time.monotonic() - self.unloaded.get(name, -1e9) < self.swap_grace_s

    def _not_served(self, name: str) -> WireError:
        return WireError(f"model: {name!r} is not served here (served: {self._names()})", status=404, param="model")

    def _trajectory(self, body: ChatBody, history: list[Message], reply: Reply) -> Trajectory:
        """A served request as a stored trajectory: the conversation, the routing exchange, the answer (each
        assistant message with the adapter that wrote it)."""
        answer = Message(role="assistant", content=reply.text, tool_calls=reply.calls, adapter=reply.model)
        first = reply.routing[0].adapter if reply.routing else reply.model  # who took the request
        entry = self.slots.get(first or self.base)
        digest = hashlib.sha256(json.dumps(body.messages, sort_keys=True).encode()).hexdigest()[:16]
        return Trajectory(
            run_id="serve",
            task_id=f"serve-{digest}",
            split="test",
            hcp_id=entry.hcp.id if entry and entry.hcp else "",
            adapter=first or "",
            stage="serve",
            messages=[*history, *reply.routing, answer],
            reward=0.0,
            feedback="served: not scored",
            prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
        )
