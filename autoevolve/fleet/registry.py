"""The adapter registry: the LoRA experts, the versions of each with their lineage, and which one is live.

At most one version per expert is live (none: the bare base model serves it). Promotion and rollback move the
live version in one store transaction; registering an expert is a metadata change only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from autoevolve.fleet.hooks import Hook, HookFailure, PromotionEvent, fire_all, make_hook
from autoevolve.fleet.registry_settings import RegistrySettings
from autoevolve.harness.hcp import HCPConfig
from autoevolve.records import AdapterRecord, EvalReport, Expert, RegistryEvent, check_name
from autoevolve.store import Store
from autoevolve.views.table import text_table

VERSION_FILE = "version.json"  # for a person reading an adapter folder: its registered name and version
HARNESS_FILE = "hcp.json"  # the HCP config the adapter was trained under, written by distillation


class PromotionRolledBack(RuntimeError):
    """A hook failed after the live version moved, so the previous version was put back."""


@dataclass
class Publisher:
    """The promotion hooks and what to do when one fails after its retries."""

    hooks: list[Hook] = field(default_factory=list)
    retries: int = 2
    on_failure: Literal["rollback", "keep"] = "rollback"
    backoff_s: float = 0.5

    @classmethod
    def from_settings(cls, s: RegistrySettings) -> Publisher:
        """From a run config's ``registry`` section."""
        return cls([make_hook(h) for h in s.hooks], s.retries, s.on_hook_failure)


def adapter_dir(root: str | Path, name: str, version: int) -> Path:
    """Folder of an expert's version under an adapter directory, e.g. root/L1-life-v3 (never outside root)."""
    root = Path(root).resolve()
    path = (root / f"{check_name(name)}-v{version}").resolve()
    if root not in path.parents:
        raise ValueError(f"adapter folder {path} would escape the adapter directory {root}")
    return path


def add_expert(store: Store, name: str, base_model: str, tier: int = 1, routing_rule: str = "") -> Expert:
    """Register an expert (or update its tier and routing rule); its live version is left as it is."""
    expert = Expert(name=check_name(name), tier=tier, routing_rule=routing_rule, base_model=base_model)
    try:
        known = store.expert(name)
    except KeyError:
        known = None
    if known is not None and known.base_model != base_model:
        raise ValueError(
            f"expert {name} is built on {known.base_model!r}, not {base_model!r}: a base model cannot change under "
            "an expert's versions; register a new expert instead"
        )
    store.put_expert(expert)
    return store.expert(name)


def register(
    store: Store,
    *,
    name: str,
    path: str | Path,
    base_model: str,
    parent_version: int | None,
    run_id: str,
    round: int,
    hcp_id: str,
    evolved_hcp_id: str,
    selection_id: str,
) -> AdapterRecord:
    """Record a freshly trained adapter as the expert's next version, status 'candidate' (the expert made if new)."""
    try:
        expert = store.expert(name)
    except KeyError:
        expert = add_expert(store, name, base_model)
    if expert.base_model != base_model:
        raise ValueError(f"adapter {path} is for {base_model!r}, but expert {name} is built on {expert.base_model!r}")
    check_adapter_folder(Path(path), base_model)
    record = AdapterRecord(
        name=name,
        version=store.next_adapter_version(name),
        tier=expert.tier,
        routing_rule=expert.routing_rule,
        base_model=base_model,
        path=str(path),
        parent_version=parent_version,
        run_id=run_id,
        round=round,
        hcp_id=hcp_id,
        evolved_hcp_id=evolved_hcp_id,
        selection_id=selection_id,
    )
    store.put_adapter(record)
    (Path(path) / VERSION_FILE).write_text(json.dumps({"expert": name, "version": record.version}) + "\n")
    return record


def write_harness(path: str | Path, hcp: HCPConfig) -> Path:
    """Keep beside an adapter's weights the HCP config its training rendered under: the harness it is served with."""
    out = Path(path) / HARNESS_FILE
    out.write_text(hcp.model_dump_json(indent=2) + "\n")
    return out


def folder_harness(path: str | Path) -> HCPConfig | None:
    """The HCP config an adapter folder was trained under (None when the folder does not say)."""
    file = Path(path) / HARNESS_FILE
    return HCPConfig.model_validate_json(file.read_text()) if file.is_file() else None


def decide(
    store: Store, record: AdapterRecord, report: EvalReport, publisher: Publisher | None = None
) -> AdapterRecord:
    """Apply the gate's decision: promote (retiring the live version) or reject, with the reason and eval.

    A promotion whose hooks fail and are rolled back comes back with status 'retired' and the failure as reason.
    """
    summary = {
        "decision": report.decision,
        "reason": report.reason,
        "cells": {k: c.mean for k, c in report.cells.items()},
        "gain": report.gain,
        "gain_ci": list(report.gain_ci),
        "p_value": report.p_value,
        "retention": report.retention,
        "guard": report.guard.model_dump() if report.guard else None,
    }
    if report.decision != "promote":
        rejected = record.model_copy(update={"status": "rejected", "reason": report.reason, "eval": summary})
        store.put_adapter(rejected)
        return rejected
    store.put_adapter(record.model_copy(update={"eval": summary}))
    try:
        return promote(store, record.name, record.version, report.reason, publisher)
    except PromotionRolledBack:
        return store.adapter(record.name, record.version)


def promote(
    store: Store, name: str, version: int, reason: str = "promoted by hand", publisher: Publisher | None = None
) -> AdapterRecord:
    """Make a registered version the expert's live one and tell the fleet (any status: a rejected one can be forced).

    Raises PromotionRolledBack when a hook fails and the publisher rolls back; the store then holds the failure.
    """
    adapter = store.adapter(name, version)
    check_adapter_folder(Path(adapter.path), store.expert(name).base_model)  # still there, still safetensors
    previous = store.set_live(name, version, "promote", detail=reason)
    announce(store, name, "promote", previous, publisher)
    return store.adapter(name, version)


def rollback(
    store: Store, name: str, reason: str = "rolled back by hand", publisher: Publisher | None = None
) -> AdapterRecord | None:
    """Put back the version that was live when the current one was promoted (None: the bare base); returns it."""
    live, target = store.roll_back(name, detail=reason)
    announce(store, name, "rollback", live, publisher)
    return store.adapter(name, target) if target is not None else None


def announce(
    store: Store, name: str, action: Literal["promote", "rollback"], previous: int | None, publisher: Publisher | None
) -> list[HookFailure]:
    """Fire the hooks for a change of the live version; on failure, record it and roll back or keep, as configured."""
    if publisher is None or not publisher.hooks:
        return []
    failures = fire_all(publisher.hooks, _event(store, name, action, previous), publisher.retries, publisher.backoff_s)
    if not failures:
        return []
    live = store.expert(name).live_version
    detail = "; ".join(f"{f.hook} failed after {f.attempts} attempt(s): {f.error}" for f in failures)
    undo = action == "promote" and publisher.on_failure == "rollback"
    outcome = f"v{live} rolled back" if undo else f"{action} stands, flagged"
    store.put_event(
        RegistryEvent(
            expert=name, action="hook_failed", version=live, previous_version=previous, detail=f"{outcome}: {detail}"
        )
    )
    if undo:
        store.set_live(name, previous, "rollback", detail=f"promotion hook failed: {detail}")
        failed = store.adapter(name, live)  # type: ignore[arg-type]
        store.put_adapter(failed.model_copy(update={"reason": f"promotion rolled back, a hook failed: {detail}"}))
        announce(
            store, name, "rollback", live, Publisher(publisher.hooks, publisher.retries, "keep", publisher.backoff_s)
        )
        raise PromotionRolledBack(f"{name}@v{live}: promotion rolled back: {detail}")
    return failures


def _event(store: Store, name: str, action: Literal["promote", "rollback"], previous: int | None) -> PromotionEvent:
    """The event hooks get: the expert's live version now and the one before."""
    expert = store.expert(name)
    live = store.promoted_adapter(name)
    before = store.adapter(name, previous) if previous is not None else None
    return PromotionEvent(
        action=action,
        expert=name,
        served_name=name,
        version=live.version if live else None,
        path=live.path if live else None,
        previous_version=previous,
        previous_path=before.path if before else None,
        base_model=expert.base_model,
        eval=live.eval if live else {},
    )


def check_adapter_folder(path: Path, base_model: str) -> None:
    """Refuse an adapter folder that is incomplete, not safetensors, or made for another base model."""
    config = path / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"adapter {path}: adapter_config.json is missing")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"adapter {path}: adapter_model.safetensors is missing (pickled weights are not loaded)")
    try:
        body = json.loads(config.read_text())
    except ValueError:
        raise ValueError(f"adapter {path}: adapter_config.json is not JSON") from None
    declared = body.get("base_model_name_or_path") if isinstance(body, dict) else None
    if declared != base_model:
        raise ValueError(f"adapter {path}: base_model_name_or_path is {declared!r}, expected {base_model!r}")
    if body.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path}: peft_type is {body['peft_type']!r}; only LORA adapters are loaded")
    for key, allowed in SAFE_LORA_FIELDS.items():
        if key in body and body[key] not in allowed:
            raise ValueError(f"adapter {path}: {key} is {body[key]!r}, not one of {sorted(map(str, allowed))}")


# Adapter-config values that load a LoRA without touching the base weights. PiSSA, OLoRA, CorDA, LoftQ or EVA
# initialisation (init_lora_weights) rewrites base weights from the adapter, and layer replication reshapes the
# base model: a served base is shared by every adapter, so such folders are refused.
SAFE_LORA_FIELDS: dict[str, tuple[object, ...]] = {
    "init_lora_weights": (True, False, "gaussian"),
    "layer_replication": (None,),
}


def format_experts(store: Store) -> str:
    """One line per expert: tier, live version, versions, base model, routing rule."""
    rows = [
        [e.name, str(e.tier), f"v{e.live_version}" if e.live_version is not None else "base",
         str(len(store.adapters(e.name))), e.base_model, e.routing_rule or "-"]
        for e in store.experts()
    ]  # fmt: skip
    if not rows:
        return "no experts registered (add one: autoevolve registry add-expert NAME --base-model MODEL)"
    return text_table(["expert", "tier", "live", "versions", "base model", "routing rule"], rows, right=(1, 2, 3))


def format_expert(store: Store, name: str) -> str:
    """An expert's versions (status, parent, run and round, dev gain, reason) and its history of live versions."""
    e = store.expert(name)
    live = f"v{e.live_version}" if e.live_version is not None else "the bare base model"
    lines = [
        f"{e.name} (tier {e.tier}, base {e.base_model}): live {live}",
        f"routing rule: {e.routing_rule or '-'}",
        "",
    ]
    created = store.adapter_created(name)
    rows = [
        [f"v{a.version}", a.status, f"v{a.parent_version}" if a.parent_version else "-",
         f"{created[a.version]:%Y-%m-%d %H:%M}", a.run_id or "-", str(a.round),
         "-" if a.eval.get("gain") is None else f"{a.eval['gain']:+.3f}", a.reason[:90]]
        for a in store.adapters(name)
    ]  # fmt: skip
    head = ["version", "status", "parent", "registered", "run", "round", "dev gain", "reason"]
    lines.append(text_table(head, rows, right=(5, 6)))
    events = store.events(name)
    if events:
        lines += ["", "history:"]
        history = [
            [f"{ev.at:%Y-%m-%d %H:%M:%S}" if ev.at else "", ev.action,
             f"{'base' if ev.previous_version is None else f'v{ev.previous_version}'} -> "
             f"{'base' if ev.version is None else f'v{ev.version}'}", ev.detail[:100]]
            for ev in events
        ]  # fmt: skip
        lines += ["  " + line for line in text_table(None, history).splitlines()]
    return "\n".join(lines)
