"""A server in a thread, adapters that answer differently, a registry to serve them from."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autoevolve.fleet.registry import add_expert, promote, register, write_harness
from autoevolve.harness.hcp import HCPConfig
from autoevolve.store import Store


@contextmanager
def running(app: object) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free local port; yields its base URL (http://127.0.0.1:PORT)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def random_adapter(model_dir: str, out: Path, seed: int, base: str) -> str:
    """A LoRA with random A and B (it changes the model's answers), saved as the registry accepts it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load
    from autoevolve.stages.distill.fit import save_adapter

    torch.manual_seed(seed)
    model, _ = load(model_dir, "float32")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    lora = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return str(save_adapter(lora, out, base))


def registered(
    store: Store,
    name: str,
    path: str,
    base: str,
    hcp: HCPConfig | None,
    live: bool = True,
    tier: int = 1,
    rule: str = "",
) -> int:
    """Register an adapter folder as the expert's next version (with its harness), promoted when ``live``."""
    add_expert(store, name, base, tier, rule)
    if hcp is not None:
        write_harness(path, hcp)
    record = register(
        store,
        name=name,
        path=path,
        base_model=base,
        parent_version=None,
        run_id="r",
        round=0,
        hcp_id=hcp.id if hcp else "h",
        evolved_hcp_id="h",
        selection_id="s",
    )
    if live:
        promote(store, name, record.version)
    return record.version
