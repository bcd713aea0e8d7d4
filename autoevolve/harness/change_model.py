"""The routing call of the Mixture of LoRA, written once: the ``change_model`` tool built from the experts and their
routing rules, and what a call to it does in an episode (the chosen expert recorded, a 'switched' result). The router
environment, the router's conversation engine and the server all use these."""

from __future__ import annotations

import json
from typing import Any

from autoevolve.records import Expert

CHANGE_MODEL = "change_model"


def change_model_tool(experts: list[Expert], entry: str) -> dict[str, Any]:
    """The ``change_model`` tool spec: the experts other than the entry one, each with its routing rule."""
    others = [e for e in experts if e.name != entry]
    if not others:
        raise ValueError(f"no expert besides {entry} to route to: register one (autoevolve registry add-expert)")
    rules = "\n".join(f"- {e.name}: {e.routing_rule or 'no routing rule given'}" for e in others)
    return {
        "type": "function",
        "function": {
            "name": CHANGE_MODEL,
            "description": f"Hand the rest of this turn to the expert model that fits the request:\n{rules}",
            "parameters": {
                "type": "object",
                "properties": {
                    "model": {
                        "type": "string",
                        "enum": [e.name for e in others],
                        "description": "Name of the expert to hand the turn to.",
                    }
                },
                "required": ["model"],
            },
        },
    }


def switched(model: str) -> str:
    """The tool result of a routing call: the turn now belongs to ``model``."""
    return json.dumps({"model": model, "status": "switched"})


class Routing:
    """The routing part of an episode: a ``change_model`` call records the chosen expert and answers 'switched'."""

    chosen: str | None = None

    def route(self, arguments: dict[str, Any]) -> str:
        """Record the expert a call chose and return the call's result."""
        self.chosen = str(arguments.get("model"))
        return switched(self.chosen)
