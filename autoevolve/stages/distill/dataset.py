"""Distillation data: kept trajectories re-rendered under the original HCP config, tokenised with an assistant mask.

The mask is built generically from the chat template (no ``{% generation %}`` markers needed): each assistant
turn is the token span between the conversation rendered up to its generation prompt and the conversation
rendered up to and including it. TRL's ``SFTTrainer`` turns the ``assistant_masks`` column of a pre-tokenised
dataset into ``labels`` (-100 where the mask is 0), so only assistant tokens carry loss.
"""

from __future__ import annotations

import logging
from typing import Any

from autoevolve.harness.hcp import HCPConfig
from autoevolve.model import chat_text
from autoevolve.records import Task, Trajectory, without_failed_calls

log = logging.getLogger(__name__)


def render_examples(trajs: list[Trajectory], tasks: dict[str, Task], original: HCPConfig) -> list[list[dict]]:
    """Chat messages of each trajectory as the ORIGINAL config shows them (its system prompt and call syntax),
    without the calls the harness could not run and its answers to them."""
    examples = []
    for traj in trajs:
        if traj.task_id not in tasks:
            raise KeyError(f"trajectory {traj.key} names task {traj.task_id!r}, which is not in the task table")
        if not any(m.role == "assistant" for m in traj.messages):
            raise ValueError(f"trajectory {traj.key} has no assistant turn to learn from")
        # render() with the whole history returns the whole conversation, final assistant turn included.
        messages, _ = original.render(tasks[traj.task_id], without_failed_calls(traj.messages))
        examples.append(messages)
    return examples


def native_tools(original: HCPConfig) -> list[dict] | None:
    """The tool list the chat template needs for a config's examples (None unless tools are native)."""
    return original.tools if original.tool_format == "native" else None


def _ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template."""
    text = chat_text(tokenizer, messages, tools, generation_prompt)
    # The template writes any BOS itself; letting the tokenizer add one too would double it.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation so far, through the generation prompt of the assistant's next turn."""
    return _ids(tokenizer, messages, tools, generation_prompt=True)


def _turn_end(span: list[int], end_ids: set[int]) -> int:
    """Length of an assistant span up to and including its last end-of-turn token (all of it if none)."""
    for i in range(len(span) - 1, -1, -1):
        if span[i] in end_ids:
            return i + 1
    return len(span)


def _end_ids(tokenizer: Any) -> set[int]:
    """Ids that close an assistant turn: the tokenizer's EOS (``<|im_end|>`` for ChatML templates)."""
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def tokenize_with_assistant_mask(
    messages: list[dict], tokenizer: Any, tools: list[dict] | None = None, max_length: int = 2048
) -> dict[str, list[int]]:
    """``input_ids`` and ``assistant_masks`` (1 on assistant content and its end-of-turn token) of one conversation,
    cut after its last assistant token (and at ``max_length``)."""
    full, mask = assistant_mask(messages, tokenizer, tools)
    # Keep the start: the request and the first turns are what the model must learn to answer. Nothing after the
    # last assistant token carries loss, so it is not trained on.
    end = min(max_length, max((i + 1 for i, m in enumerate(mask) if m), default=len(full)))
    return {"input_ids": full[:end], "assistant_masks": mask[:end]}


def assistant_mask(
    messages: list[dict], tokenizer: Any, tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """The token ids of a whole conversation and, per token, 1 on assistant content and its end-of-turn token."""
    full = _ids(tokenizer, messages, tools, generation_prompt=False)
    mask = [0] * len(full)
    end_ids = _end_ids(tokenizer)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        before = _ids(tokenizer, messages[:i], tools, generation_prompt=True)
        through = _ids(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if through[: len(before)] != before or full[: len(through)] != through:
            raise ValueError(
                f"the chat template is not prefix-consistent at message {i}: rendering a shorter conversation "
                "does not give a prefix of the longer one, so assistant tokens cannot be located by difference"
            )
        stop = len(before) + _turn_end(through[len(before) :], end_ids)
        mask[len(before) : stop] = [1] * (stop - len(before))
    return full, mask


def build_dataset(examples: list[list[dict]], tokenizer: Any, tools: list[dict] | None = None, max_length: int = 2048):  # noqa: ANN201 - datasets is heavy to import at module level
    """A pre-tokenised ``datasets.Dataset`` (``input_ids``, ``assistant_masks``) for TRL's SFTTrainer."""
    from datasets import Dataset

    rows = [tokenize_with_assistant_mask(m, tokenizer, tools, max_length) for m in examples]
    kept = [r for r in rows if any(r["assistant_masks"])]
    if len(kept) < len(rows):  # truncation can cut every assistant token; such rows carry no loss
        log.warning(
            "dropped %d of %d examples with no assistant token within %d tokens",
            len(rows) - len(kept),
            len(rows),
            max_length,
        )
    if not kept:
        raise ValueError("no example has an assistant token to train on")
    return Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in kept], "assistant_masks": [r["assistant_masks"] for r in kept]}
    )
