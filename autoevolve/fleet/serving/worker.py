"""The fleet's worker: one thread owns the model, batches the calls that wait, and runs adapter changes between
batches.

It takes the calls waiting (a few milliseconds' worth), resolves each one's served name to a slot, and makes one
``generate`` call per adapter; with a local policy the first batch of a round may be joined by the round's calls
for other adapters and by calls that arrive while it decodes (continuous batching, rows of several adapters in one
batch). Loads and unloads (controls) run between batches in the order they came, so a batch never sees two versions
of an adapter, and no call joins a batch once a control waits. A call for a name being swapped waits for the next
round instead of failing.

The worker's thread should be the only one that computes with several threads (``Fleet.on_worker`` runs startup
work there). GNU OpenMP, which torch's CPU kernels use, keeps each computing thread's team of helper threads alive,
and once the helpers it keeps outnumber the cores it stops spinning them between parallel regions: each of a decode
step's ~90 small products then waits for its helper to wake. A team left by the main thread (loading the model,
compiling the step) made every one-row step about twice as slow (measured on 2 cores: the compiled step took
15.5-18.5 ms from the worker against 7.4-8.7 ms from the thread that loaded it; ``autoevolve serve`` loads on one
thread and gives the worker all of them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoevolve.policy import ChatRequest, Completion

if TYPE_CHECKING:
    from autoevolve.fleet.serving.fleet import Slot

# The KV cache key of every served call that names none: a call starts from the longest prompt prefix an earlier one
# under the same adapter computed (a system prompt, the turns before), as vLLM's automatic prefix caching does.
PREFIXES = "served"


@dataclass
class Job:
    """A model call waiting for the worker: a served name and how to make its request once the slot is known."""

    name: str
    build: Callable[[Slot], ChatRequest]
    future: Future = field(default_factory=Future)
    slot: Slot | None = None
    request: ChatRequest | None = None
    listener: Callable[[list[int]], bool] | None = None  # each decode step's new tokens (a stream's, a watcher's)
    joined: bool = False  # taken by a running batch of another adapter, which answers it


@dataclass
class Control:
    """A change of the served adapters, run by the worker between batches."""

    run: Callable[[], Any]
    future: Future = field(default_factory=Future)


class Worker:
    """The thread that runs every call and control (see the module docstring). ``resolve``: a served name's slot
    (None when it is not served); ``swapping``: whether an unserved name waits for a reload; ``missing``: the error
    for a name that is not served."""

    def __init__(
        self,
        policy: Any,
        resolve: Callable[[str], Slot | None],
        swapping: Callable[[str], bool],
        missing: Callable[[str], Exception],
        stats: dict[str, int],
        wait_s: float,
    ) -> None:
        self.policy, self.resolve, self.swapping, self.missing = policy, resolve, swapping, missing
        self.stats, self.wait_s = stats, wait_s
        self._jobs: queue.Queue = queue.Queue()
        self._later: list[Any] = []  # jobs taken from the queue while a batch ran that did not join it, in order
        self._held: list[Job] = []  # calls gathered for later batches of this round: the running batch may take them
        self._fenced = True  # whether the running batch takes no joiners (a control waits, or it cannot)
        threading.Thread(target=self._work, name="autoevolve-fleet", daemon=True).start()

    def put(self, job: Job | Control) -> Future:
        """Queue a call or a control; its future has the result."""
        self._jobs.put(job)
        return job.future

    def _work(self) -> None:
        """Forever: gather what waits, run it; requests for a name being swapped wait for the next round."""
        waiting: list[Any] = []
        while True:
            later, self._later = self._later, []
            try:
                jobs = [*waiting, *later, self._jobs.get(timeout=0.02 if waiting or later else None)]
            except queue.Empty:
                jobs = [*waiting, *later]
            deadline = time.monotonic() + self.wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    jobs.append(self._jobs.get(timeout=left))
                except queue.Empty:
                    break
            waiting = self._run(jobs)

    def _run(self, jobs: list[Any]) -> list[Job]:
        """Run controls in order and batch the calls between them; returns the calls left waiting for a reload.
        The calls after the last control may be joined by requests that arrive while they decode."""
        waiting, calls = [], []
        for job in jobs:
            if isinstance(job, Control):
                self._generate(calls, joinable=False)
                calls = []
                _settle(job.future, job.run)
                continue
            slot = self.resolve(job.name)
            if slot is None and self.swapping(job.name):
                waiting.append(job)
            elif slot is None:
                job.future.set_exception(self.missing(job.name))
            elif _built(job, slot):
                calls.append(job)
        self._generate(calls, joinable=True)
        return waiting

    def _generate(self, calls: list[Job], joinable: bool) -> None:
        """One generate call per adapter for the calls gathered; a local policy's may be joined by new requests and
        by the calls gathered for the other adapters (those it takes are answered by it)."""
        groups: dict[str, list[Job]] = {}
        for job in calls:
            groups.setdefault(job.slot.ref, []).append(job)
        local = getattr(self.policy, "decoder", None) is not None  # only a local policy hears tokens, takes joiners
        self._fenced = not (joinable and local)
        self._held = [j for group in list(groups.values())[1:] for j in group] if not self._fenced else []
        for ref, group in groups.items():
            group = [j for j in group if not j.joined]
            self._held = [j for j in self._held if j.slot.ref != ref]  # this batch's own rows now
            if not group:
                continue
            listeners = [j.listener for j in group] if any(j.listener for j in group) else None
            try:
                extra: dict[str, Any] = {"listeners": listeners} if listeners else {}
                if local:
                    extra["arrivals"] = self._take
                completions = self.policy.generate([j.request for j in group], ref or None, **extra)
            except Exception as exc:  # noqa: BLE001 - the policy never raises; this is a bug, reported per request
                completions = [Completion(error=f"{type(exc).__name__}: {exc}")] * len(group)
            self.stats["batches"] += 1
            self.stats["calls"] += len(group)
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(group))
            for job, completion in zip(group, completions, strict=True):
                job.future.set_result(completion)

    def _take(self, fits: Callable[[ChatRequest, str | None], bool], room: int) -> list[Any]:
        """What joins a running batch: the round's held calls and the queued requests that fit it (any served
        adapter the decoder computes), up to ``room``; the others are kept, in order, for the next round. A control
        (load, unload) stops the joining: what was queued after it runs after it."""
        joined: list[Any] = []
        for job in list(self._held):
            if len(joined) < room and fits(job.request, job.slot.ref or None):
                self._held.remove(job)
                job.joined = True
                joined.append((job.request, job.listener, job.future.set_result, job.slot.ref or None))
        while len(joined) < room and not self._fenced:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            slot = None if isinstance(job, Control) else self.resolve(job.name)
            if slot is None:
                self._later.append(job)
                self._fenced = isinstance(job, Control)
                continue
            if not _built(job, slot):
                continue
            if not fits(job.request, slot.ref or None):
                self._later.append(job)
                continue
            joined.append((job.request, job.listener, job.future.set_result, slot.ref or None))
        self.stats["calls"] += len(joined)
        self.stats["joined"] += len(joined)
        return joined


def _built(job: Job, slot: Slot) -> bool:
    """Make a call's request for the slot it resolved to; a request that cannot be made fails alone."""
    try:
        job.slot, job.request = slot, job.build(slot)
    except Exception as exc:  # noqa: BLE001 - its caller gets the exception
        job.future.set_exception(exc)
        return False
    if job.request.cache_key is None:
        job.request = job.request.model_copy(update={"cache_key": PREFIXES})
    return True


def _settle(future: Future, run: Callable[[], Any]) -> None:
    try:
        future.set_result(run())
    except Exception as exc:  # noqa: BLE001 - the caller gets the exception
        future.set_exception(exc)
