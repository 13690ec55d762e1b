"""What a KV put costs the master's event loop, by namespace size: the log line it writes now
(omni/master/kv_journal.py) against the whole-namespace rewrite each put did before (the same
snapshot writer the journal uses when it compacts, run once per put as the old store did).

Each row prefills a state dir with N entries of S bytes (a snapshot written directly), loads a
KvStore from it, then times puts over existing keys (median and max of --puts), and times one
rewrite of the whole namespace.

    .venv/bin/python benchmarks/kv_store.py [--quick | --full] [--puts N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni.master.kv import KvStore  # noqa: E402
from omni.master.kv_journal import Journal  # noqa: E402

QUICK = [(1_000, 1_000), (10_000, 1_000)]
FULL = QUICK + [(10_000, 6_000)]


def row(entries: int, size: int, puts: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "kv"
        folder.mkdir()
        now = time.time()
        data = {f"job-{i:06d}": (b"x" * size, now) for i in range(entries)}
        journal = Journal(folder)
        journal._write_snapshot(folder / "jobs.json", data)
        t = time.perf_counter()
        journal._write_snapshot(folder / "jobs.json", data)    # what every put did before
        rewrite_ms = (time.perf_counter() - t) * 1e3
        kv = KvStore(d)
        times = []
        for i in range(puts):
            t = time.perf_counter()
            kv.put("jobs", f"job-{i % entries:06d}", b"y" * size)
            times.append((time.perf_counter() - t) * 1e3)
        kv.close()
    return {"entries": entries, "value_bytes": size, "namespace_mib": round(entries * size / 2**20, 1),
            "put_ms_median": round(statistics.median(times), 3), "put_ms_max": round(max(times), 3),
            "rewrite_ms": round(rewrite_ms, 1), "ratio": round(rewrite_ms / statistics.median(times), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="1,000 and 10,000 entries of 1 KB (default)")
    size.add_argument("--full", action="store_true", help="also 10,000 entries of 6 KB (57 MiB)")
    ap.add_argument("--puts", type=int, default=20, help="puts timed per row (default 20)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    args = ap.parse_args()
    if args.puts < 1:
        ap.error("--puts must be at least 1")
    t0, load0 = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    rows = [row(n, s, args.puts) for n, s in (FULL if args.full else QUICK)]
    doc = {"host_cpus": os.cpu_count(), "puts": args.puts, "rows": rows, "seconds": round(time.perf_counter() - t0, 1),
           "loadavg_start": load0, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{'entries':>8} {'value':>7} {'MiB':>6} {'put ms (median)':>16} {'put ms (max)':>13} "
          f"{'rewrite ms (before)':>20} {'ratio':>7}")
    for r in rows:
        print(f"{r['entries']:>8} {r['value_bytes']:>7} {r['namespace_mib']:>6} {r['put_ms_median']:>16} "
              f"{r['put_ms_max']:>13} {r['rewrite_ms']:>20} {r['ratio']:>6}x")
    print(f"{doc['seconds']} s, load average {doc['loadavg_start']} -> {doc['loadavg_end']}")


if __name__ == "__main__":
    main()
