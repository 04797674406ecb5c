"""SIGSTOP of one server child of a local run mid-run (`tests/faults/test_fault_*_stop.py`): the job started
with a short request timeout, the child stopped after the third metrics line, then what it left behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_ports import free_port
from helpers_wait import until
from test_controller import micro_config
from test_fault_kill_resume import child_pid
from test_local_backend import env_for, processes_of

from mopd_hpc.engines.frames.codec import CONTENT_TYPE
from mopd_hpc.records.metrics import read_metrics

#: Seconds past the request timeout within which the job must have ended after the stop (the actor's exit,
#: then the guard stops the others, the stopped child included: SIGTERM, then SIGCONT so that it acts on it).
MARGIN_S = 40.0


@dataclass(frozen=True)
class StoppedRun:
    """What a run whose child was stopped left: mopd-submit's exit code and output, the stopped server's
    URL (from its endpoint record, read before the stop), and seconds from the stop to the actor's last
    write to its .err log (its failed step's error) and to mopd-submit's exit."""

    run_dir: Path
    returncode: int
    out: str
    url: str
    failed_s: float
    ended_s: float

    @property
    def actor_err(self) -> str:
        return next((self.run_dir / "logs").glob("*/actor-0.g1.err")).read_text()


def stop_mid_run(
    models: Path,
    tmp_path: Path,
    child: tuple[str, int],
    endpoint: str,
    timeout_s: float,
    set_timeout: Callable[[dict[str, Any], float], None],
) -> StoppedRun:
    """Run the micro config (`set_timeout(doc, timeout_s)` edits its YAML), SIGSTOP `child` (role, index)
    after the third metrics line, and wait at most `timeout_s + MARGIN_S` s for mopd-submit to end; a stopped or
    left process is killed here either way. `endpoint`: the child's record under run_dir/endpoints."""
    run_dir = tmp_path / "run"
    config = micro_config(models, run_dir, tmp_path / "c.yaml", steps=400)
    doc = yaml.safe_load(config.read_text())
    set_timeout(doc, timeout_s)
    config.write_text(yaml.safe_dump(doc))
    submit = [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local"]
    proc = subprocess.Popen(submit, cwd=tmp_path, env=env_for(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    pid = None
    try:
        assert until(
            lambda: len(read_metrics(run_dir / "metrics.jsonl")) >= 3 or proc.poll() is not None, 240
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        pid = child_pid(run_dir, *child)
        record = json.loads((run_dir / "endpoints" / endpoint).read_text())  # gone at its end
        os.kill(pid, signal.SIGSTOP)  # the fault
        stopped = time.time()
        out, _ = proc.communicate(timeout=timeout_s + MARGIN_S)
        ended = time.time() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if pid is not None:  # a test failure must not leave a stopped process behind
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
    actor_err = next((run_dir / "logs").glob("*/actor-0.g1.err"))
    failed = actor_err.stat().st_mtime - stopped  # its last write: the error of the failed step
    url = f"http://{record['host']}:{record['port']}"
    return StoppedRun(run_dir, proc.returncode, out, url, failed, ended)


def assert_failed_within_timeout(run: StoppedRun, timeout_s: float, step_s: float, want: str) -> None:
    """mopd-submit failed (exit 1); the step failed `timeout_s` ± `step_s` after the stop (± for the request in
    flight at the stop) and the job ended within `timeout_s + MARGIN_S`; the actor's error matches the regex
    `want`; the job ended FAILED (`assert_job_ended_failed`)."""
    assert run.returncode == 1, run.out[-3000:]
    print(f"the step failed {run.failed_s:.1f} s and the job ended {run.ended_s:.1f} s after the SIGSTOP")
    assert timeout_s - step_s <= run.failed_s <= timeout_s + step_s  # the request in flight at the stop
    assert run.ended_s <= timeout_s + MARGIN_S
    assert re.search(want, run.actor_err), run.actor_err[-3000:]
    assert_job_ended_failed(run.run_dir)


def assert_job_ended_failed(run_dir: Path) -> None:
    """No process of the job is left (within 15 s), and the summary says FAILED, without a traceback."""
    assert until(lambda: processes_of(run_dir) == [], 15), processes_of(run_dir)
    summary = subprocess.run([sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(run_dir)],
                             env=env_for(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert summary.returncode == 1 and "state FAILED" in summary.stdout, summary.stdout + summary.stderr
    assert "Traceback" not in summary.stdout + summary.stderr


#: The head of a 2 MiB frame answer and its first KiB: a client reads the rest straight from the socket
#: (`engines/frames/over_http.read_frame`), outside aiohttp's own timeout.
STALLED_FRAME = (
    f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {2 << 20}\r\n\r\n".encode()
    + b"\0" * 1024
)


@contextlib.contextmanager
def hung_server(sends: bytes) -> Iterator[str]:
    """The URL of a listener that accepts one connection, reads the request, sends `sends` (b"": nothing;
    `STALLED_FRAME`: an answer that stalls mid-body) and never more; closed at the end."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        held: list[socket.socket] = []

        def serve() -> None:
            conn, _ = server.accept()
            held.append(conn)
            conn.recv(1 << 16)
            conn.sendall(sends)

        threading.Thread(target=serve, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.getsockname()[1]}"
        finally:
            for conn in held:
                conn.close()


def hung_call_error(
    sends: bytes, call: Callable[[str], Coroutine[Any, Any, None]], error: type[Exception]
) -> tuple[str, str]:
    """Run `call(url)` (a client of timeout 1 s) against `hung_server(sends)`: it raises `error` 1 to 3 s after
    it starts. Returns (url, the error's message)."""
    with hung_server(sends) as url:
        start = time.monotonic()
        with pytest.raises(error) as info:
            asyncio.run(call(url))
        took = time.monotonic() - start
    assert 1.0 <= took < 3.0, took
    return url, str(info.value)


def closed_url() -> str:
    """The URL of a port nothing listens on (leased, `helpers_ports.free_port`)."""
    return f"http://127.0.0.1:{free_port()}"
