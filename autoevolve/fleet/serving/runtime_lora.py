"""Which adapter folders vLLM's runtime endpoints may load into a running server, and under which identity.

Off unless the server starts with ``--enable-runtime-lora`` (or ``AUTOEVOLVE_ALLOW_RUNTIME_LORA_UPDATING=true``, as
vLLM gates the same endpoints behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the routes do not exist. On, a folder
loads only if the registry recorded it, and then as the version the store says it is (``NAME@vN``, never what the
folder's own files claim), or if it lies under an ``--allow-adapter-root``, served under the name asked for, which may
not be a registered expert's. The path is judged before anything on disk is read, so a caller learns nothing of the
folders it may not load. At most ``max_loras`` adapters are loaded at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autoevolve.fleet.serving.wire import WireError

ENV_FLAG = "AUTOEVOLVE_ALLOW_RUNTIME_LORA_UPDATING"


def enabled_by_env() -> bool:
    """Whether the environment turns runtime loading on (``true`` or ``1``, as vLLM reads its flag)."""
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true")


Recorded = Callable[[], tuple[dict[Path, str], set[str]]]  # () -> ({resolved folder: NAME@vN}, registered experts)


@dataclass(frozen=True)
class RuntimeLoRA:
    """What the load endpoint may load (see the module docstring)."""

    recorded: Recorded = lambda: ({}, set())  # read anew on each load: a promotion registers new versions
    roots: tuple[Path, ...] = field(default=())
    max_loras: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "roots", tuple(Path(r).resolve() for r in self.roots))

    def identity(self, name: str, path: str) -> str:
        """The adapter name a load of ``path`` as ``name`` serves; WireError when it may not be loaded."""
        folder = Path(path).resolve()
        folders, experts = self.recorded()
        if folder in folders:
            ref = folders[folder]
            if name != ref and name != ref.split("@")[0]:
                raise WireError(
                    f"lora_name: the folder is {ref}'s; load it as {ref} or as its expert", param="lora_name"
                )
            return ref
        if any(folder.is_relative_to(root) for root in self.roots):
            if name.split("@")[0] in experts:
                raise WireError(
                    f"lora_name: {name} is a registered expert's name; its versions load from the folders the "
                    "registry recorded",
                    param="lora_name",
                )
            return name
        raise WireError(
            "lora_path: not a folder this server may load (one the registry recorded, or one under an "
            "--allow-adapter-root)",
            param="lora_path",
        )
