"""Four experts evolving at once on one machine, run the way "Running at scale" in the README runs them.

The four shipped run configs (life tier 1, BFCL, and the shop and units examples), each as it ships but for where
it runs: one PostgreSQL store for all four (a temporary cluster, ``LocalServer``), distillation on a training pool
limited to one job at a time (a process pool standing in for the GPU one), and a ``vllm`` promotion hook pointed at
an ``autoevolve serve`` started on the empty registry. Then, with the commands a user types: ``prefect server
start``, ``prefect work-pool create`` (twice), ``autoevolve deploy fleet.yaml``, ``prefect worker start`` on each
pool, and one run of each expert's ``autoevolve-evolution/<run>`` deployment, all four at once.

While they run, a client asks the server the base model and every expert by name in turn, one short request every
few seconds, and records each answer's status, latency and the version that served it. The cores are shared out
among the loops and the server (one math thread each on 2 cores): threads fighting for cores slow every one of
them. At the end, per expert: the flow run's state and minutes, the seconds of each stage, the gate's decision
with its reason, the test score of the live and the new adapter under the original config, and when the server
first answered with the new version; the serving client's requests, errors and latency; the training pool's jobs
and the most that overlapped.

Checks: every flow run completed; every expert promoted, or rejected by its gate with the reason; the server
answered every request; every promoted version was served by the running server (no restart); at most
``training_limit`` distillations at once.

Run: HF_HUB_OFFLINE=1 .venv/bin/python bench/fleet_run.py [--model NAME_OR_PATH] [--timeout-min 240]
(about an hour on 2 CPU cores with SmolLM2-135M; writes bench/results/fleet_run.json)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _shared import write_json  # noqa: E402

CONFIGS = ("configs/quickstart.yaml", "configs/bfcl.yaml", "examples/shop/run.yaml", "examples/units/run.yaml")
CPU, GPU = "fleet-cpu", "fleet-gpu"
TRAINING_LIMIT = 1  # distillations at once on the training pool
RESULTS = ROOT / "bench" / "results" / "fleet_run.json"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A background process in its own session (stopped with its children), its output in ``log``."""
    out = log.open("ab")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for(url: str, proc: subprocess.Popen, what: str, log: Path, timeout_s: float) -> None:
    """Until ``url`` answers 200 (the process exiting or the timeout: SystemExit naming its log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    sys.exit(f"{what} did not answer {url} within {timeout_s:.0f} s; see {log}")


def run_config(source: str, folder: Path, store: str, server: str, model: str | None) -> tuple[str, Path, str]:
    """One expert's config as it ships, but for the store, the training pool and the promotion hook: its run id, the
    file written and the expert's name."""
    from autoevolve.config import load_config

    config = load_config(source)
    raw = config.model_dump(mode="json", exclude_unset=True)
    raw["hcp"] = str((ROOT / raw["hcp"]).resolve())
    raw |= {
        "store": store,
        "run_dir": str(folder / "runs"),
        "registry": {"hooks": [{"kind": "vllm", "servers": [server], "timeout_s": 300}]},
        "deploy": {
            "cpu_pool": CPU, "gpu_pool": GPU, "remote_timeout_s": 14_400,
            "gpu_job_variables": {"image": None, "volumes": None, "image_pull_policy": None,
                                  "container_create_kwargs": None},  # a process pool: no Docker keys
        },
    }  # fmt: skip
    raw["distill"] = raw.get("distill", {}) | {"deployment": "autoevolve-distill/gpu"}
    if model:
        raw["model"] = raw.get("model", {}) | {"name": model}
    path = folder / f"{config.run_id}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(config.run_id), path, config.expert


class Client(threading.Thread):
    """Asks the server the base model and each expert it lists (of ``experts``) in turn, one short chat every
    ``pause_s``, until stopped."""

    def __init__(self, url: str, base: str, experts: list[str], pause_s: float = 3.0) -> None:
        super().__init__(daemon=True)
        self.url, self.base, self.experts, self.pause_s = url, base, experts, pause_s
        self.answers: list[dict[str, Any]] = []
        self.done = threading.Event()

    def listed(self) -> list[str]:
        try:
            served = {m["id"] for m in httpx.get(f"{self.url}/v1/models", timeout=300).json()["data"]}
        except (httpx.HTTPError, ValueError):
            served = set()
        return [self.base] + [e for e in self.experts if e in served]

    def run(self) -> None:
        began = time.monotonic()
        while not self.done.is_set():
            for model in self.listed():
                ask = {"model": model, "messages": [{"role": "user", "content": "Hi! Who are you?"}], "max_tokens": 8}
                started = time.monotonic()
                try:
                    reply = httpx.post(f"{self.url}/v1/chat/completions", json=ask, timeout=300)
                    status, served = reply.status_code, reply.json().get("model", "")
                except (httpx.HTTPError, ValueError) as exc:
                    status, served = 0, type(exc).__name__
                latency = time.monotonic() - started
                self.answers.append(
                    {"at_s": started - began, "model": model, "status": status, "served": served, "s": latency}
                )
                if self.done.wait(self.pause_s):
                    return


def overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one time."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def expert_rows(store_url: str, runs: dict[str, Any], client: Client) -> list[dict[str, Any]]:
    """Per expert (``runs``: run id -> (expert, flow run)): its flow run, stage seconds, gate decision, test cells,
    and when its new version was served."""
    from autoevolve.store import Store

    rows = []
    with Store.snapshot(store_url) as store:
        for run_id, (expert, flow_run) in runs.items():
            adapters = store.adapters(expert)
            found = {
                s: store.stage_result(run_id, 0, s) for s in ("plan", "evolve", "select", "distill", "gate", "report")
            }
            seconds = {s: round(f[1], 1) if f else None for s, f in found.items()}
            report = found["report"]
            cells = {k: c["mean"] for k, c in (report[0] if report else {}).get("cells", {}).items()}
            refs = [a.ref for a in adapters if a.status in ("live", "promoted")]
            seen = [a["at_s"] for a in client.answers if a["status"] == 200 and a["served"] in refs]
            end = flow_run.end_time or flow_run.start_time
            rows.append({
                "expert": expert, "run_id": run_id, "state": flow_run.state.type.value,
                "minutes": round((end - flow_run.start_time).total_seconds() / 60, 1) if flow_run.start_time else None,
                "stage_s": seconds, "versions": [{"ref": a.ref, "status": a.status, "reason": a.reason}
                                                  for a in adapters],
                "live_original": cells.get("live_original"), "new_original": cells.get("new_original"),
                "served": refs, "first_served_s": round(min(seen), 1) if seen else None,
            })  # fmt: skip
    return rows


def checks(rows: list[dict[str, Any]], client: Client, most: int, limit: int) -> list[str]:
    done = sum(r["state"] == "COMPLETED" for r in rows)
    decided = all(r["versions"] and all(v["reason"] for v in r["versions"]) for r in rows)
    promoted = sum(bool(r["served"]) for r in rows)
    ok = [a for a in client.answers if a["status"] == 200]
    served = all(r["first_served_s"] is not None for r in rows if r["served"])

    def line(text: str, passed: bool) -> str:
        return f"{text}: {'PASS' if passed else 'FAIL'}"

    return [
        line(f"{done} of {len(rows)} flow runs completed", done == len(rows)),
        line(f"every expert promoted ({promoted}) or rejected by its gate with the reason", decided),
        line(f"the server answered {len(ok)} of {len(client.answers)} requests", len(ok) == len(client.answers) > 0),
        line("every promoted version served by the running server, no restart", served),
        line(f"at most {most} distillations at once (limit {limit})", most <= limit),
    ]


def table(rows: list[dict[str, Any]], client: Client) -> list[str]:
    def score(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = [f"{'expert':<10} {'state':<10} {'min':>5} {'live':>6} {'new':>6}  decision (first served at s)"]
    for r in rows:
        last = r["versions"][-1] if r["versions"] else {"ref": "no version", "status": "trained", "reason": "none"}
        served = f" (served at {r['first_served_s']} s)" if r["first_served_s"] is not None else ""
        lines.append(
            f"{r['expert']:<10} {r['state']:<10} {r['minutes'] or 0:>5} {score(r['live_original']):>6} "
            f"{score(r['new_original']):>6}  {last['ref']} {last['status']}: {last['reason']}{served}"
        )
        lines.append(f"{'':<10} stage seconds: {r['stage_s']}")
    latencies = sorted(a["s"] for a in client.answers if a["status"] == 200)
    if latencies:
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        lines.append(
            f"serving while they ran: {len(client.answers)} requests, {len(client.answers) - len(latencies)} errors, "
            f"latency p50 {statistics.median(latencies):.2f} s, p99 {p99:.2f} s"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help="run configs (default: the four)")
    parser.add_argument("--model", help="base model for every expert (default: each config's own)")
    parser.add_argument("--timeout-min", type=float, default=240)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.chdir(ROOT)
    folder = Path(tempfile.mkdtemp(prefix="fleet-run-"))
    print(f"logs and run folders under {folder}", flush=True)
    prefect_port, serve_port = free_port(), free_port()
    api, url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{serve_port}"
    threads = str(max(1, (os.cpu_count() or 1) // (len(args.configs) + 1)))  # the loops and the server share the cores
    env = os.environ | {
        "PREFECT_HOME": str(folder / "prefect"), "PREFECT_API_URL": api, "AUTOEVOLVE_HOME": str(ROOT),
        "PREFECT_WORKER_QUERY_SECONDS": "2", "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
    }  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the servers and workers are stopped too
    os.environ.update(env)  # this process's Prefect client talks to the same server
    from autoevolve.store import Store
    from autoevolve.store.postgres import LocalServer

    postgres, procs = LocalServer(), []
    try:
        Store(postgres.url).close()
        log = folder / "prefect-server.log"
        procs.append(start([str(BIN / "prefect"), "server", "start", "--port", str(prefect_port)], log, env))
        wait_for(f"{api}/health", procs[-1], "prefect server", log, 600)
        for pool in (CPU, GPU):
            command = [str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process"]
            subprocess.run(command, env=env, check=True, capture_output=True)
        log = folder / "serve.log"
        serve = [str(BIN / "autoevolve"), "serve", "--store", postgres.url, "--port", str(serve_port)]
        serve += ["--enable-runtime-lora"] + (["--model", args.model] if args.model else [])
        procs.append(start(serve, log, env))
        wait_for(f"{url}/v1/models", procs[-1], "autoevolve serve", log, 900)

        made = [run_config(c, folder, postgres.url, url, args.model) for c in args.configs]
        fleet = {"training_limit": TRAINING_LIMIT, "experts": [{"config": str(path)} for _, path, _ in made]}
        (folder / "fleet.yaml").write_text(yaml.safe_dump(fleet))
        subprocess.run([str(BIN / "autoevolve"), "deploy", str(folder / "fleet.yaml")], env=env, check=True)
        log = folder / "workers.log"
        for pool in (CPU, GPU):
            procs.append(
                start([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"], log, env)
            )
        experts = {run_id: expert for run_id, _, expert in made}
        result = watch(experts, postgres.url, url, args.timeout_min, folder)
    finally:
        stop(procs)
        postgres.stop()
    print("\n".join(["", *result["table"], "", *result["checks"]]))
    write_json(args.json, {k: v for k, v in result.items() if k != "table"})


def watch(experts: dict[str, str], store: str, url: str, timeout_min: float, folder: Path) -> dict[str, Any]:
    """Start every expert's run (``experts``: run id -> expert), serve-test while they run, and gather what they
    did."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.deployments import run_deployment

    base = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]  # the registry is empty: the base model alone
    client = Client(url, base, list(experts.values()))
    started = time.monotonic()
    client.start()
    flow_runs = {r: run_deployment(f"autoevolve-evolution/{r}", parameters={"run_id": r}, timeout=0) for r in experts}
    deadline = started + timeout_min * 60
    with get_client(sync_client=True) as prefect:
        while True:
            now = {r: prefect.read_flow_run(f.id) for r, f in flow_runs.items()}
            states = ", ".join(f"{r} {f.state.name}" for r, f in now.items())
            print(f"{(time.monotonic() - started) / 60:6.1f} min: {states}", flush=True)
            if all(f.state.is_final() for f in now.values()) or time.monotonic() > deadline:
                break
            time.sleep(30)
        distill = prefect.read_deployment_by_name("autoevolve-distill/gpu")
        jobs = prefect.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[distill.id])))
    client.done.set()
    client.join(300)
    spans = [(j.start_time.timestamp(), j.end_time.timestamp()) for j in jobs if j.start_time and j.end_time]
    rows = expert_rows(store, {r: (expert, now[r]) for r, expert in experts.items()}, client)
    most = overlap(spans)
    return {
        "experts": rows, "training_jobs": len(jobs), "training_overlap": most, "answers": client.answers,
        "minutes": round((time.monotonic() - started) / 60, 1), "folder": str(folder),
        "table": table(rows, client), "checks": checks(rows, client, most, TRAINING_LIMIT),
    }  # fmt: skip


if __name__ == "__main__":
    main()
