"""How long after a key or set appears on awex's MetaServer a waiting client notices it (awex 0.9.0 gap 8,
engines/weight_sync/awex_latency.py): awex's own polling (0.2 s back-off growing to 1 s) against
`fast_meta_server_polling()` (POLL_INITIAL_S growing to POLL_MAX_S). Runs on CPU: a real MetaServer process,
a writer thread that puts the key (or fills the set) after a delay drawn uniformly from 0.05–0.6 s (AWEX's
handshakes wait for the other side's work of that order), and the waiting client.

    python benchmarks/awex_meta_polling.py            # writes benchmarks/results/awex_meta_polling.json

`notice_ms` = wait return time − put time (median and p90 over the trials). A colocate sync waits on five
such handshakes in sequence.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = Path(__file__).resolve().parent / "results"


def _trial(client, kind: str, key: str, delay_s: float) -> float:
    put_at: list[float] = []

    def writer() -> None:
        time.sleep(delay_s)
        put_at.append(time.monotonic())
        if kind == "key":
            client.put_object(key, True)
        else:
            client.add_object_to_set(key, 0)

    thread = threading.Thread(target=writer)
    thread.start()
    if kind == "key":
        client.wait_key(key, timeout=30)
    else:
        client.wait_set_until_size(key, 1, timeout=30)
    done = time.monotonic()
    thread.join()
    return (done - put_at[0]) * 1000


def measure(client, label: str, trials: int, rng: random.Random) -> list[dict]:
    rows = []
    for kind in ("key", "set"):
        notice = [_trial(client, kind, f"{label}-{kind}-{i}", rng.uniform(0.05, 0.6)) for i in range(trials)]
        notice.sort()
        rows.append({"polling": label, "wait": kind, "trials": trials,
                     "notice_ms_median": round(statistics.median(notice), 1),
                     "notice_ms_p90": round(notice[int(0.9 * (len(notice) - 1))], 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS / "awex_meta_polling.json")
    args = p.parse_args(argv)
    from awex.meta.meta_server import MetaServerClient, start_meta_server, stop_meta_server
    from results_file import write_results

    from mopd_hpc.engines.weight_sync import awex_latency as gaps

    host, port = start_meta_server("127.0.0.1", 0)
    try:
        client = MetaServerClient(host, port)
        rng = random.Random(0)
        rows = measure(client, "awex 0.9.0", args.trials, rng)
        gaps.fast_meta_server_polling()
        rows += measure(client, "fast_meta_server_polling", args.trials, rng)
    finally:
        stop_meta_server()
    print(f"\n{'polling':26} {'wait':4} {'median ms':>10} {'p90 ms':>8}")
    for r in rows:
        print(f"{r['polling']:26} {r['wait']:4} {r['notice_ms_median']:10.1f} {r['notice_ms_p90']:8.1f}")
    result = {"benchmark": "awex_meta_polling", "poll_initial_s": gaps.POLL_INITIAL_S, "poll_max_s": gaps.POLL_MAX_S,
              "rows": rows}  # fmt: skip
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
