"""The router environment: does the entry expert hand each request to the right expert?

Requests come from three experts' domains: bookings (the life environment's requests, for ``L1-life``), code
(``L2-code``) and small talk, which the entry expert ``L0-chat`` answers itself. Every task offers the
``change_model`` tool built from the experts' routing rules, as the router harness does from the registry: ``experts``
(by default the three domains' own), or, registered by name as ``router``, a registry's (``registry``, a store's path;
``autoevolve.fleet.router.router_env`` reads it), as ``autoevolve serve`` does. Reward 1
for calling ``change_model`` with the right expert, or, when the entry expert is right, for answering without a
call; 0 otherwise. One model call per task, so the entry expert's HCP config can be evolved and distilled with the
same loop as any other expert's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from autoevolve.harness.change_model import CHANGE_MODEL, Routing, change_model_tool
from autoevolve.records import Expert, Message, Split, Task, ToolCall

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
EXPERTS = [
    Expert(
        name="L0-chat", tier=0, routing_rule="Small talk, greetings and questions about the assistant.", base_model=BASE
    ),
    Expert(
        name="L1-life",
        routing_rule="Bookings: restaurant tables, hotel stays, taxi rides, calendar events.",
        base_model=BASE,
    ),
    Expert(name="L2-code", routing_rule="Writing, explaining or fixing program code.", base_model=BASE),
]
CHAT_OPENERS = ["Hi!", "Hello there.", "Good morning!", "Hey.", "Evening!", "Hi again.", "Hello!", "Yo!"]
CHAT_QUESTIONS = [
    "How are you today?",
    "What's your name?",
    "Tell me something cheerful.",
    "Do you like rainy days?",
    "What should I call you?",
    "Are you having a good day?",
    "What is your favourite colour?",
    "Can you cheer me up a little?",
    "Thanks for the help earlier!",
    "What do you enjoy talking about?",
    "Say something nice about Mondays.",
    "Do you ever get tired?",
]
CODE_VERBS = ["Write", "Show me", "Fix", "Explain", "Write a test for", "Speed up", "Review", "Document"]
CODE_THINGS = [
    "a Python function that reverses a string",
    "a SQL query that counts orders per customer",
    "a bash loop over every .txt file",
    "a JavaScript debounce helper",
    "a Python class for a stack",
    "a regex that matches e-mail addresses",
    "a Rust function that sums a vector",
    "a binary search in C",
    "a Python script that renames photos by date",
    "a Go HTTP handler that returns JSON",
]
SPLIT_ORDER: tuple[Split, ...] = ("train", "dev", "test")


class RouterEpisode(Routing):
    """One request: which expert, if any, the entry expert handed it to."""

    def __init__(self, task: Task) -> None:
        self.task = task

    @property
    def finished(self) -> bool:
        """A routing call is the whole answer."""
        return self.chosen is not None

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Only change_model exists here; any other tool raises KeyError (an unknown tool)."""
        if name != CHANGE_MODEL:
            raise KeyError(name)
        return self.route(arguments)

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """1 for the right expert (or the entry expert's own answer when it is right), else 0 with why."""
        want, entry = self.task.goal["expert"], self.task.goal["entry"]
        if want == entry:
            answered = self.chosen is None and bool(messages) and messages[-1].role == "assistant"
            if answered and messages[-1].content:
                return 1.0, ""
            return 0.0, f"Expected {entry} to answer this itself; it called change_model({self.chosen})."
        if self.chosen == want:
            return 1.0, ""
        got = f"change_model({self.chosen})" if self.chosen else "an answer without routing"
        return 0.0, f"Expected change_model({want}); got {got}."


class RouterEnv:
    """Seeded routing tasks in three domains, split into train, dev and test."""

    name = "router"

    def __init__(
        self,
        seed: int = 0,
        tiers: Sequence[int] = (1,),
        n_train: int = 96,
        n_dev: int = 48,
        n_test: int = 48,
        entry: str = "L0-chat",
        experts: Sequence[Expert] | None = None,
    ) -> None:
        if tuple(tiers) != (1,):
            raise ValueError(f"the router environment has one tier: set env.tiers: [1] (got {list(tiers)})")
        if entry not in {e.name for e in EXPERTS}:
            raise ValueError(f"entry expert {entry!r} is not one of {', '.join(e.name for e in EXPERTS)}")
        self.seed, self.entry = seed, entry
        self.experts = list(experts) if experts is not None else EXPERTS
        missing = [e.name for e in EXPERTS if e.name not in {x.name for x in self.experts}]
        if missing:
            raise ValueError(
                f"no expert {missing[0]!r}, which the router environment's requests need: "
                f"autoevolve registry add-expert {missing[0]} --base-model ... --rule '...'"
            )
        self.tool = change_model_tool(self.experts, entry)
        self._splits = self._build({"train": n_train, "dev": n_dev, "test": n_test})

    def tasks(self, split: Split) -> list[Task]:
        """All tasks of a split, in a fixed order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}")
        return list(self._splits[split])

    def tools(self) -> list[dict[str, Any]]:
        """The change_model tool."""
        return [self.tool]

    def start(self, task: Task) -> RouterEpisode:
        """A fresh episode."""
        return RouterEpisode(task)

    def reference(self, task: Task) -> list[Message] | None:
        """The right move for a train task: the call to the right expert, or a short answer by the entry expert."""
        if task.split != "train":
            return None
        user = Message(role="user", content=task.request)
        want = task.goal["expert"]
        if want == self.entry:
            return [user, Message(role="assistant", content="I'm doing well, thanks for asking! How can I help?")]
        call = ToolCall.make("call_1", CHANGE_MODEL, {"model": want})
        result = Routing().route({"model": want})
        return [
            user,
            Message(role="assistant", tool_calls=[call]),
            Message(role="tool", tool_call_id="call_1", content=result),
        ]

    def _build(self, sizes: dict[str, int]) -> dict[str, list[Task]]:
        """Draw distinct requests round-robin over the three domains and deal them into the splits."""
        from autoevolve.envs.life import LifeEnv

        total = sum(sizes.values())
        rng = random.Random(f"router:{self.seed}")
        life = [t.request for t in LifeEnv(seed=self.seed, n_train=total, n_dev=0, n_test=0).tasks("train")]
        chat = [f"{o} {q}" for o in CHAT_OPENERS for q in CHAT_QUESTIONS]
        code = [f"{v} {t}." for v in CODE_VERBS for t in CODE_THINGS]
        pools = {"L1-life": life, "L0-chat": chat, "L2-code": code}
        for pool in pools.values():
            rng.shuffle(pool)
        order = ["L1-life", "L0-chat", "L2-code"]
        if total > min(len(p) for p in pools.values()) * len(order):
            raise ValueError(f"the router environment can draw at most {min(map(len, pools.values())) * 3} tasks")
        drawn = [(order[i % 3], pools[order[i % 3]][i // 3]) for i in range(total)]
        splits, start = {}, 0
        for split in SPLIT_ORDER:
            chunk = drawn[start : start + sizes[split]]
            start += sizes[split]
            splits[split] = [
                Task(
                    id=f"router-{start - len(chunk) + i:05d}",
                    env=self.name,
                    split=split,
                    tier=1,
                    request=request,
                    goal={"expert": expert, "entry": self.entry},
                    tools=[self.tool],
                )
                for i, (expert, request) in enumerate(chunk)
            ]
        return splits
