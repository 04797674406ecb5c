"""One job per run dir (runtime/run_lock.py): a second `mopd-submit --local` on a run dir a running job holds
exits 2 naming the holder (job id, host, pid) before it writes anything, and the first completes normally;
a guard of another job is refused at start (exit 3), a guard of the same job joins; the kernel frees the lock
when its holder dies (SIGKILL included). Real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_wait import until
from test_guard import HOST, JOB, start_guard, stop_guard
from test_local_backend import REPO, reports, start

from mopd_hpc.runtime.run_lock import LOCK_FILE_NAME, RunDirLockedError, acquire, holder_of


def test_a_second_local_run_on_the_same_run_dir_exits_2_naming_the_first(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # the first job holds long enough for the second to start on a loaded machine (parallel test workers)
    first = start("local_cpu.yaml", run_dir, MOPD_PROBE_HOLD_S="45")
    try:
        assert until(lambda: len(list((run_dir / "probe").glob("*.json"))) == 4, 120), first.stderr
        plan_before = (run_dir / "plan.json").read_text()
        config_before = (run_dir / "config.yaml").read_text()
        second = start("local_cpu.yaml", run_dir, MOPD_PROBE_HOLD_S="6")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, err + out
        job = f"local-{first.pid}"
        # --check's warnings come first where the tiny models are not built yet (a fresh clone: .cache/models)
        err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("# warning: "))
        assert err.startswith(
            f"mopd-submit: run dir {run_dir} is in use by job {job} (host {socket.gethostname()}, pid {first.pid} since "
        ), err
        assert "use another --run-dir" in err and "Traceback" not in err
        assert out == ""
        assert (run_dir / "plan.json").read_text() == plan_before  # nothing of the first run was touched
        assert (run_dir / "config.yaml").read_text() == config_before
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err + out
    assert "[local] done: exit code 0" in out and len(reports(run_dir)) == 4
    assert holder_of(run_dir) is None  # released with the job: the next run may start
    third = start("local_cpu.yaml", run_dir)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0, err + out


def test_a_guard_of_another_job_is_refused_at_start_one_of_the_same_job_joins(tmp_path: Path) -> None:
    g = start_guard(tmp_path)
    try:
        holder = json.loads((g.run_dir / LOCK_FILE_NAME).read_text())
        assert (holder["job_id"], holder["host"], holder["pid"]) == (JOB, HOST, g.proc.pid)

        def other_guard(job: str) -> subprocess.Popen[str]:
            argv = [sys.executable, "-m", "mopd_hpc.cli.guard", "--run-dir", str(g.run_dir), "--job-id", job]
            argv += ["--host", "otherhost"]
            return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        refused = other_guard("j2")
        out, err = refused.communicate(timeout=60)
        assert refused.returncode == 3, err
        assert err.startswith(
            f"mopd-guard: run dir {g.run_dir} is in use by job {JOB} (host {HOST}, pid {g.proc.pid}"
        )
        assert not (g.run_dir / "guards" / "otherhost.json").exists()
        joined = other_guard(JOB)  # another node's guard of the same job
        try:
            assert until((g.run_dir / "guards" / "otherhost.json").exists, 30), joined.stderr
        finally:
            joined.send_signal(signal.SIGINT)
            joined.communicate(timeout=30)
        assert joined.returncode == 0
    finally:
        stop_guard(g)


def test_the_kernel_frees_the_lock_when_its_holder_dies(tmp_path: Path) -> None:
    code = "import sys, time; from mopd_hpc.runtime.run_lock import acquire; acquire(sys.argv[1], 'j9', 'h9')"
    code += "; print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirLockedError, match=rf"in use by job j9 \(host h9, pid {holder.pid} since "):
            acquire(tmp_path, "j10", "h10")
        render = subprocess.run(  # a submission (here --render) only checks, and is refused the same way
            [sys.executable, "-m", "mopd_hpc.cli.submit", str(REPO / "configs" / "slurm_het_cpu.yaml"),
             "--render", str(tmp_path / "job.sbatch"), "--run-dir", str(tmp_path)],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert render.returncode == 2, render.stderr
        assert (
            f"mopd-submit: run dir {tmp_path} is in use by job j9 (host h9, pid {holder.pid}" in render.stderr
        )
        assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "plan.json").exists()
        record = holder_of(tmp_path)
        assert record is not None and (record["job_id"], record["host"], record["pid"]) == (
            "j9",
            "h9",
            holder.pid,
        )
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert holder_of(tmp_path) is None  # the record is still there, the lock is not
        lock = acquire(tmp_path, "j10", "h10")
        assert lock.held and json.loads((tmp_path / LOCK_FILE_NAME).read_text())["job_id"] == "j10"
        assert acquire(tmp_path, "j10", "h11").held is False  # the same job joins
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    assert os.stat(tmp_path / LOCK_FILE_NAME).st_mode & 0o777 == 0o600
