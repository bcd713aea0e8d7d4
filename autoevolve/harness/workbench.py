"""The workbench a round runs on: policy, environment, store and run id, with rollouts cached in the store.

Every rollout is written to the store as soon as its batch finishes; a rollout already stored under the same
(run, HCP id, adapter, task, sample) is read back instead of generated again, so a re-run resumes. A batch most of
whose rollouts failed at the policy endpoint with one error is not a score: the workbench stores the batch's other
rollouts (so a re-run sends the failed ones again) and raises EndpointDown with the server's message and the shape
of the request it refused.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from autoevolve.envs import Environment
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import ENDPOINT_ERROR, rollout
from autoevolve.policy import Policy
from autoevolve.records import Task, Trajectory
from autoevolve.store import Store
from autoevolve.views.narration import print_progress

Progress = Callable[[str, int, int], None]
MIN_STOP_BATCH = 4  # a call for fewer rollouts never stops a stage: one broken task is not a broken endpoint


class EndpointDown(RuntimeError):
    """Most of a batch failed at the policy endpoint with the same error; the message says what it refused.

    ``transient``: the error may pass (a connection error, a timeout, 408/409/429 or 5xx), so running the stage
    again later may succeed; a refusal (400, 401, 404, ...) will not until the request or the server changes.
    """

    def __init__(self, transient: bool, message: str) -> None:
        super().__init__(message)
        self.transient = transient

    def __reduce__(self) -> tuple:
        return EndpointDown, (self.transient, str(self))  # survives pickling (Prefect may store a failed result)


@dataclass
class Workbench:
    """What every stage needs to run rollouts and record them."""

    policy: Policy
    env: Environment
    store: Store
    run_id: str
    round: int = 0
    seed: int = 0
    chunk: int = 64
    progress: Progress | None = field(default=print_progress)
    endpoint_stop: float | None = 0.5  # share of a batch failing alike at the endpoint that stops the stage
    written: set[str] = field(default_factory=set)  # ids of the configs this workbench has stored

    def rollouts(
        self,
        hcp: HCPConfig,
        tasks: list[Task],
        adapter: str = "",
        stage: str = "evolve",
        samples: int = 1,
        first_sample: int = 0,
    ) -> list[Trajectory]:
        """Trajectories of ``tasks`` under a config and adapter: stored ones reused, missing ones generated.

        Samples are numbered from ``first_sample`` (a sample's index seeds its decoding): a later round that wants
        new samples of the same config asks for higher numbers.
        """
        wanted = range(first_sample, first_sample + samples)
        if hcp.id not in self.written:  # once per config: the store keeps the first write of an id anyway
            self.store.put_hcp(hcp.id, hcp.name, hcp.model_dump(mode="json"))
            self.written.add(hcp.id)
        stored = {
            (t.task_id, t.sample): t
            for t in self.store.trajectories(
                self.run_id, hcp_id=hcp.id, adapter=adapter, task_ids=[t.id for t in tasks]
            )
        }
        todo = [t for t in tasks if any((t.id, s) not in stored for s in wanted)]
        label = f"{stage} {hcp.id}{'+' + adapter if adapter else ''}"
        if todo and self.progress:
            self.progress(label, 0, len(todo))  # the bar starts with the work: its rate and time left count from here
        for start in range(0, len(todo), self.chunk):
            batch = todo[start : start + self.chunk]
            made = rollout(
                self.policy,
                self.env,
                hcp,
                batch,
                run_id=self.run_id,
                adapter=adapter,
                samples=samples,
                stage=stage,
                round=self.round,
                seed=self.seed,
                first_sample=first_sample,
            )
            down = self._endpoint_down(hcp, adapter, batch, made, len(tasks) * samples)
            if down:
                self.store.put_trajectories([t for t in made if not t.error.startswith(ENDPOINT_ERROR)])
                raise down
            self.store.put_trajectories(made)  # written per chunk: a crash loses at most one chunk
            stored.update({(t.task_id, t.sample): t for t in made})
            if self.progress:
                self.progress(label, min(start + self.chunk, len(todo)), len(todo))
        return [stored[(t.id, s)] for t in tasks for s in wanted]

    def _endpoint_down(
        self, hcp: HCPConfig, adapter: str, tasks: list[Task], made: list[Trajectory], asked: int
    ) -> EndpointDown | None:
        """The error to stop on when more than ``endpoint_stop`` of a batch failed at the endpoint alike (``asked``:
        the rollouts the call wanted, stored ones included, so a re-run of only the failed ones still stops)."""
        failed = [t for t in made if t.error.startswith(ENDPOINT_ERROR)]
        if self.endpoint_stop is None or asked < MIN_STOP_BATCH or not failed:
            return None
        kind = {id(t): re.sub(r" after \d+ attempts?", "", t.error) for t in failed}  # attempts aside, the same
        error, count = Counter(kind.values()).most_common(1)[0]
        if count <= self.endpoint_stop * len(made):
            return None
        first = next(t for t in failed if kind[id(t)] == error)
        task = next(t for t in tasks if t.id == first.task_id)
        messages, tools = hcp.render(task, first.messages)
        status = re.search(r"Error code: (\d{3})", error)
        transient = status is None and ("APIConnectionError" in error or "APITimeoutError" in error)
        transient |= status is not None and (int(status.group(1)) in (408, 409, 429) or int(status.group(1)) >= 500)
        return EndpointDown(
            transient,
            f"{count} of {len(made)} rollouts failed at the policy endpoint with the same error, so this batch is "
            f"not a score and the stage stops (model.endpoint_stop: {self.endpoint_stop}). The endpoint said: "
            f"{first.error[len(ENDPOINT_ERROR) :][:600]}. The request it refused: {request_shape(messages, tools)}, "
            f"adapter {adapter or 'none (base model)'}, HCP {hcp.id}. The other rollouts are stored; once the "
            "endpoint is fixed, run the same command again to resume",
        )


def request_shape(messages: list[dict], tools: list[dict] | None) -> str:
    """What a chat request held, without its text: each message's role and fields, and the tools passed."""
    parts = []
    for m in messages:
        fields = [k for k in ("tool_calls", "tool_call_id") if m.get(k)]
        parts.append(m["role"] + (f"({', '.join(fields)})" if fields else ""))
    shown = f"{len(tools)} native tools" if tools else "no tools= field"
    return f"{len(messages)} messages [{', '.join(parts)}], {shown}"
