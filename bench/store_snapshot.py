"""What reading a store during a round costs: the writer's snapshot publish and a reader's private copy, by size.

A writing store publishes a snapshot at most every 15 s of writing; the share of a writer's time it costs is the
publish time over that interval. Medians of ``--repeats`` runs, all in one process.

Run: .venv/bin/python bench/store_snapshot.py [--sizes 10000 100000] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shared import write_json  # noqa: E402
from rollout_throughput import round_shaped  # noqa: E402 - the trajectories of the ingest bench

from autoevolve.store import Store  # noqa: E402
from autoevolve.store.snapshot import publish  # noqa: E402

INTERVAL_S = 15.0


def measure(n: int, repeats: int) -> dict[str, float]:
    """Median publish and snapshot-open seconds for a store of n trajectories, and its size."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.duckdb"
        publish_s, read_s = [], []
        with Store(path, publish_every_s=None) as store:
            store.put_trajectories(round_shaped(n))
            store.con.execute("CHECKPOINT")
            size_mb = path.stat().st_size / 1e6
            for _ in range(repeats):
                started = time.perf_counter()
                publish(store.con, path)
                publish_s.append(time.perf_counter() - started)
            for _ in range(repeats):  # the writer holds the file: readers copy its published snapshot
                started = time.perf_counter()
                with Store.snapshot(path) as reader:
                    assert reader.count_trajectories() == n
                read_s.append(time.perf_counter() - started)
        return {
            "size_mb": size_mb,
            "publish_s": statistics.median(publish_s),
            "read_s": statistics.median(read_s),
        }


def main() -> None:
    """Print one row per store size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    rows = []
    print("| trajectories | store MB | publish s (median) | writer time at one publish per 15 s | snapshot read s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in args.sizes:
        m = measure(n, args.repeats)
        share = 100 * m["publish_s"] / INTERVAL_S
        print(f"| {n:,} | {m['size_mb']:.1f} | {m['publish_s']:.2f} | {share:.1f}% | {m['read_s']:.2f} |")
        rows.append({"trajectories": n, **m, "writer_share": share / 100})
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
