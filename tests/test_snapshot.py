"""Reading a store that another process is writing: no lock error reaches the reader, nothing blocks the writer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from autoevolve.store import Store
from autoevolve.store.snapshot import snapshot_path

ROOT = Path(__file__).resolve().parents[1]

# A round-like writer: holds the store open, writes a batch of 8 trajectories every 50 ms, says when each landed.
WRITER = """
import sys, time, json
from autoevolve.records import Message, Trajectory
from autoevolve.store import Store

path, batches, hang = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hang"
slowest = 0.0
with Store(path, publish_every_s=0.2) as store:
    store.put_run("w", {})
    for b in range(batches):
        rows = [
            Trajectory(run_id="w", task_id=f"t{b}-{i}", split="train", hcp_id="h", reward=1.0,
                       messages=[Message(role="user", content="hi " * 50)])
            for i in range(8)
        ]
        started = time.perf_counter()
        store.put_trajectories(rows)
        slowest = max(slowest, time.perf_counter() - started)
        print(json.dumps({"written": 8 * (b + 1)}), flush=True)
        time.sleep(0.05)
    if hang:
        time.sleep(600)
print(json.dumps({"slowest_write_s": slowest}), flush=True)
"""


def _writer(path: Path, batches: int, hang: bool = False) -> subprocess.Popen:
    """Start the writer process."""
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(batches), "hang" if hang else "done"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def _count(store: Store) -> int:
    """Trajectories in a store."""
    return store.count_trajectories("w")


def test_readers_see_a_growing_store_while_a_writer_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    writer = _writer(path, batches=120)
    assert json.loads(writer.stdout.readline()) == {"written": 8}  # the writer holds the file now
    with pytest.raises(duckdb.IOException, match="lock"):
        duckdb.connect(str(path), read_only=True)  # what a reader would hit without snapshots
    cli = subprocess.Popen(  # a command-line reader, in its own process, while the writer goes on
        [sys.executable, "-m", "autoevolve.cli", "selections", "w", "--store", str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen, deadline = [], time.monotonic() + 120  # the writer takes about 7 s
    while writer.poll() is None:
        assert time.monotonic() < deadline, "the writer did not finish in 120 s"
        with Store.snapshot(path) as store:
            seen.append(_count(store))
        time.sleep(0.1)
    _, said = cli.communicate(timeout=120)
    assert cli.returncode == 2 and "no selections for run 'w'" in said  # read, not refused
    out = [json.loads(line) for line in writer.stdout.read().splitlines()]
    assert writer.returncode == 0
    assert seen == sorted(seen) and len(set(seen)) >= 3  # several states read while it wrote, never going back
    assert out[-1]["slowest_write_s"] < 2.0  # readers never held the writer up
    with Store.snapshot(path) as store:
        assert _count(store) == 960
    assert not snapshot_path(path).exists()  # a writer that closed leaves no snapshot behind


def test_a_reader_holding_a_snapshot_does_not_block_a_new_writer(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    with Store(path) as store:
        store.put_run("w", {})
    with Store.snapshot(path) as reader:
        started = time.perf_counter()
        with Store(path, wait_s=0) as writer:  # would raise StoreBusy at once if the reader held the file
            writer.put_run("w2", {})
        assert time.perf_counter() - started < 2.0
        assert reader.runs() == ["w"]  # the reader's copy does not change under it
    with Store.snapshot(path) as reader:
        assert reader.runs() == ["w", "w2"]


def test_rows_a_killed_writer_committed_are_in_the_next_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    writer = _writer(path, batches=5, hang=True)
    lines = [json.loads(writer.stdout.readline()) for _ in range(5)]
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert lines[-1] == {"written": 40}
    with Store.snapshot(path) as store:  # the file itself (its log replayed), not the dead writer's last snapshot
        assert _count(store) == 40


def test_a_writer_that_never_lets_go_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    writer = _writer(path, batches=1, hang=True)
    try:
        writer.stdout.readline()
        snapshot_path(path).unlink()  # as if the writer had not published yet
        with pytest.raises(Exception, match=r"held by a writer that has published no snapshot within 1 s"):
            Store.snapshot(path, wait_s=1)
        from autoevolve.store import StoreBusy

        with pytest.raises(StoreBusy, match=rf"is held by another process \(PID {writer.pid}\)"):
            Store(path, wait_s=0.5)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
