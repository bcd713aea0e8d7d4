"""The reflective mutator: an optimiser LLM reads trajectories with rewards and feedback and rewrites one component.

As in GEPA's reflective mutation, the optimiser sees the parent's own attempts on a train minibatch (what the
assistant did, the score, the environment's feedback) and writes a new version of one named component. A reply
that does not parse into a valid HCP config raises ProposalError carrying the reply, which the search records
as a failed proposal.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.toolcall import clip
from autoevolve.policy import ChatRequest, Policy
from autoevolve.records import Trajectory
from autoevolve.stages.evolve.proposal import Evidence, Proposal, ProposalError, SearchState, from_frontier
from autoevolve.stages.settings import ReflectionSettings

PLACEHOLDERS = ("{tools}", "{call_format}", "{memory}", "{routing}")
TEXT_COMPONENTS = ("system_prompt", "routing", "memory")


class Reflective:
    """Rewrites one component (drawn from ``settings.components``, frozen ones left out) with an optimiser LLM."""

    name = "reflective"
    calls = 1

    def __init__(
        self, optimiser: Policy, settings: ReflectionSettings, frozen: list[str] = (), adapter: str | None = None
    ) -> None:
        self.optimiser, self.settings, self.adapter = optimiser, settings, adapter
        self.components = [c for c in settings.components if c not in frozen]
        self.meta = yaml.safe_load(Path(settings.meta_prompts).read_text())

    def propose(self, state: SearchState) -> Proposal:
        """A frontier parent and its child by ``mutate``."""
        return from_frontier(state, self.mutate)

    def mutate(self, parent: HCPConfig, evidence: Evidence, rng: random.Random) -> HCPConfig:
        """Ask the optimiser for a new version of one component and apply it to the parent."""
        if not self.components:
            raise ValueError("every component the reflective mutator may rewrite is frozen")
        component = rng.choice(self.components)
        request = ChatRequest(
            messages=[
                {"role": "system", "content": self.meta["system"]},
                {"role": "user", "content": self._prompt(parent, component, evidence.minibatch, rng)},
            ],
            temperature=self.settings.temperature,
            max_new_tokens=self.settings.max_new_tokens,
            seed=rng.randrange(1 << 30),
        )
        [reply] = self.optimiser.generate([request], self.adapter)
        if reply.error:
            raise ProposalError(f"optimiser call failed: {reply.error}")
        return apply_reply(parent, component, reply.text)

    def _prompt(self, parent: HCPConfig, component: str, trajs: list[Trajectory], rng: random.Random) -> str:
        """The meta-prompt for one component, filled with the parent's current text and the examples."""
        structured = component not in TEXT_COMPONENTS
        rules = self.meta["rules"].get(component, "")
        if component == "system_prompt":
            rules = rules.replace("{placeholders}", ", ".join(p for p in PLACEHOLDERS if p in parent.system_prompt))
        fills = {
            "{component}": component.replace("_", " "),
            "{current}": current_text(parent, component),
            "{examples}": format_examples(pick_examples(trajs, self.settings.examples, rng)),
            "{rules}": rules,
        }
        text = self.meta["yaml" if structured else "text"]
        for key, value in fills.items():
            text = text.replace(key, value)
        return text


def current_text(hcp: HCPConfig, component: str) -> str:
    """A component as the optimiser reads it: plain text, or YAML (tools as name/description/parameters)."""
    if component == "memory":
        return hcp.memory.template
    if component in TEXT_COMPONENTS:
        return getattr(hcp, component)
    if component == "tools":
        value: Any = [_tool_view(t["function"]) for t in hcp.tools]
    else:
        value = getattr(hcp, component).model_dump(mode="json")
    return yaml.safe_dump(value, sort_keys=False, width=120).strip()


def _tool_view(fn: dict[str, Any]) -> dict[str, Any]:
    """The editable part of a tool spec: its description and its parameters' descriptions."""
    props = fn.get("parameters", {}).get("properties", {})
    view: dict[str, Any] = {"name": fn["name"], "description": fn.get("description", "")}
    if props:
        view["parameters"] = {p: s.get("description", "") for p, s in props.items()}
    return view


def pick_examples(trajs: list[Trajectory], n: int, rng: random.Random) -> list[Trajectory]:
    """Up to n trajectories, failures first (they carry the feedback), then successes."""
    failed = [t for t in trajs if t.reward < 1.0]
    solved = [t for t in trajs if t.reward >= 1.0]
    rng.shuffle(failed)
    rng.shuffle(solved)
    return (failed + solved)[:n]


def format_examples(trajs: list[Trajectory]) -> str:
    """Trajectories as readable text: request, each turn, score and feedback."""
    blocks = []
    for i, t in enumerate(trajs, 1):
        lines = [f"Task {i} (score {t.reward:.2f})"]
        for m in t.messages:
            if m.role == "assistant" and m.tool_calls:
                calls = [json.dumps({"name": c.name, "arguments": c.arguments}) for c in m.tool_calls]
                lines.append(f"Assistant called: {' '.join(calls)}")
            elif m.role != "system":
                lines.append(f"{m.role.capitalize()}: {clip(m.content, 300)}")
        if t.error:
            lines.append(f"Error: {clip(t.error, 300)}")
        lines.append(f"Feedback: {t.feedback or 'none: the task was fully solved.'}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else "(no attempts yet)"


_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)  # a reply cut off mid-block counts


def apply_reply(parent: HCPConfig, component: str, reply: str) -> HCPConfig:
    """The parent with the component the reply rewrote; ProposalError (with the reply) when it does not parse."""
    blocks = _FENCE.findall(reply)
    body = (blocks[-1] if blocks else reply).strip()
    if not body:
        raise ProposalError(f"the optimiser's reply holds no new {component}", reply)
    if component == "system_prompt":
        lost = [p for p in PLACEHOLDERS if p in parent.system_prompt and p not in body]
        if lost:
            raise ProposalError(f"the new system prompt drops the placeholder {lost[0]}", reply)
        return parent.model_copy(update={"system_prompt": body})
    if component == "routing":
        return parent.model_copy(update={"routing": body})
    if component == "memory":
        return parent.model_copy(update={"memory": parent.memory.model_copy(update={"template": body})})
    try:
        value = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        why = f"the optimiser's {component} is not valid YAML or JSON: {clip(str(exc), 160)}"
        raise ProposalError(why, reply) from None
    if component == "tools":
        return _with_descriptions(parent, value, reply)
    data = parent.model_dump(mode="json") | {component: value}
    try:
        return HCPConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        why = f"the optimiser's {component} is not a valid HCP config: {where}: {err['msg']}"
        raise ProposalError(why, reply) from None


def _with_descriptions(parent: HCPConfig, value: Any, reply: str) -> HCPConfig:
    """Apply rewritten tool and parameter descriptions; names and schemas stay as they are (the env checks them)."""
    if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v for v in value):
        raise ProposalError("the optimiser's tools are not a list of {name, description, parameters}", reply)
    new = {v["name"]: v for v in value}
    unknown = sorted(set(new) - set(parent.tool_names))
    if unknown:
        raise ProposalError(f"the optimiser's tools name an unknown tool {unknown[0]!r}", reply)
    tools = json.loads(json.dumps(parent.tools))  # a deep copy to edit
    for tool in tools:
        fn = tool["function"]
        view = new.get(fn["name"])
        if view is None:
            continue
        if isinstance(view.get("description"), str):
            fn["description"] = view["description"]
        props = fn.get("parameters", {}).get("properties", {})
        for param, text in (view.get("parameters") or {}).items():
            if param not in props:
                raise ProposalError(f"the optimiser's tools name an unknown parameter {fn['name']}.{param}", reply)
            if isinstance(text, str):
                props[param]["description"] = text
    return parent.model_copy(update={"tools": tools})
