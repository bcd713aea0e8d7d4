"""Policies: chat completion with tools for a batch of requests, with the LoRA adapter chosen by name.

The protocol and its records are in ``protocol``; ``local`` (transformers + PEFT) and ``openai`` (any
OpenAI-compatible server) implement it.
"""

from autoevolve.policy.protocol import CallConstraint, ChatRequest, Completion, Policy

__all__ = ["CallConstraint", "ChatRequest", "Completion", "Policy"]
