"""Promotion hooks: tell the serving fleet when the live version of a LoRA expert changes.

A hook is anything with a ``name`` and a ``fire(event)`` that raises ``HookError`` on failure. Three are built in,
chosen by ``kind`` in the config: ``vllm`` swaps the adapter on vLLM servers through their runtime LoRA endpoints
(the servers need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), ``webhook`` POSTs the event as JSON, ``command`` runs a
program with the event on stdin. ``fire_all`` retries each hook and returns the failures as data; the registry
decides what a failure means (roll the promotion back, or keep it flagged: ``registry.announce``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoevolve.fleet.registry_settings import (
    CommandHookSettings,
    HookSettings,
    VLLMHookSettings,
    WebhookHookSettings,
)

log = logging.getLogger(__name__)

TAIL = 200  # characters of a response body or stderr quoted in an error


class HookError(RuntimeError):
    """A hook failed; the message says which hook, which target, and why (one line)."""


class PromotionEvent(BaseModel):
    """The live version of an expert changed: what is live now, what was live before."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["promote", "rollback"]
    expert: str = Field(description="The expert's name in the registry, e.g. 'L1-life'.")
    served_name: str = Field(description="The LoRA name the serving fleet uses for this expert.")
    version: int | None = Field(description="The version now live; None: the bare base model serves the expert.")
    path: str | None = Field(description="Adapter folder of the live version; None when version is None.")
    previous_version: int | None = Field(description="The version live before; None: none was.")
    previous_path: str | None = Field(description="Adapter folder of the previous version.")
    base_model: str = Field(description="The base model every version of the expert was trained on.")
    eval: dict[str, Any] = Field(default={}, description="Eval summary of the live version (decision, gain, ...).")

    @model_validator(mode="after")
    def _paths_match_versions(self) -> PromotionEvent:
        """A version has a folder and no version has none."""
        for version, path, label in (
            (self.version, self.path, ""),
            (self.previous_version, self.previous_path, "previous_"),
        ):
            if (version is None) != (path is None):
                raise ValueError(f"{label}path must be set exactly when {label}version is set")
        return self

    def body(self) -> dict[str, Any]:
        """The JSON body hooks send."""
        return self.model_dump(mode="json")


class Hook(Protocol):
    """Tells one part of the fleet about a promotion.

    ``name`` says what it is and where it points (no secrets). ``fire`` returns once the target has taken the change
    and raises ``HookError`` (never another exception type) on any failure. Firing the same event twice is safe.
    """

    name: str

    def fire(self, event: PromotionEvent) -> None:
        """Deliver the event; raise HookError on failure."""
        ...


def _one_line(text: str, limit: int = TAIL, *, tail: bool = False) -> str:
    """Text on one line, cut to its first (or last) ``limit`` characters."""
    flat = " ".join(text.split())
    return flat[-limit:] if tail else flat[:limit]


def _redact(text: str, secret: str | None) -> str:
    """The text with the secret blanked out (a server may echo what it was sent)."""
    return text.replace(secret, "***") if secret else text


def _send(client: httpx.Client, method: str, url: str, step: str, timeout_s: float, body: Any = None) -> httpx.Response:
    """One request; a timeout or transport failure becomes a HookError message naming the step."""
    try:
        return client.request(method, url, json=body)
    except httpx.TimeoutException:
        raise HookError(f"{step} timed out after {timeout_s:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise HookError(f"{step} failed: {type(e).__name__}: {_one_line(str(e))}") from None


def _answered(response: httpx.Response, step: str, secret: str | None) -> str:
    """The message for a non-2xx answer, the secret blanked out before the body is cut short."""
    return f"{step} answered {response.status_code}: {_one_line(_redact(response.text, secret))}"


class VLLMHook:
    """Unload the served name, load the live version under it, and check /v1/models lists it, on every server.

    A server that already lists the served name with the live path (as its ``root``) is left alone, so a retry
    after a partial failure touches only the servers that still need it. Between unload and load the name is not
    served on that server: vLLM refuses requests for it in that gap; ``autoevolve serve`` holds them for the load.
    """

    def __init__(self, settings: VLLMHookSettings) -> None:
        """Hook for the servers in ``settings``."""
        self.settings = settings
        self.name = f"vllm {', '.join(settings.servers)}"

    def __repr__(self) -> str:
        """The hook by its settings (which hold only the key's variable name)."""
        return f"VLLMHook({self.settings!r})"

    def fire(self, event: PromotionEvent) -> None:
        """Update every server; raise one HookError naming each server that failed and at which step."""
        key = os.environ.get(self.settings.api_key_env) if self.settings.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        errors = []
        with httpx.Client(timeout=self.settings.timeout_s, headers=headers) as client:
            for server in self.settings.servers:
                try:
                    self._update(client, server, event, key)
                except HookError as e:
                    errors.append(_redact(f"vllm {server}: {e}", key))
        if errors:
            raise HookError("; ".join(errors))

    def _update(self, client: httpx.Client, server: str, event: PromotionEvent, key: str | None) -> None:
        """Bring one server to the event's state."""
        name = event.served_name
        listed = self._models(client, server, key)
        if event.path is not None and listed.get(name, {}).get("root") == event.path:
            return  # already serving the live version
        if event.previous_version is not None or name in listed:
            self._post(client, server, key, "unload_lora_adapter", {"lora_name": name}, tolerate=(400, 404))
        if event.path is not None:
            self._post(client, server, key, "load_lora_adapter", {"lora_name": name, "lora_path": event.path})
        listed = self._models(client, server, key)
        if event.path is not None and name not in listed:
            raise HookError(f"models does not list {name!r} after load_lora_adapter")
        if event.path is None and name in listed:
            raise HookError(f"models still lists {name!r} after unload_lora_adapter")

    def _post(
        self,
        client: httpx.Client,
        server: str,
        key: str | None,
        step: str,
        body: dict[str, str],
        tolerate: tuple[int, ...] = (),
    ) -> None:
        """POST to a LoRA endpoint; any answer but 2xx or a tolerated status is a failure."""
        response = _send(client, "POST", f"{server}/v1/{step}", step, self.settings.timeout_s, body)
        if not response.is_success and response.status_code not in tolerate:
            raise HookError(_answered(response, step, key))

    def _models(self, client: httpx.Client, server: str, key: str | None) -> dict[str, dict[str, Any]]:
        """The server's model cards by id (base models and loaded adapters)."""
        response = _send(client, "GET", f"{server}/v1/models", "models", self.settings.timeout_s)
        if not response.is_success:
            raise HookError(_answered(response, "models", key))
        try:
            return {card["id"]: card for card in response.json()["data"]}
        except (ValueError, KeyError, TypeError):
            raise HookError(f"models answered unexpected JSON: {_one_line(_redact(response.text, key))}") from None


class WebhookHook:
    """POST the event's JSON body to a URL, with an optional shared secret in a header."""

    def __init__(self, settings: WebhookHookSettings) -> None:
        """Hook for the URL in ``settings``; the secret is read from the environment at each fire."""
        self.settings = settings
        self.name = f"webhook {settings.url}"

    def __repr__(self) -> str:
        """The hook by its settings (which hold only the secret's variable name)."""
        return f"WebhookHook({self.settings!r})"

    def fire(self, event: PromotionEvent) -> None:
        """POST the event; raise HookError on a missing secret, a non-2xx answer, a timeout or a transport error."""
        secret = None
        if self.settings.secret_env:
            secret = os.environ.get(self.settings.secret_env)
            if not secret:
                raise HookError(f"{self.name}: environment variable {self.settings.secret_env} is not set")
        headers = {self.settings.header: secret} if secret else {}
        try:
            with httpx.Client(timeout=self.settings.timeout_s, headers=headers) as client:
                response = _send(client, "POST", self.settings.url, "POST", self.settings.timeout_s, event.body())
            if not response.is_success:
                raise HookError(_answered(response, "POST", secret))
        except HookError as e:
            raise HookError(_redact(f"{self.name}: {e}", secret)) from None


class CommandHook:
    """Run a program (no shell) with the event's JSON body on stdin."""

    def __init__(self, settings: CommandHookSettings) -> None:
        """Hook for the command in ``settings``."""
        self.settings = settings
        self.name = f"command {shlex.join(settings.command)}"

    def __repr__(self) -> str:
        """The hook by its settings."""
        return f"CommandHook({self.settings!r})"

    def fire(self, event: PromotionEvent) -> None:
        """Run the command; raise HookError on a non-zero exit, a timeout, or a program that cannot be started."""
        try:
            done = subprocess.run(
                self.settings.command,
                input=json.dumps(event.body()),
                capture_output=True,
                encoding="utf-8",
                errors="replace",  # a program's stray bytes must not turn into a UnicodeDecodeError
                timeout=self.settings.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise HookError(f"{self.name}: timed out after {self.settings.timeout_s:g} s") from None
        except OSError as e:  # missing executable, not executable, ...
            raise HookError(f"{self.name}: cannot run {self.settings.command[0]!r}: {e.strerror or e}") from None
        if done.returncode != 0:
            raise HookError(f"{self.name}: exit {done.returncode}: {_one_line(done.stderr, tail=True)}")


def make_hook(settings: HookSettings) -> Hook:
    """The hook its settings describe."""
    if isinstance(settings, VLLMHookSettings):
        return VLLMHook(settings)
    if isinstance(settings, WebhookHookSettings):
        return WebhookHook(settings)
    if isinstance(settings, CommandHookSettings):
        return CommandHook(settings)
    raise TypeError(f"unknown hook settings {type(settings).__name__}")


@dataclass
class HookFailure:
    """A hook that still failed after its retries."""

    hook: str
    error: str
    attempts: int


def fire_all(hooks: list[Hook], event: PromotionEvent, retries: int = 2, backoff_s: float = 0.5) -> list[HookFailure]:
    """Fire every hook; each is tried 1 + retries times (sleep backoff_s * attempt between tries).

    Returns the failures (empty: all succeeded). Never raises for a hook failure: a hook that breaks its contract
    by raising something other than HookError is recorded the same way, with the exception's type.
    """
    if retries < 0 or backoff_s < 0:
        raise ValueError(f"retries ({retries}) and backoff_s ({backoff_s}) must be >= 0")
    failures = []
    for hook in hooks:
        for attempt in range(1, retries + 2):
            try:
                hook.fire(event)
                break
            except Exception as e:  # a hook failure is data, whatever its type
                error = str(e) if isinstance(e, HookError) else f"{type(e).__name__}: {e}"
                log.warning("hook %s failed (attempt %d of %d): %s", hook.name, attempt, retries + 1, error)
                if attempt > retries:
                    failures.append(HookFailure(hook=hook.name, error=error, attempts=attempt))
                else:
                    time.sleep(backoff_s * attempt)
    return failures
