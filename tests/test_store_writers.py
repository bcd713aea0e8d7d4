"""Many writing processes on one PostgreSQL store: a writer killed mid-chunk loses only its open chunk and resumes,
the other runs lose and duplicate nothing, and a reader sees one consistent snapshot while they write."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from autoevolve.store import MIGRATIONS, Store
from tests.test_store import make_traj

CHUNK, CHUNKS = 400, 5


def _chunks(run: str) -> list[list]:
    return [[make_traj(c * CHUNK + i, run_id=run) for i in range(CHUNK)] for c in range(CHUNKS)]


def _writer(url: str, run: str, inside: mp.Event) -> None:  # type: ignore[valid-type]
    """Commit a run's chunks in turn. The writer of ``run0`` inserts its third chunk, sets ``inside`` and waits
    there, its transaction open, until it is killed."""
    with Store(url) as store:
        if run == "run0":
            insert, count = store.con.insert_new, iter(range(CHUNKS))

            def insert_then_wait(*args):  # noqa: ANN002, ANN202
                inserted = insert(*args)
                if next(count) == 2:
                    inside.set()
                    time.sleep(600)
                return inserted

            store.con.insert_new = insert_then_wait
        for chunk in _chunks(run):
            store.put_trajectories(chunk)


def _open(url: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        Store(url).close()
        out.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out.put(repr(exc))


def test_processes_opening_a_new_database_at_once_migrate_it_once(postgres_server) -> None:  # noqa: ANN001
    import uuid

    import psycopg

    ctx, said = mp.get_context("fork"), []
    for _ in range(3):  # racing CREATE TABLE IF NOT EXISTS fails in PostgreSQL unless the migrations take turns
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(postgres_server.url, autocommit=True) as con:
            con.execute(f"CREATE DATABASE {name}")
        url, out = postgres_server.url.replace("/postgres?", f"/{name}?"), ctx.Queue()
        procs = [ctx.Process(target=_open, args=(url, out)) for _ in range(4)]
        for p in procs:
            p.start()
        said += [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join()
        with Store(url) as store:
            assert [v for v, _ in store.migrations()] == sorted(v for v, _, _ in MIGRATIONS)
    assert said == ["ok"] * 12


def test_a_writer_killed_mid_chunk_costs_the_others_nothing_and_resumes(postgres_url: str) -> None:
    Store(postgres_url).close()  # migrated before the writers race
    ctx = mp.get_context("fork")
    events = [ctx.Event() for _ in range(4)]
    procs = [ctx.Process(target=_writer, args=(postgres_url, f"run{i}", e)) for i, e in enumerate(events)]
    for p in procs:
        p.start()
    assert events[0].wait(60)
    with Store.snapshot(postgres_url) as reader:  # one snapshot for as long as it is open
        first = reader.count_trajectories()
        os.kill(procs[0].pid, signal.SIGKILL)  # its third chunk inserted, not committed
        for p in procs[1:]:
            p.join(120)
        assert reader.count_trajectories() == first  # the writers' commits since are not in its snapshot
        assert all(reader.count_trajectories(f"run{i}") % CHUNK == 0 for i in range(4))  # whole chunks only
    procs[0].join(10)
    assert procs[0].exitcode == -signal.SIGKILL and all(p.exitcode == 0 for p in procs[1:])
    with Store(postgres_url) as store:
        killed = store.count_trajectories("run0")
        assert killed == 2 * CHUNK  # its open chunk did not land, not one row of it
        assert [store.count_trajectories(f"run{i}") for i in range(1, 4)] == [CHUNKS * CHUNK] * 3
        resumed = sum(store.put_trajectories(chunk) for chunk in _chunks("run0"))  # the run again: stored ones skip
        assert resumed == CHUNKS * CHUNK - killed
        assert store.count_trajectories() == 4 * CHUNKS * CHUNK
        keys = store._one("SELECT count(DISTINCT (run_id, task_id, sample)) FROM trajectories")
        assert keys == (4 * CHUNKS * CHUNK,)


def test_a_round_runs_on_a_postgresql_store(tmp_path, tiny_model_dir, postgres_url: str) -> None:  # noqa: ANN001
    from autoevolve import loop
    from tests.test_flow import _tiny_config

    config = _tiny_config(tmp_path, tiny_model_dir).model_copy(update={"store": postgres_url})
    r = loop.open_round(config)
    try:
        report = loop.run_round(r)
    finally:
        r.bench.store.close()
    with Store.snapshot(postgres_url) as store:
        assert store.count_trajectories("tiny") == report["rollouts"] == 4 + 4 * 2
        assert {s for _, s in store.finished_stages("tiny")} >= {"plan", "evolve", "select"}
        assert [c.mutator for c in store.candidates("tiny")] == ["seed", "tool_format"]


@pytest.mark.slow
def test_two_experts_rounds_write_one_postgresql_store_at_once(tmp_path, tiny_model_dir, postgres_url: str) -> None:  # noqa: ANN001
    import json
    import subprocess
    import sys

    from tests.test_flow import ROOT, _tiny_config

    paths = []
    for name in ("life", "chat"):
        folder = tmp_path / name
        folder.mkdir()
        _tiny_config(folder, tiny_model_dir, extra=f"expert: L1-{name}\n")
        text = (folder / "tiny.yaml").read_text().replace("run_id: tiny", f"run_id: {name}")
        (folder / "tiny.yaml").write_text(text.replace(f"store: {folder}/s.duckdb", f"store: '{postgres_url}'"))
        paths.append(folder / "tiny.yaml")
    code = (
        "import json, sys; from autoevolve import loop; from autoevolve.config import load_config; "
        "r = loop.open_round(load_config(sys.argv[1])); report = loop.run_round(r); r.bench.store.close(); "
        "print(json.dumps(report['rollouts']))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(p)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for p in paths
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.decode()[-1500:] for _, err in outs]
    rollouts = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
    with Store.snapshot(postgres_url) as store:
        assert [store.count_trajectories(run) for run in ("life", "chat")] == rollouts == [12, 12]
        assert [sorted({s for _, s in store.finished_stages(run)}) for run in ("life", "chat")] == [
            ["evolve", "plan", "round", "select", "start"]
        ] * 2
