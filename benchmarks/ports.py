"""Port lease throughput and latency with 1 and 16 processes leasing at once (goal: >= 5,000 leases/s).

Each worker process builds a `PortLeaser`, waits for "go", then takes `--per-process` leases (one named
port per owner), timing each `reserve` call, and releases them. Throughput = all leases / (last reserve
end - first reserve start) across processes (CLOCK_MONOTONIC is system-wide on Linux).

    .venv/bin/python benchmarks/ports.py [--per-process-1 5000] [--per-process-16 500]

Prints a table and writes benchmarks/results/ports.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

from mopd_hpc.runtime.ports import read_ephemeral_range

GOAL_LEASES_PER_S = 5000
RESULTS = Path(__file__).resolve().parent / "results" / "ports.json"

WORKER = textwrap.dedent(
    """
    import json, sys, time
    from mopd_hpc.runtime.ports import LeasePolicy, PortLeaser, PortOwner, read_ephemeral_range
    job, n = sys.argv[1], int(sys.argv[2])
    owners = [PortOwner.create(job, "bench", i) for i in range(n)]
    leaser = PortLeaser(LeasePolicy.create(read_ephemeral_range()))
    print("ready", flush=True)
    sys.stdin.readline()
    lat_ns = []
    t0 = time.monotonic()
    for owner in owners:
        s = time.perf_counter_ns()
        leaser.reserve(owner, ("http",))
        lat_ns.append(time.perf_counter_ns() - s)
    t1 = time.monotonic()
    for owner in owners:
        leaser.release(owner)
    t2 = time.monotonic()
    print(json.dumps({"start": t0, "end": t1, "release_end": t2, "lat_ns": lat_ns}), flush=True)
    """
)


def run_case(processes: int, per_process: int) -> dict[str, float]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, f"bench{os.getpid()}-{k}", str(per_process)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(processes)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.wait(timeout=120)
    lat = sorted(x for r in results for x in r["lat_ns"])
    total = len(lat)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    release_wall = max(r["release_end"] for r in results) - min(r["end"] for r in results)
    return {
        "processes": processes,
        "leases": total,
        "leases_per_s": total / wall,
        "releases_per_s": total / release_wall,
        "p50_us": lat[total // 2] / 1e3,
        "p99_us": lat[min(total - 1, int(total * 0.99))] / 1e3,
        "max_us": lat[-1] / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-process-1", type=int, default=5000, help="leases taken by the single process")
    parser.add_argument(
        "--per-process-16", type=int, default=500, help="leases taken by each of 16 processes"
    )
    args = parser.parse_args(argv)
    rows = [run_case(1, args.per_process_1), run_case(16, args.per_process_16)]
    header = f"{'processes':>9} {'leases':>7} {'leases/s':>10} {'releases/s':>11} {'p50 µs':>8} {'p99 µs':>8}"
    print(header)
    for r in rows:
        print(
            f"{r['processes']:>9} {r['leases']:>7} {r['leases_per_s']:>10.0f} {r['releases_per_s']:>11.0f} "
            f"{r['p50_us']:>8.1f} {r['p99_us']:>8.1f}"
        )
    ok = all(r["leases_per_s"] >= GOAL_LEASES_PER_S for r in rows)
    print(f"goal >= {GOAL_LEASES_PER_S} leases/s: {'met' if ok else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "ephemeral_range": list(read_ephemeral_range()),
        "goal_leases_per_s": GOAL_LEASES_PER_S,
        "goal_met": ok,
    }
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
