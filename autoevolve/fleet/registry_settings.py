"""The registry's settings (a run config's ``registry`` section): the promotion hooks that tell the serving fleet,
what happens when one fails, and who approves a promotion. Pydantic only: reading a config loads no HTTP client."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Settings(BaseModel):
    """A hook's settings: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


def _check_url(url: str) -> str:
    """Refuse a URL that is not http(s); drop a trailing slash."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return url.rstrip("/")


class VLLMHookSettings(_Settings):
    """Swap the expert's adapter on vLLM servers started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True."""

    kind: Literal["vllm"]
    servers: list[str] = Field(min_length=1, description="Base URLs of the servers, e.g. http://host:8000.")
    timeout_s: float = Field(default=10.0, gt=0, description="Seconds each HTTP request may take.")
    api_key_env: str | None = Field(
        default=None,
        description="Environment variable holding the servers' --api-key, sent as a bearer token (unset: none sent).",
    )

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: list[str]) -> list[str]:
        """Every server is an http(s) URL."""
        return [_check_url(s) for s in servers]


class WebhookHookSettings(_Settings):
    """POST the event as JSON to a URL."""

    kind: Literal["webhook"]
    url: str = Field(description="Where the event is POSTed.")
    secret_env: str | None = Field(default=None, description="Environment variable holding a shared secret.")
    header: str = Field(default="X-Autoevolve-Secret", description="Header the secret is sent in.")
    timeout_s: float = Field(default=10.0, gt=0, description="Seconds the request may take.")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        """The URL is http(s)."""
        return _check_url(url)


class CommandHookSettings(_Settings):
    """Run a program (no shell) with the event's JSON on stdin; exit 0 means delivered."""

    kind: Literal["command"]
    command: list[str] = Field(min_length=1, description="Program and arguments, e.g. ['scripts/notify.sh'].")
    timeout_s: float = Field(default=30.0, gt=0, description="Seconds the program may run.")


HookSettings = Annotated[VLLMHookSettings | WebhookHookSettings | CommandHookSettings, Field(discriminator="kind")]


class RegistrySettings(_Settings):
    """What a promotion tells the serving fleet, what happens when that fails, and who approves it."""

    hooks: list[HookSettings] = Field(
        default_factory=list, description="Fired on every change of the live version: vllm, webhook or command."
    )
    retries: int = Field(default=2, ge=0, description="Retries of a failing hook before it counts as failed.")
    on_hook_failure: Literal["rollback", "keep"] = Field(
        default="rollback", description="rollback: put the previous version back; keep: stay live, flagged."
    )
    approval: bool = Field(
        default=False,
        description="Wait for a person to approve before a promotion: a deployed flow run is suspended (its worker "
        "freed), one started by hand pauses in place (--auto-approve: skip).",
    )
    approval_timeout_s: int = Field(
        default=3600, gt=0, description="Seconds to wait for an answer; then the promotion is not made."
    )
