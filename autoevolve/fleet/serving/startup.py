"""Starting a server from a registry: ``open_fleet`` reads the registry once at startup, every registered version
whose folder is there loaded under ``NAME@vN``, each expert's live version under its name, with the harness each was
trained under. Later changes arrive as vLLM's runtime LoRA calls, which the registry's ``vllm`` promotion hook makes.
``recorder`` stores each served conversation in a store of the server's own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from autoevolve.fleet.serving.fleet import Fleet
from autoevolve.harness.hcp import HCPConfig
from autoevolve.model import base_model_id
from autoevolve.policy.local import LocalPolicy
from autoevolve.records import Trajectory
from autoevolve.store import Store


def open_fleet(
    store_path: str | Path | None,
    policy: LocalPolicy,
    *,
    entry: str | None = None,
    harnesses: dict[str, HCPConfig] | None = None,
    record: Callable[[Trajectory], None] | None = None,
    say: Callable[[str], None] = print,
) -> Fleet:
    """A fleet over a registry: each version and each expert's live one, with their harnesses (the adapter
    folder's ``hcp.json``, else the store's copy of the config it trained under, else ``harnesses[expert]``).
    ``entry``: the router's entry expert (default: the registry's tier-0 expert, when there is one). With no store,
    the base model alone."""
    harnesses = dict(harnesses or {})
    experts, versions, stored = [], {}, {}
    if store_path is not None:
        with Store.snapshot(store_path) as store:
            experts = store.experts()
            versions = {e.name: store.adapters(e.name) for e in experts}
            stored = {a.hcp_id: _stored(store, a.hcp_id) for vs in versions.values() for a in vs}
    tier0 = [e.name for e in experts if e.tier == 0]
    fleet = Fleet(
        policy,
        base_model_id(policy.model_name),
        experts=experts,
        entry=entry or (tier0[0] if len(tier0) == 1 else None),
        harnesses=harnesses,
        recorder=record,
    )
    for e in experts:
        for a in versions[e.name]:
            if not (Path(a.path) / "adapter_config.json").is_file():
                say(f"  {a.ref}: not served, its folder {a.path} is gone")
                continue
            slot = fleet.load(a.ref, a.path, hcp=stored.get(a.hcp_id))
            if e.live_version == a.version:
                fleet.load(e.name, a.path, hcp=stored.get(a.hcp_id), ref=a.ref)
            say(f"  {slot.name}: {a.status}{'' if slot.hcp else ' (no harness on record: served as sent)'}")
        if e.live_version is None and e.name in harnesses:
            fleet.serve_base_as(e.name, harnesses[e.name])
            say(f"  {e.name}: no live version, the base model under {harnesses[e.name].name}")
    return fleet


def recorded_folders(store_path: str | Path | None) -> Callable[[], tuple[dict[Path, str], set[str]]]:
    """What the registry recorded, read anew at each call (a promotion registers new versions): each adapter
    folder (resolved) with its ``NAME@vN``, and the experts' names (none without a store)."""

    def read() -> tuple[dict[Path, str], set[str]]:
        if store_path is None:
            return {}, set()
        with Store.snapshot(store_path) as store:
            experts = store.experts()
            folders = {Path(a.path).resolve(): a.ref for e in experts for a in store.adapters(e.name)}
        return folders, {e.name for e in experts}

    return read


def _stored(store: Store, hcp_id: str) -> HCPConfig | None:
    """The stored config of an id (None when it is not stored or no longer reads)."""
    try:
        return HCPConfig.model_validate(store.get_hcp(hcp_id))
    except (KeyError, ValueError):
        return None


def recorder(store_path: str | Path) -> Callable[[Trajectory], None]:
    """Write each served conversation to a store of its own (run 'serve'): the loop may hold the registry's."""
    store, lock = Store(store_path), threading.Lock()

    def write(trajectory: Trajectory) -> None:
        with lock:
            store.put_trajectories([trajectory])

    return write
