"""Log scan speed of `mopd-logs summarize` against `grep -c -E 'Error|Traceback'` on the same files.

    python benchmarks/logs.py                   # ~1 GB of synthetic child logs (default --size-mb 1024)
    python benchmarks/logs.py --size-mb 64      # quicker

Writes a synthetic run directory in a temp dir (deleted afterwards): 4 hosts × 8 actor ranks + rollout and
teacher children, each with .out/.err logs of realistic lines (INFO/DEBUG step lines, SGLang-style request
lines, occasional warnings with "Error" in them) and a real-format traceback near the end of every .err;
guard event logs where every child fails (so `summarize_run` scans every log for deduplication).

Measured, each the best of `--repeats` runs with a warm page cache: `grep -c -E 'Error|Traceback'` over every
log; `scan_log` over every log (the summarizer's streaming scanner); `summarize_run` end to end. The goal is
scan speed ≥ 0.25 × grep's (issue 7). The scanner's error-line count must equal grep's. Prints a table;
writes JSON to benchmarks/results/logs.json (or logs_<size>mb.json for a non-default size).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mopd_hpc.atomic import atomic_write_json  # noqa: E402
from mopd_hpc.logs.scan import scan_log  # noqa: E402
from mopd_hpc.logs.summary import no_sacct, summarize_run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_RATIO = 0.25
MB = 1 << 20
TRACEBACK = """Traceback (most recent call last):
  File "/opt/mopd/mopd_hpc/roles/actor.py", line 88, in main
    controller.run()
  File "/opt/mopd/mopd_hpc/trainer/controller.py", line 214, in run
    self.train_step(batch)
  File "/opt/mopd/mopd_hpc/engines/torch/engine.py", line 131, in train_step
    loss.backward()
torch.distributed.DistBackendError: [Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600{rank:03d} milliseconds before timing out.
"""


def _block(rng: random.Random, n_lines: int) -> bytes:
    words = "step loss rollout teacher tokens batch actor rank throughput worker prefill decode request queue".split()
    lines = []
    for i in range(n_lines):
        r = rng.random()
        if r < 0.001:
            lines.append(f"WARNING torch.distributed: ProcessGroupNCCL Error-handling is set to {i}")
        elif r < 0.3:
            lines.append(
                f"[2026-11-29 21:{i % 60:02d}:{i % 59:02d} TP0] Decode batch. #running-req: {i % 64}, "
                f"#token: {i * 7 % 90000}, token usage: 0.{i % 97:02d}, gen throughput (token/s): {i % 5000}.{i % 10}"
            )
        else:
            lines.append(
                f"INFO step={i} "
                + " ".join(rng.choice(words) for _ in range(10))
                + f" value={rng.random():.6f}"
            )
    return ("\n".join(lines) + "\n").encode()


def generate(root: Path, size_mb: int, seed: int = 0) -> tuple[list[Path], int]:
    """Write the synthetic run dir; returns (log files, total bytes)."""
    rng = random.Random(seed)
    block = _block(rng, 20_000)
    children = [(f"n{h}", "actor", h * 8 + i) for h in range(1, 5) for i in range(8)]
    children += [("n1", "teacher", 0), ("n2", "rollout", 0), ("n3", "rollout", 1)]
    per_file = size_mb * MB // (2 * len(children))
    files, total = [], 0
    (root / "events").mkdir(parents=True)
    events: dict[str, list[str]] = {}
    for n, (host, role, index) in enumerate(children):
        d = root / "logs" / host
        d.mkdir(parents=True, exist_ok=True)
        for stream in ("out", "err"):
            path = d / f"{role}-{index}.g1.{stream}"
            with open(path, "wb") as fh:
                written = 0
                while written < per_file:
                    piece = block[: per_file - written]
                    piece = piece[: piece.rfind(b"\n") + 1]  # whole lines only
                    if not piece:
                        break
                    fh.write(piece)
                    written += len(piece)
                if stream == "err":
                    fh.write(TRACEBACK.format(rank=index).encode())
                    written += len(TRACEBACK)
            files.append(path)
            total += path.stat().st_size
        ident = {"role": role, "index": index, "generation": 1, "pid": 1000 + n}
        events.setdefault(host, []).append(json.dumps({"ts": 1.0, "host": host, "event": "spawn", **ident}))
        events[host].append(
            json.dumps(
                {"ts": 100.0 + n, "host": host, "event": "exit", "exit_code": 1, "signal": None, **ident}
            )
        )
    for host, lines in events.items():
        (root / "events" / f"{host}.guard.jsonl").write_text("\n".join(lines) + "\n")
    return files, total


def _best(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def grep_counts(files: list[Path]) -> int:
    done = subprocess.run(
        ["grep", "-c", "-E", "Error|Traceback", *map(str, files)], capture_output=True, text=True
    )
    return sum(int(line.rsplit(":", 1)[1]) for line in done.stdout.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="total size of the synthetic logs (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="parent directory of the temp run dir (default: $TMPDIR)")
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/logs[_<size>mb].json)"
    )
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="mopd-logs-bench-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        files, total = generate(tmp / "run", args.size_mb)
        gen_s = time.perf_counter() - t0
        grep_counts(files)  # warm the page cache
        grep_s, grep_n = _best(lambda: grep_counts(files), args.repeats)
        scan_s, scans = _best(lambda: [scan_log(p) for p in files], args.repeats)
        scan_n = sum(s.error_lines for s in scans)  # type: ignore[union-attr]
        summ_s, summary = _best(lambda: summarize_run(tmp / "run", sacct_runner=no_sacct), 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = grep_s / scan_s
    rows = [
        ("grep -c -E 'Error|Traceback'", grep_s, grep_n),
        ("scan_log (summarizer scanner)", scan_s, scan_n),
        ("summarize_run (end to end)", summ_s, None),
    ]
    print(f"{len(files)} files, {total / MB:.0f} MiB (generated in {gen_s:.1f} s)")
    print(f"{'what':34} {'seconds':>9} {'MiB/s':>9} {'error lines':>12}")
    for name, secs, count in rows:
        print(f"{name:34} {secs:9.3f} {total / MB / secs:9.0f} {'' if count is None else count:>12}")
    verdict = "MET" if ratio >= GOAL_RATIO else "MISSED"
    print(
        f"scan speed / grep speed = {ratio:.2f} (goal >= {GOAL_RATIO}: {verdict}); counts equal: {grep_n == scan_n}"
    )
    first = summary.first_failure  # type: ignore[union-attr]
    result = {
        "benchmark": "logs",
        "size_bytes": total,
        "n_files": len(files),
        "grep_s": grep_s,
        "scan_s": scan_s,
        "summarize_s": summ_s,
        "grep_mib_per_s": total / MB / grep_s,
        "scan_mib_per_s": total / MB / scan_s,
        "scan_over_grep_speed": ratio,
        "goal_ratio": GOAL_RATIO,
        "goal_met": ratio >= GOAL_RATIO,
        "error_lines_grep": grep_n,
        "error_lines_scan": scan_n,
        "first_failure_cause": first.cause.key if first else None,
        "same_on_count": len(first.same_on) if first else None,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
    }
    out = (
        Path(args.out)
        if args.out
        else RESULTS / ("logs.json" if args.size_mb == 1024 else f"logs_{args.size_mb}mb.json")
    )
    atomic_write_json(out, result)
    print(f"wrote {out}")
    return 0 if grep_n == scan_n else 1


if __name__ == "__main__":
    raise SystemExit(main())
