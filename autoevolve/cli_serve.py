"""The ``autoevolve serve`` command: its arguments, the checks on them, and the server it starts (``run_server``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from autoevolve.cli_common import DEFAULT_STORE, CommandError, positive, refusing, store_file

if TYPE_CHECKING:
    from autoevolve.fleet.serving.fleet import Fleet
    from autoevolve.policy.local import LocalPolicy

HELP = (
    "Serve the base model and every registered LoRA version on one copy of the weights, each under the HCP config "
    "it was trained under: /v1/chat/completions (streaming, tools, tool_choice), /v1/models (each expert, each "
    "version as NAME@vN, the base, the router), and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, so a "
    "registry hook of kind vllm pointed here swaps versions without a restart. Model 'router' (or the entry "
    "expert's name) serves the Mixture of LoRA. A request that opens with a system message is served as sent."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` command."""
    srv = sub.add_parser("serve", help="serve the registry's experts over an OpenAI-compatible API", description=HELP)
    srv.add_argument(
        "--store",
        help=f"the store with the registry: a DuckDB file or postgresql://... (default {DEFAULT_STORE}; with "
        "--model and no --store: that model alone)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--model", help="base model (default: the experts' base model; without --store, served alone)")
    srv.add_argument("--entry", help="the router's entry expert (default: the registry's tier-0 expert)")
    srv.add_argument(
        "--hcp",
        action="append",
        default=[],
        metavar="EXPERT=FILE",
        help="an expert's harness where its versions carry none, or for an expert with no live version",
    )
    srv.add_argument("--record", help="DuckDB file to store each served conversation in (run 'serve')")
    srv.add_argument("--api-key-env", help="environment variable holding the key clients must send as a bearer token")
    srv.add_argument(
        "--enable-runtime-lora",
        action="store_true",
        help="offer vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (also: "
        "AUTOEVOLVE_ALLOW_RUNTIME_LORA_UPDATING=true); they load "
        "only folders the registry recorded, or under --allow-adapter-root",
    )
    srv.add_argument(
        "--allow-adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="with runtime loading: adapter folders under DIR may be loaded too, under the name asked for",
    )
    srv.add_argument("--max-loras", type=positive, default=16, help="most adapters loaded at runtime (default 16)")
    srv.add_argument(
        "--insecure", action="store_true", help="listen on a non-loopback --host without --api-key-env (refused else)"
    )
    srv.add_argument(
        "--batch-size", type=int, default=16, help="most requests decoding in one batch, any adapters (default 16)"
    )
    srv.add_argument(
        "--fp32-weights",
        action="store_true",
        help="decode steps of a few rows read the fp32 weights; by default, on a CPU, they read compact copies: the "
        "4-bit codes of weights that are 4-bit (a Q4 GGUF's layers), else bf16 for one row (bench/decode_step.py)",
    )
    srv.add_argument(
        "--eager",
        action="store_true",
        help="compile nothing: by default the decode step of a lone request is compiled before the server listens "
        "(torch.compile; SmolLM2-135M on 2 cores: about 80 s the first time on a machine, seconds after), for the "
        "base and each adapter shape loaded at start; adapters loaded later of a shape compiled use it too",
    )
    srv.add_argument(
        "--switch",
        choices=["own", "shared", "shared_kv"],
        default="own",
        help="how the expert the router chose takes the turn over: its own harness (default), the entry's context, "
        "or the entry's context from the entry's keys and values (bench/router_kv.py)",
    )


def serve(args: argparse.Namespace) -> int:
    """Load the registry's adapters and serve them until interrupted (imported here: only this command needs them)."""
    import torch

    from autoevolve.fleet.serving.app import run_server
    from autoevolve.fleet.serving.runtime_lora import RuntimeLoRA, enabled_by_env
    from autoevolve.fleet.serving.startup import open_fleet, recorded_folders, recorder
    from autoevolve.harness.hcp import HCPConfig
    from autoevolve.model import EMBEDDED, base_model_id
    from autoevolve.policy.local import LocalPolicy
    from autoevolve.store import Store, StoreError

    store = args.store or (None if args.model else DEFAULT_STORE)  # --model alone: that model, no registry
    if store is not None:
        store_file(store, "; or --model NAME without --store to serve a model alone")
    harnesses = {}
    for item in args.hcp:
        name, _, file = item.partition("=")
        try:
            harnesses[name] = HCPConfig.from_yaml(file)
        except (OSError, ValueError) as exc:
            raise CommandError(f"--hcp {item}: {exc} (write EXPERT=FILE, e.g. L1-life=prompts/life.yaml)") from None
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not key:
        raise CommandError(f"--api-key-env {args.api_key_env}: that variable is not set")
    if not key and not args.insecure and not _loopback(args.host):
        raise CommandError(
            f"--host {args.host}: anyone who reaches it could use every expert; set --api-key-env, or pass --insecure"
        )
    runtime = None
    if args.enable_runtime_lora or enabled_by_env():
        runtime = RuntimeLoRA(recorded_folders(store), tuple(map(Path, args.allow_adapter_root)), args.max_loras)
    elif args.allow_adapter_root:
        raise CommandError("--allow-adapter-root: runtime loading is off; add --enable-runtime-lora")
    bases = set()
    if store is not None:
        with refusing(StoreError), Store.snapshot(store) as registry:
            bases = {e.base_model for e in registry.experts()}
    model = args.model or (bases.pop() if len(bases) == 1 else EMBEDDED)
    if model == base_model_id(EMBEDDED):
        model = EMBEDDED  # the embedded copy of that model: no hub needed
    print(f"autoevolve serve: loading {model}" + (f" and the registry of {store}" if store else ", no registry"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # startup computes on this thread alone; the fleet's worker then takes them all (_warm)
    policy = LocalPolicy(
        model,
        batch_size=args.batch_size,
        dtype="float32" if args.fp32_weights else "auto",  # "auto" with compact copies: fp32 on a CPU too
        compact_weights=not args.fp32_weights,
        compiled_steps=not args.eager,
    )
    fleet = open_fleet(
        store, policy, entry=args.entry, harnesses=harnesses, record=recorder(args.record) if args.record else None
    )
    _warm(policy, fleet, threads)
    fleet.switch = args.switch
    print(f"serving {', '.join(c['id'] for c in fleet.cards())} on http://{args.host}:{args.port}/v1")
    if runtime is not None:
        print(f"runtime LoRA loading on: registered folders{', and under ' if runtime.roots else ''}"
              f"{', '.join(map(str, runtime.roots))} (at most {runtime.max_loras} adapters)")  # fmt: skip
    run_server(fleet, args.host, args.port, key, runtime)
    return 0


def _warm(policy: LocalPolicy, fleet: Fleet, threads: int) -> None:
    """Give the fleet's worker ``threads`` compute threads (the thread that decodes is the only one that computes:
    see ``autoevolve.fleet.serving.worker``) and compile the one-row decode step there before the server listens;
    where that fails, say why and decode eagerly."""
    import torch

    fleet.on_worker(lambda: torch.set_num_threads(threads))
    if policy.decoder is None or policy.decoder.streams is None:
        return
    print("compiling the one-row decode step for the base and each adapter shape (a minute or more the first time "
          "on a machine; --eager skips it)", flush=True)  # fmt: skip
    try:
        print(f"  compiled in {fleet.on_worker(policy.warm_steps):.0f} s", flush=True)
    except Exception as exc:  # noqa: BLE001 - no C++ compiler, an operation inductor lacks: serve eagerly
        policy.decoder.streams = None
        print(f"  not compiled ({type(exc).__name__}: {str(exc)[:200]}); lone requests decode eagerly", flush=True)


def _loopback(host: str) -> bool:
    """Whether a listening address is only reachable from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
