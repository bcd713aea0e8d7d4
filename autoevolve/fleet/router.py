"""The router harness of the Mixture of LoRA: the entry expert hands a user turn to another expert by a tool call.

The entry expert (``L0-chat`` by default) gets a ``change_model`` tool generated from the registry: its enum is the
other experts' names, each described by its routing rule, in the ordinary OpenAI tool format. Explicit routing: when
the entry expert calls it, the rest of that user turn is served by the chosen expert's live adapter under that
expert's own HCP config. Implicit routing: the next user message starts at the entry expert again. Every assistant
message records the adapter that wrote it, so each switch shows in the stored trajectory as a tool call and a change
of adapter.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from autoevolve.envs import Episode
from autoevolve.envs.routing import RouterEnv
from autoevolve.harness.change_model import CHANGE_MODEL, Routing, change_model_tool
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import apply, model_call
from autoevolve.policy import Policy
from autoevolve.records import Expert, Message, Task, Trajectory
from autoevolve.store import Store


@dataclass(frozen=True)
class Served:
    """One expert as the fleet serves it: its live adapter ('' for the bare base model) and its HCP config."""

    adapter: str
    hcp: HCPConfig


def served_experts(store: Store, hcps: dict[str, HCPConfig]) -> dict[str, Served]:
    """Each named expert's live adapter from the registry, paired with its HCP config."""
    served = {}
    for name, hcp in hcps.items():
        live = store.promoted_adapter(name)
        served[name] = Served(live.ref if live else "", hcp)
    return served


class Switchboard(Routing):
    """The conversation's episode plus ``change_model``: a call to it records the expert chosen."""

    def __init__(self, inner: Episode) -> None:
        self.inner = inner

    @property
    def finished(self) -> bool:
        """A routing call never ends the turn; otherwise the environment says."""
        return self.chosen is None and self.inner.finished

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Route, or run the environment's tool."""
        return self.route(arguments) if name == CHANGE_MODEL else self.inner.call(name, arguments)

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """The environment's score of the conversation."""
        return self.inner.score(messages)


def registry_experts(store_path: str) -> list[Expert]:
    """The experts of a registry, as the served router's ``change_model`` lists them (names, routing rules)."""
    with Store.snapshot(store_path) as store:
        return store.experts()


def router_env(
    seed: int = 0,
    tiers: Sequence[int] = (1,),
    n_train: int = 96,
    n_dev: int = 48,
    n_test: int = 48,
    entry: str = "L0-chat",
    registry: str | None = None,
) -> RouterEnv:
    """The router environment (registered as ``router``); with ``registry`` (a store's path) its ``change_model``
    lists that registry's experts and rules, as ``autoevolve serve`` does."""
    experts = registry_experts(registry) if registry else None
    try:
        return RouterEnv(seed, tiers, n_train, n_dev, n_test, entry, experts=experts)
    except ValueError as exc:
        raise ValueError(f"registry {registry}: {exc}" if registry else str(exc)) from None


def converse(
    policy: Policy,
    served: dict[str, Served],
    experts: list[Expert],
    entry: str,
    task: Task,
    episode: Episode,
    followups: list[str] = (),
    run_id: str = "",
    max_steps: int = 8,
    seed: int = 0,
) -> Trajectory:
    """Serve a conversation (the task's request, then each follow-up) through the router; returns its trajectory.

    Each user message starts at ``entry``, which sees that message alone (``latest_turn``); a ``change_model`` call
    hands the rest of the turn to that expert, which sees the whole conversation without the routing exchange (its
    own config knows no ``change_model``). A failed turn does not end the conversation; the trajectory keeps the
    first failure and scores 0. Each model call decodes with its own seed (``seed``, then one more per call).
    """
    tool = change_model_tool(experts, entry)
    board = Switchboard(episode)
    messages: list[Message] = []
    errors: list[str] = []
    calls = itertools.count(seed * 1000)  # every call's seed
    for text in [task.request, *followups]:
        messages.append(Message(role="user", content=text))
        error = _turn(policy, served, entry, tool, task, board, messages, max_steps, calls)
        if error:  # the conversation goes on, as it would for a user; the trajectory keeps the first failure
            errors.append(error)
    error = errors[0] if errors else ""
    reward, feedback = (0.0, f"The conversation failed: {error}.") if error else board.score(messages)
    return Trajectory(
        run_id=run_id,
        task_id=task.id,
        split=task.split,
        tier=task.tier,
        hcp_id=served[entry].hcp.id,
        adapter=served[entry].adapter,
        stage="route",
        messages=messages,
        reward=reward,
        feedback=feedback,
        error=error,
    )


def _turn(
    policy: Policy,
    served: dict[str, Served],
    entry: str,
    tool: dict[str, Any],
    task: Task,
    board: Switchboard,
    messages: list[Message],
    max_steps: int,
    seeds: Iterator[int],
) -> str:
    """Serve one user turn from the entry expert on, appending to ``messages``; returns '' or why it failed."""
    current = entry
    for _ in range(max_steps):
        expert = served[current]
        view = task.model_copy(update={"tools": [tool] if current == entry else []})
        history = latest_turn(messages) if current == entry else [m for m in messages if not _routing(m, messages)]
        request = model_call(expert.hcp, view, history, next(seeds))
        [completion] = policy.generate([request], expert.adapter or None)
        board.chosen = None
        done, error = apply(completion, expert.hcp, view, board, messages, f"call_{len(messages)}", expert.adapter)
        if error:
            return error
        if board.chosen is not None:
            if board.chosen not in served or board.chosen == entry:
                return f"change_model chose {board.chosen!r}, which is not an expert to route to"
            current = board.chosen
        elif done:
            return ""
    return f"step limit: no final reply after {max_steps} model calls in one turn"


def latest_turn(messages: list[Message]) -> list[Message]:
    """What the entry expert decides on: the conversation from the user's latest message on, one request as the
    router environment trains it (earlier turns belong to the experts that served them)."""
    last = max(i for i, m in enumerate(messages) if m.role == "user")
    return messages[last:]


def _routing(message: Message, messages: list[Message]) -> bool:
    """A change_model call or its result: the routing exchange other experts do not see."""
    if message.role == "assistant":
        return any(c.name == CHANGE_MODEL for c in message.tool_calls)
    if message.role == "tool":
        calls = {c.id: c.name for m in messages for c in m.tool_calls}
        return calls.get(message.tool_call_id) == CHANGE_MODEL
    return False
