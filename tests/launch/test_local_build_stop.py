"""Stopping `mopd-submit --local` while it builds the tiny models leaves no build process behind: SIGTERM and
Ctrl-C kill the builder's process group (grandchildren included), and a SIGKILLed parent takes the builder with
it (parent-death signal). The parent is a real subprocess running `local_setup.build_tiny_models`, the code
path `prepare_local_run` takes; the builder is a stand-in that starts a grandchild, says so, and sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers_wait import wait_for

REPO = Path(__file__).resolve().parents[2]

STAND_IN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("pids", __import__("os").getpid(), child.pid, flush=True)
time.sleep(300)
"""

PARENT = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever the test worker inherited
from pathlib import Path
from mopd_hpc.launch.local_setup import build_tiny_models
build_tiny_models(Path(sys.argv[1]), sys.executable, sys.stdout, builder=Path(sys.argv[2]))
"""


def alive(pid: int) -> bool:
    """A live (non-zombie) process of this pid exists."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_build(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """The parent, mid-build: returns it and the pids of the builder and its grandchild."""
    builder = tmp_path / "stand_in_builder.py"
    builder.write_text(textwrap.dedent(STAND_IN))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "models"), str(builder)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert parent.stdout is not None
    seen = []
    while True:
        line = parent.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
        if line.startswith("[build] pids "):
            break
    assert seen[0].startswith("[local] building the tiny models into ")
    pids = [int(p) for p in line.split()[2:]]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    return parent, pids


@pytest.mark.parametrize(("signum", "rc"), [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_stopped_submit_kills_the_whole_build(tmp_path: Path, signum: int, rc: int) -> None:
    parent, pids = start_build(tmp_path)
    try:
        parent.send_signal(signum)  # to the parent only, as `kill PID` would (Ctrl-C reaches it the same way)
        out, _ = parent.communicate(timeout=60)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert parent.returncode == rc, (
        out
    )  # SIGTERM: 128 + 15; Ctrl-C: an uncaught KeyboardInterrupt (mopd-submit makes it 130)
    assert "the tiny-model build into" in out and "was killed" in out
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the builder and its child to be gone")


def test_a_killed_submit_takes_the_builder_with_it(tmp_path: Path) -> None:
    parent, pids = start_build(tmp_path)
    builder = pids[0]
    try:
        parent.kill()  # no handler runs: only the parent-death signal can stop the builder
        parent.wait(timeout=30)
        wait_for(lambda: not alive(builder), 10, "the builder to die with its parent")
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
