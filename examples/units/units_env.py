"""A unit-conversion environment written to autoevolve's environment protocol (docs/environments.md).

The user asks for a quantity in another unit; the model should call ``convert`` and answer with the number.
Partial credit: half for the right call, half for the right number in the final reply; feedback says which half
was missed and why, in sentences the reflective mutator can act on.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from autoevolve.records import Message, Task, ToolCall

FACTORS = {  # (from, to): multiply by
    ("mi", "km"): 1.609344,
    ("km", "mi"): 1 / 1.609344,
    ("lb", "kg"): 0.45359237,
    ("kg", "lb"): 1 / 0.45359237,
    ("in", "cm"): 2.54,
    ("cm", "in"): 1 / 2.54,
}
NAMES = {"mi": "miles", "km": "kilometres", "lb": "pounds", "kg": "kilograms", "in": "inches", "cm": "centimetres"}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a quantity between units: mi, km, lb, kg, in, cm.",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "number", "description": "The quantity, e.g. 12."},
                "from_unit": {"type": "string", "description": "Unit of the quantity: mi, km, lb, kg, in or cm."},
                "to_unit": {"type": "string", "description": "Unit wanted: mi, km, lb, kg, in or cm."},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    },
}


class UnitsEpisode:
    """One question: the calls made so far."""

    finished = False  # the episode ends when the model answers without a call

    def __init__(self, task: Task) -> None:
        self.task = task
        self.calls: list[dict[str, Any]] = []

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run ``convert``; an unknown unit pair is an error result, an unknown tool a KeyError."""
        if name != "convert":
            raise KeyError(name)
        self.calls.append(arguments)
        pair = (arguments["from_unit"], arguments["to_unit"])
        if pair not in FACTORS:
            return json.dumps({"error": f"cannot convert {pair[0]} to {pair[1]}; units: {', '.join(NAMES)}"})
        return json.dumps({"value": round(arguments["value"] * FACTORS[pair], 2), "unit": pair[1]})

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """Half for a right convert call, half for the right number in the final reply; why each half was missed."""
        goal, missed = self.task.goal, []
        right = {"value": goal["value"], "from_unit": goal["from_unit"], "to_unit": goal["to_unit"]}
        if right not in self.calls:
            made = json.dumps(self.calls[-1]) if self.calls else "no call"
            missed.append(f"The convert call should have been {json.dumps(right)}, but it was {made}.")
        reply = messages[-1].content if messages and messages[-1].role == "assistant" else ""
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", reply.replace(",", ""))]
        if not any(abs(n - goal["answer"]) <= 0.01 * abs(goal["answer"]) for n in numbers):
            missed.append(f"The final reply should state {goal['answer']} {goal['to_unit']}; it said: {reply!r}.")
        return 1.0 - 0.5 * len(missed), " ".join(missed)


class UnitsEnv:
    """Seeded conversion questions in train, dev and test splits."""

    name = "units"

    def __init__(self, seed: int = 0, n_train: int = 64, n_dev: int = 16, n_test: int = 32) -> None:
        rng, pairs = random.Random(f"units:{seed}"), sorted(FACTORS)
        sizes = {"test": n_test, "dev": n_dev, "train": n_train}  # held-out splits first: they stay put
        self.splits: dict[str, list[Task]] = {}
        number = 0
        for split, n in sizes.items():
            self.splits[split] = []
            for _ in range(n):
                number += 1
                src, dst = rng.choice(pairs)
                value = rng.choice([2, 3, 5, 8, 10, 12, 15, 20, 25, 40, 50, 100])
                goal = {"value": value, "from_unit": src, "to_unit": dst, "answer": round(value * FACTORS[src, dst], 2)}
                request = f"How many {NAMES[dst]} is {value} {NAMES[src]}?"
                self.splits[split].append(
                    Task(id=f"units-{number:05d}", env=self.name, split=split, tier=1, request=request, goal=goal)
                )

    def tasks(self, split: str) -> list[Task]:
        """The split's tasks, in a fixed order."""
        return list(self.splits[split])

    def tools(self) -> list[dict[str, Any]]:
        """The one tool, ``convert``."""
        return [json.loads(json.dumps(CONVERT))]

    def start(self, task: Task) -> UnitsEpisode:
        """A fresh episode."""
        return UnitsEpisode(task)

    def reference(self, task: Task) -> list[Message] | None:
        """The right call and answer for a train task (demos are drawn from these); None for dev and test."""
        if task.split != "train":
            return None
        goal = task.goal
        arguments = {"value": goal["value"], "from_unit": goal["from_unit"], "to_unit": goal["to_unit"]}
        result = UnitsEpisode(task).call("convert", arguments)
        return [
            Message(role="user", content=task.request),
            Message(role="assistant", tool_calls=[ToolCall.make("call_1", "convert", arguments)]),
            Message(role="tool", tool_call_id="call_1", content=result),
            Message(
                role="assistant",
                content=f"{goal['value']} {NAMES[goal['from_unit']]} is {goal['answer']} {NAMES[goal['to_unit']]}.",
            ),
        ]
