"""Fault: SIGSTOP of a teacher server mid-run (a hung node, a debugger, a stopped job step).

Kept: the step that needs the teacher fails once its request has waited `models.teachers[].request_timeout_s`
(here `TIMEOUT_S`), at most `STEP_S` later than that (the step in flight at the stop: the next /score starts
at most one step later; a step of the micro models takes about 2 s on 2 shared cores); the actor's error names
the teacher, the replica and its URL (the endpoint record's); the job ends within `TIMEOUT_S + MARGIN_S` of
the stop (the actor's exit, then the guard stops the others, the stopped teacher included: SIGTERM, then
SIGCONT so that it acts on it; measured: 11 s to the actor's exit, 18 s to the guard's, 23 s to mopd-submit's);
no process of the job is left; the summary says FAILED. Without the timeout the step waited 600 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml
from test_controller import micro_config, micro_models  # noqa: F401  (the module-scoped fixture)
from test_fault_kill_resume import child_pid
from test_local_backend import env_for, processes_of, wait_for

from mopd_hpc.engines.frames.codec import CONTENT_TYPE
from mopd_hpc.engines.teacher.client import TeacherClient, TeacherUnavailableError
from mopd_hpc.records.metrics import read_metrics

TIMEOUT_S = 4.0
STEP_S = 6.0
MARGIN_S = 40.0


def test_sigstop_of_a_teacher_fails_the_step_within_its_timeout_naming_it(micro_models, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    config = micro_config(micro_models, run_dir, tmp_path / "c.yaml", steps=400)
    doc = yaml.safe_load(config.read_text())
    for teacher in doc["models"]["teachers"]:
        teacher["request_timeout_s"] = TIMEOUT_S
    config.write_text(yaml.safe_dump(doc))
    submit = [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local"]
    proc = subprocess.Popen(submit, cwd=tmp_path, env=env_for(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    teacher = None
    try:
        assert wait_for(
            lambda: len(read_metrics(run_dir / "metrics.jsonl")) >= 3 or proc.poll() is not None, 240
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        teacher = child_pid(run_dir, "teacher", 0)
        record = json.loads((run_dir / "endpoints" / "teacher-chain.r0.json").read_text())  # gone at its end
        os.kill(teacher, signal.SIGSTOP)  # the fault
        stopped = time.time()
        out, _ = proc.communicate(timeout=TIMEOUT_S + MARGIN_S)
        took = time.time() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if teacher is not None:  # a test failure must not leave a stopped process behind
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(teacher, signum)
                except ProcessLookupError:
                    pass
    assert proc.returncode == 1, out[-3000:]
    actor_err = next((run_dir / "logs").glob("*/actor-0.g1.err"))
    failed = actor_err.stat().st_mtime - stopped  # its last write: the error of the failed step
    print(f"the step failed {failed:.1f} s and the job ended {took:.1f} s after the teacher's SIGSTOP")
    assert TIMEOUT_S <= failed <= TIMEOUT_S + STEP_S
    assert took <= TIMEOUT_S + MARGIN_S
    url = f"http://{record['host']}:{record['port']}"
    want = f"teacher 'chain' replica 0 at {url}: /score: no answer within {TIMEOUT_S:g} s"
    assert want in actor_err.read_text(), actor_err.read_text()[-3000:]
    assert wait_for(lambda: processes_of(run_dir) == [], 15), processes_of(run_dir)
    summary = subprocess.run([sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(run_dir)],
                             env=env_for(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert summary.returncode == 1 and "state FAILED" in summary.stdout, summary.stdout + summary.stderr
    assert "Traceback" not in summary.stdout + summary.stderr


@pytest.mark.parametrize("sends", [b"", b"head"], ids=["silent", "stalls-mid-answer"])
def test_a_silent_or_stalled_server_is_a_timeout_naming_the_teacher(sends: bytes) -> None:
    """A listener that accepts and never answers, or stalls after the head of a 2 MiB frame answer (read
    straight from the socket, outside aiohttp's own timeout): TeacherUnavailableError within the timeout."""
    if sends:
        sends = (
            f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {2 << 20}\r\n\r\n".encode()
            + b"\0" * 1024
        )
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        held: list[socket.socket] = []

        def serve() -> None:
            conn, _ = server.accept()
            held.append(conn)
            conn.recv(1 << 16)
            conn.sendall(sends)

        threading.Thread(target=serve, daemon=True).start()

        async def score() -> None:
            async with TeacherClient(url, timeout_s=1.0, name="'chain' replica 0") as client:
                await client.score_tensors([[1, 2, 3]], [1])

        start = time.monotonic()
        with pytest.raises(TeacherUnavailableError) as info:
            asyncio.run(score())
        took = time.monotonic() - start
        for conn in held:
            conn.close()
    assert 1.0 <= took < 3.0, took
    assert str(info.value).startswith(f"teacher 'chain' replica 0 at {url}: /score: no answer within 1 s")


def test_a_dead_server_is_named() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
    # closed: nothing listens there any more

    async def score() -> None:
        async with TeacherClient(url, timeout_s=5.0, name="'legs' replica 1") as client:
            await client.score_tensors([[1, 2, 3]], [1])

    with pytest.raises(TeacherUnavailableError, match=rf"^teacher 'legs' replica 1 at {url}: /score: Client"):
        asyncio.run(score())
