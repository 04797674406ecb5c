"""The streaming log scanner: same result whatever the block size, grep-equal error-line counts, tracebacks
with torch's `[rankN]: ` prefix, chained exceptions, a bounded window for a real RecursionError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mopd_hpc.logs.causes import classify_text, exception_cause
from mopd_hpc.logs.failure import normalize_line
from mopd_hpc.logs.progress import MAX_POINTS, _Series, sparkline
from mopd_hpc.logs.scan import TB_HEAD_LINES, TB_TAIL_LINES, scan_log

CHAINED = """INFO step 1 ok
[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 10, in step
[rank0]:     connect()
[rank0]: ConnectionRefusedError: [Errno 111] Connection refused
[rank0]:
[rank0]: During handling of the above exception, another exception occurred:
[rank0]:
[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 12, in step
[rank0]:     raise GuardUnreachableError("GET http://n1:9000/status: no answer after 3 attempts")
[rank0]: mopd_hpc.runtime.guard.client.GuardUnreachableError: GET http://n1:9000/status: no answer after 3 attempts
INFO shutting down
srun: error: n1: task 0: Exited with exit code 1
"""


def _real_deep_traceback(path: Path) -> None:
    """A real 200-frame traceback: f0 calls f1 ... f99, which raises (distinct frames are never collapsed)."""
    funcs = "".join(f"def f{i}():\n    return f{i + 1}()\n" for i in range(99))
    code = (
        funcs + "def f99():\n    raise RecursionError('maximum recursion depth exceeded (simulated)')\nf0()\n"
    )
    with open(path, "w") as fh:
        subprocess.run([sys.executable, "-c", code], stderr=fh, check=False)


def test_chained_prefixed_traceback(tmp_path: Path) -> None:
    path = tmp_path / "a.err"
    path.write_text(CHAINED)
    for chunk in (7, 64, 1 << 20):
        r = scan_log(path, chunk_bytes=chunk)
        assert r.n_tracebacks == 1 and r.n_lines == 14
        tb = r.last_traceback
        assert tb.lineno == 2 and tb.n_lines == 10
        assert tb.exception_line.startswith("mopd_hpc.runtime.guard.client.GuardUnreachableError")
        assert tb.lines[3] == "ConnectionRefusedError: [Errno 111] Connection refused"
        assert r.last_hits == () and r.first_hits == (
            (14, "srun: error: n1: task 0: Exited with exit code 1"),
        )
    assert classify_text(r.evidence_lines()).key == "guard_unreachable"


def test_bounded_window_and_grep_parity(tmp_path: Path) -> None:
    path = tmp_path / "deep.err"
    _real_deep_traceback(path)
    with open(path, "a") as fh:
        for i in range(2000):
            fh.write(f"INFO step {i} Error-free line\n" if i % 7 == 0 else f"INFO step {i}\n")
    r = scan_log(path, chunk_bytes=4096)
    assert r.n_tracebacks == 1
    tb = r.last_traceback
    assert tb.n_lines > TB_HEAD_LINES + TB_TAIL_LINES
    assert len(tb.lines) == TB_HEAD_LINES + TB_TAIL_LINES + 1 and tb.lines[TB_HEAD_LINES].startswith("... (")
    assert tb.exception_line.startswith("RecursionError: maximum recursion depth exceeded")
    assert exception_cause(tb.lines).title == "unhandled RecursionError"
    grep = subprocess.run(["grep", "-c", "-E", "Error|Traceback", str(path)], capture_output=True, text=True)
    assert r.error_lines == int(grep.stdout)
    wc = subprocess.run(["wc", "-l", str(path)], capture_output=True, text=True)
    assert r.n_lines == int(wc.stdout.split()[0])
    assert r == scan_log(path, chunk_bytes=1 << 20)


def test_normalize_makes_ranks_equal() -> None:
    a = "DistBackendError: [Rank 3] timeout WorkNCCL(SeqNum=43) ran for 600111 ms pid=7253 at 0x7f03a1b2c3d4"
    b = "DistBackendError: [Rank 5] timeout WorkNCCL(SeqNum=45) ran for 600185 ms pid=7255 at 0x7f05a1b2c3d4"
    assert normalize_line(a) == normalize_line(b)
    assert normalize_line("at 2026-11-29T21:19:44 from 10.200.0.11:29500") == "at TIME from ADDR"


def test_sparkline_and_bounded_series() -> None:
    assert sparkline([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2.0, 2.0]) == "▁▁" and sparkline([]) == ""
    s = _Series()
    for step in range(100_000):
        s.add(step, float(step))
    assert len(s.points) < MAX_POINTS and s.points[0] == (0, 0.0)
    steps = [p[0] for p in s.points]
    assert steps == sorted(steps) and steps[-1] > 99_000 - s.stride


@pytest.mark.parametrize(
    ("line", "key"),
    [
        (
            "slurmstepd-n4: error: *** JOB 53 ON n4 CANCELLED AT 2026-11-29T21:20:58 DUE TO TIME LIMIT ***",
            "time_limit",
        ),
        ("RuntimeError: CUDA error: invalid device ordinal", "invalid_device_ordinal"),
        ("srun: error: n1: task 0: Out Of Memory", "host_oom"),
        (
            "slurmstepd: error: *** STEP 7.0 ON n2 CANCELLED AT 2026-01-01T00:00:00 DUE TO PREEMPTION ***",
            "preempted",
        ),
        ("NCCL WARN Net : Connection closed by remote peer", "nccl"),
    ],
)
def test_cause_table(line: str, key: str) -> None:
    assert classify_text([line]).key == key
