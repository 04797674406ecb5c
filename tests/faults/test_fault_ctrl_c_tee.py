"""Fault: Ctrl-C on `mopd-submit --local ... | tee out` — the terminal sends SIGINT to the whole foreground
group, so `tee` dies with the submit process still writing into the pipe.

Kept: mopd-submit exits 130 (SIGINT), writes no traceback (no BrokenPipeError) on its stderr, and leaves no
process of the job behind (guard, keeper, children); the run dir keeps the guard's events of the stop.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from helpers_wait import until
from test_local_backend import REPO, env_for, processes_of, reports


def test_ctrl_c_through_tee_is_a_clean_exit_without_orphans(tmp_path: Path) -> None:
    run_dir, err, rc_file = tmp_path / "run", tmp_path / "submit.err", tmp_path / "submit.rc"
    submit = [sys.executable, "-m", "mopd_hpc.cli.submit", "configs/local_cpu.yaml", "--local", "--probe"]
    pipeline = (
        f"{shlex.join([*submit, '--run-dir', str(run_dir)])} 2>{shlex.quote(str(err))} "
        f"| tee {shlex.quote(str(tmp_path / 'out.txt'))}; echo ${{PIPESTATUS[0]}} > {shlex.quote(str(rc_file))}"
    )
    shell = subprocess.Popen(
        ["bash", "-c", pipeline], cwd=REPO, env=env_for(MOPD_PROBE_HOLD_S="120"), start_new_session=True
    )
    try:
        assert until(lambda: len(reports(run_dir)) == 4, 120), err.read_text()
        os.killpg(shell.pid, signal.SIGINT)  # Ctrl-C: the foreground group, submit and tee alike
        shell.wait(timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert rc_file.read_text().strip() == str(128 + signal.SIGINT)
    text = err.read_text()
    assert "Traceback" not in text and "BrokenPipe" not in text, text
    assert until(lambda: processes_of(run_dir) == [], 15), processes_of(run_dir)
    events = (run_dir / "events").glob("*.guard.jsonl")
    assert any('"guard_stop"' in p.read_text() for p in events)
