"""``GET /metrics``: what the server did, in Prometheus' text format, named as vLLM names its own (``autoevolve:``
for ``vllm:``), so a dashboard made for one reads the other.

Per served name (``model_name``): requests by how they ended (``finished_reason``: stop, length, tool_calls,
abort for a client that left, error), prompt and generated tokens, and histograms of the time to the first token
and of the whole request; for the server, the requests waiting or running, and adapter loads and unloads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    """The server's counters, each in a registry of its own (two servers in one process do not mix)."""

    def __init__(self, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        named = ["model_name"]
        self.requests = Counter(
            "autoevolve:request_success", "Requests answered, by how they ended.", [*named, "finished_reason"],
            registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter("autoevolve:prompt_tokens", "Prompt tokens.", named, registry=self.registry)
        self.generation_tokens = Counter(
            "autoevolve:generation_tokens", "Generated tokens.", named, registry=self.registry
        )
        self.ttft = Histogram(
            "autoevolve:time_to_first_token_seconds", "From a request's arrival to its first generated token.",
            named, buckets=SECONDS, registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "autoevolve:e2e_request_latency_seconds", "From a request's arrival to its last byte of reply.",
            named, buckets=SECONDS, registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge("autoevolve:num_requests", "Requests waiting or running.", registry=self.registry)
        self.in_flight.set_function(in_flight)
        self.loads = Counter("autoevolve:lora_loads", "Adapters loaded at runtime.", registry=self.registry)
        self.unloads = Counter("autoevolve:lora_unloads", "Adapters unloaded at runtime.", registry=self.registry)

    def finished(
        self, model: str, reason: str, started: float, first_token: float | None, prompt: int = 0, generated: int = 0
    ) -> None:
        """A request ended (``started`` and ``first_token`` on ``time.monotonic``'s clock)."""
        self.requests.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(prompt)
        self.generation_tokens.labels(model).inc(generated)
        if first_token is not None:
            self.ttft.labels(model).observe(first_token - started)
        self.latency.labels(model).observe(time.monotonic() - started)

    def text(self) -> bytes:
        """The exposition."""
        return generate_latest(self.registry)
