"""`mopd-debug guard status | shell | run`: a real local guard (status, a dead guard's row, --json schema), the
srun argv and allocation checks on recorded `scontrol` text and real Slurm variables, and — on the real local
cluster, driven through a pty — a shell on a node of a running het job and `mopd-debug run` under `salloc`
stopped with Ctrl-C (no process, no lease, no allocation left)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_ports import free_port
from helpers_wait import wait_for

from mopd_hpc.launch.debug_session import (
    Allocation,
    AllocationShapeError,
    JobLookupError,
    OutsideAllocationError,
    check_fit,
    step_argvs,
)
from mopd_hpc.launch.debug_shell import job_run_dir, parse_scontrol_job, shell_argv
from mopd_hpc.launch.from_config import jobspec_from_config
from mopd_hpc.launch.rundir import prepare_run_dir
from mopd_hpc.plan.placement import place_children
from mopd_hpc.runtime.plan import JobPlan

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "slurm_het_cpu.yaml"
BIN = Path(sys.executable).parent
DEBUG = [sys.executable, "-m", "mopd_hpc.cli.debug"]
HOST = socket.gethostname()

# `scontrol show job -o 102` of a running probe job from configs/slurm_het_cpu.yaml on tools/slurm_local
# (Slurm 22.05.8), trimmed to the fields read and a few around them.
SCONTROL_HET_RUNNING = (
    "JobId=102 HetJobId=102 HetJobOffset=0 JobName=slurm-het-cpu HetJobIdSet=102-103 UserId=root(0) "
    "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:0 "
    "Partition=debug NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 ReqNodeList=(null) ExcNodeList=(null)\n"
    "JobId=103 HetJobId=102 HetJobOffset=1 JobName=slurm-het-cpu HetJobIdSet=102-103 UserId=root(0) "
    "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:0 "
    "Partition=debug NodeList=n[2-3] BatchHost=n2 NumNodes=2 NumCPUs=2 ReqNodeList=(null) ExcNodeList=(null)\n"
)


# ---- guard status on a real local guard ------------------------------------------------------------------
def test_guard_status_table_json_and_a_dead_guard(tmp_path: Path) -> None:
    rd = prepare_run_dir(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")} | {"MOPD_BACKEND": "local"}
    guard = subprocess.Popen(
        [*DEBUG[:2], "mopd_hpc.cli.guard", "--run-dir", str(rd.root), "--job-id", "local-dbg", "--host", HOST],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        from mopd_hpc.runtime.guard.client import GuardClient

        wait_for(lambda: (rd.root / "guards" / f"{HOST}.json").exists(), 30, "the guard record")
        client = GuardClient.from_run_dir(rd.root, HOST, rd.secret_file)
        held = client.spawn("probe", 0, env={"MOPD_PROBE_HOLD_S": "60"}, ports=["http", "nccl"])
        client.spawn("probe", 1, env={"MOPD_PROBE_EXIT_CODE": "3"})
        wait_for(
            lambda: client.status(role="probe", index=1)["children"][0]["state"] == "exited", 30, "probe 1"
        )
        # a guard whose node died: its record stays, nothing answers on its port
        dead_port = free_port()
        (rd.root / "guards" / "zz-dead.json").write_text(json.dumps({"url": f"http://127.0.0.1:{dead_port}"}))

        proc = subprocess.run(
            [*DEBUG, "guard", "status", str(rd.root), "--json"], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 1, proc.stderr  # one guard did not answer
        data = json.loads(proc.stdout)
        assert data["run_dir"] == str(rd.root)
        live, dead = data["nodes"]
        assert set(live) == {"host", "url", "reachable", "error", "children", "ports"}
        assert (live["host"], live["reachable"], live["error"]) == (HOST, True, None)
        kids = {c["index"]: c for c in live["children"]}
        assert set(kids[0]) == {"role", "index", "generation", "pid", "state", "exit_code", "signal", "ports",
                                "stdout", "stderr"}  # fmt: skip
        assert (kids[0]["state"], kids[0]["pid"], kids[0]["ports"]) == ("running", held["pid"], held["ports"])
        assert (kids[1]["state"], kids[1]["exit_code"], kids[1]["generation"]) == ("exited", 3, 1)
        assert sorted((p["name"], p["port"]) for p in live["ports"] if p["role"] == "probe") == sorted(
            held["ports"].items()
        )
        assert (dead["host"], dead["reachable"], dead["children"]) == ("zz-dead", False, [])
        assert "GuardUnreachableError" in dead["error"] and str(dead_port) in dead["error"]

        table = subprocess.run(
            [*DEBUG, "guard", "status", str(rd.root)], capture_output=True, text=True, timeout=60
        )
        rows = [line for line in table.stdout.splitlines() if HOST in line or "zz-dead" in line]
        assert any(
            "running" in r and str(held["pid"]) in r and f"http={held['ports']['http']}" in r for r in rows
        )
        assert any("exited" in r and " 3 " in r for r in rows)
        assert any("zz-dead" in r and "guard unreachable" in r for r in rows)
    finally:
        guard.send_signal(signal.SIGINT)
        guard.wait(timeout=30)
    # the guard removed its record on the way out; the dead one is the only one left
    assert sorted(p.name for p in (rd.root / "guards").iterdir()) == ["zz-dead.json"]
    (rd.root / "guards" / "zz-dead.json").unlink()
    proc = subprocess.run(
        [*DEBUG, "guard", "status", str(rd.root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "no guard record under" in proc.stderr


# ---- shell argv and allocation checks ---------------------------------------------------------------------
def test_shell_argv_picks_the_het_group_of_the_node() -> None:
    comps = parse_scontrol_job(SCONTROL_HET_RUNNING)
    assert [(c.job_id, c.het_group, c.state, c.nodes) for c in comps] == [
        ("102", 0, "RUNNING", ("n1",)), ("103", 1, "RUNNING", ("n2", "n3")),
    ]  # fmt: skip
    argv = shell_argv("102", comps, "n3", "/venv/bin/python")
    assert argv[:8] == ["srun", "--jobid=102", "--het-group=1", "--overlap", "--pty", "--nodes=1", "--ntasks=1",
                        "--nodelist=n3"]  # fmt: skip
    assert argv[8:10] == ["bash", "-c"]
    assert "-m mopd_hpc.cli.debug topology" in argv[10] and argv[10].endswith("exec bash -i")
    assert "job 102 het group 1 (component job 103), node n3" in argv[10]
    assert shell_argv("102", comps, None, "/p")[2:3] == ["--het-group=0"]
    assert "--nodelist=n1" in shell_argv("102", comps, None, "/p")
    with pytest.raises(JobLookupError, match=r"'n4' is not a node of job 102: its nodes are n1 \(het group 0\); "
                       r"n2,n3 \(het group 1\)"):  # fmt: skip
        shell_argv("102", comps, "n4", "/p")
    pending = parse_scontrol_job("JobId=7 JobName=x JobState=PENDING Reason=Resources NodeList=(null)\n")
    assert pending[0].nodes == () and pending[0].het_group is None
    with pytest.raises(JobLookupError, match="job 7 is not running .7 PENDING"):
        shell_argv("7", pending, None, "/p")
    plain = parse_scontrol_job("JobId=8 JobState=RUNNING NodeList=n[1-2] BatchHost=n1\n")
    argv = shell_argv("8", plain, "n2", "/p")
    assert not any(a.startswith("--het-group") for a in argv) and "--nodelist=n2" in argv


def _plan(tmp_path: Path) -> tuple[JobPlan, object]:
    from mopd_hpc.config import load_run_config

    cfg = load_run_config(CONFIG).model_copy(update={"run_dir": str(tmp_path / "run")})
    plan = place_children(cfg).as_probe()
    return plan, jobspec_from_config(cfg, tmp_path / "run", sys.executable, plan)


def test_allocation_must_fit_the_config(tmp_path: Path) -> None:
    plan, spec = _plan(tmp_path)
    with pytest.raises(OutsideAllocationError, match="SLURM_JOB_ID is unset: run it under salloc"):
        Allocation.from_env({"PATH": "/bin"})
    het = Allocation.from_env({
        "SLURM_JOB_ID": "106", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]", "SLURM_JOB_NODELIST": "n[1-3]",
    })  # fmt: skip
    assert het == Allocation("106", (("n1",), ("n2", "n3")), True, (None, None))  # no CPU counts: unchecked
    check_fit(het, plan)
    flat = Allocation.from_env({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]"})
    with pytest.raises(AllocationShapeError, match=r"not a het job \(3 node\(s\) n1,n2,n3\): allocate with "
                       r"`salloc -N1 : -N2 \.\.\.`"):  # fmt: skip
        check_fit(flat, plan)
    small = Allocation("10", (("n1",), ("n2",)), True)
    with pytest.raises(
        AllocationShapeError, match=r"het group 1 \(rollout\) needs 2 node\(s\), has 1 \(n2\)"
    ):
        check_fit(small, plan)
    (trainer, t_argv), (rollout, r_argv) = step_argvs(spec)
    assert (trainer, rollout) == ("trainer", "rollout")
    assert t_argv[:2] == ["srun", "--het-group=0"] and "--nodes=1" in t_argv and "--disable-status" in t_argv
    assert r_argv[:2] == ["srun", "--het-group=1"] and "--nodes=2" in r_argv and "--ntasks=2" in r_argv
    assert f"--output={tmp_path}/run/logs/rollout.debug.t%t.log" in r_argv
    sep = r_argv.index("--")
    assert r_argv[sep + 1 :] == list(spec.guard_command)
    assert r_argv[sep - 11 : sep] == [
        spec.launcher, "--het-group", "1", "--component", "rollout", "--roles", "probe",
        "--run-dir", str(tmp_path / "run"), "--secret-file", str(tmp_path / "run" / "guard.token"),
    ]  # fmt: skip


# ---- the real cluster, through a pty ------------------------------------------------------------------------
class Pty:
    """A command on its own pseudo-terminal (its controlling tty): write keys, read what the screen shows."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec the command on the pty
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        self.text = ""
        self.status: int | None = None

    def read(self, timeout_s: float = 0.1) -> str:
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if ready:
            try:
                self.text += os.read(self.fd, 65536).decode("utf-8", errors="replace")
            except OSError:  # EIO: the other side closed
                pass
        return self.text

    def expect(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.read())
            if match:
                return match
        pytest.fail(f"{pattern!r} did not appear within {timeout_s} s; the screen:\n{self.text[-3000:]}")

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.read(0.05)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
        pytest.fail(f"the pty command did not exit within {timeout_s} s; the screen:\n{self.text[-3000:]}")

    def close(self) -> None:
        if self.status is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        os.close(self.fd)


from test_slurm_jobs import (  # noqa: E402  (the real-cluster helpers: submit, reports, leases, processes)
    job_gone,
    job_processes,
    node_leases,
    reports,
    require_netns,
    stop,
    submit,
    wait_idle,
)

PROBE_HOSTS = ("n1", "n1", "n1", "n2", "n3")  # probe index -> node (trainer: actor, 2 teachers; 2 rollouts)


@pytest.mark.slurm
def test_shell_on_a_node_of_a_running_het_job(slurm_cluster, tmp_path: Path) -> None:
    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, run_dir, MOPD_PROBE_HOLD_S="300")
    try:
        wait_for(lambda: len(reports(run_dir)) == len(PROBE_HOSTS), 60, "the job's probe reports")
        shown = slurm_cluster.run(["scontrol", "show", "job", "-o", job_id], check=True).stdout
        assert job_run_dir(parse_scontrol_job(shown)) == str(run_dir)  # from the real StdOut (batch log)
        term = Pty([str(BIN / "mopd-debug"), "shell", job_id, "--node", "n3"], dict(slurm_cluster.env))
        try:
            term.expect(rf"mopd-debug shell: job {job_id} het group 1 \(component job \d+\), node n3", 30)
            term.expect(r"hostname[^\n]*n3", 30)  # the step's topology table, printed before the shell
            term.expect(r"job_id[^\n]*" + job_id, 5)
            term.expect(r"het_group\s*│\s*1\s", 5)
            term.expect(r"het_size\s*│\s*2\s", 5)  # the job's 2 components, not the step's view of 1
            term.send("echo JOB=$SLURM_JOB_ID; hostname\n")
            match = term.expect(r"JOB=(\d+)\r?\n(n\d)\r?\n", 30)
            assert match.groups() == (job_id, "n3")
            term.send('echo "RUN=$MOPD_RUN_DIR"\n')
            term.expect(rf"RUN={re.escape(str(run_dir))}\r?\n", 30)  # the run dir, in the shell itself
            term.send("exit\n")
            assert term.wait(30) == 0
        finally:
            term.close()
        # the shell was an extra step of the job, on n3 only: the job's own probes are untouched
        assert all(r["restart_count"] == 0 for r in reports(run_dir))
    finally:
        stop(slurm_cluster, job_id)


@pytest.mark.slurm
def test_run_refuses_an_allocation_of_the_wrong_shape(slurm_cluster, tmp_path: Path) -> None:
    wait_idle(slurm_cluster)
    proc = slurm_cluster.run(
        ["salloc", "-N1", "-w", "n4", str(BIN / "mopd-debug"), "run", str(CONFIG), "--probe", "--run-dir",
         str(tmp_path / "run")], check=False, timeout_s=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # the hint carries the CPUs per task of each group (the steps' srun needs them)
    assert "is not a het job (1 node(s) n4): allocate with `salloc -N1 -c2 : -N2 -c1 ...`" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written or started
    # the right groups and nodes, but the trainer's node without the 2 CPUs its task asks for
    proc = slurm_cluster.run(
        ["salloc", "-N1", ":", "-N2", str(BIN / "mopd-debug"), "run", str(CONFIG), "--probe", "--run-dir",
         str(tmp_path / "run")], check=False, timeout_s=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "het group 0 (trainer): cpus_per_task is 2 in the config, 1 in the allocation" in proc.stderr
    assert "allocate with `salloc -N1 -c2 : -N2 -c1 ...`" in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.slurm
def test_run_under_salloc_then_ctrl_c_leaves_no_process_and_no_lease(slurm_cluster, tmp_path: Path) -> None:
    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    argv = ["salloc", "-N1", "-c2", ":", "-N2", "-c2", str(BIN / "mopd-debug"), "run", str(CONFIG), "--probe"]
    term = Pty([*argv, "--run-dir", str(run_dir)], {**slurm_cluster.env, "MOPD_PROBE_HOLD_S": "300"})
    job_id = None
    try:
        job_id = term.expect(r"\[debug run\] job (\d+) \(trainer: n1, rollout: n2,n3\)", 90)[1]
        for index, host in enumerate(PROBE_HOSTS):  # live, role-prefixed child logs
            term.expect(rf"\[{host} probe-{index}\] probe: wrote", 60)
        got = reports(run_dir)
        assert [(r["host"], r["topology"]["job_id"]) for r in got] == [(h, job_id) for h in PROBE_HOSTS]
        assert {(r["plan_role"], r["topology"]["het_group"]) for r in got} == {
            ("actor", 0), ("teacher", 0), ("rollout", 1),
        }  # fmt: skip
        assert node_leases(slurm_cluster, "n2", job_id)  # the rollout's named ports are leased
        term.send("\x03")  # Ctrl-C
        assert term.wait(60) == 130
        assert "[debug run] interrupted: stopping the guards (SIGINT)" in term.text
        for host in ("n1", "n2", "n3"):
            assert f"[{host} guard] guard stop" in term.text
        wait_for(lambda: not job_processes(job_id), 10, f"no process of job {job_id} left")
        for host in ("n1", "n2", "n3"):
            wait_for(lambda h=host: not node_leases(slurm_cluster, h, job_id), 10, f"no lease on {host}")
        wait_for(lambda: job_gone(slurm_cluster, job_id), 30, f"allocation {job_id} released")
        assert not list((run_dir / "guards").glob("*.json"))  # every guard removed its record
    finally:
        term.close()
        if job_id is not None:
            stop(slurm_cluster, job_id)


@pytest.mark.slurm
def test_run_under_salloc_a_failing_rollout_ends_the_run_and_the_summary_names_it(
    slurm_cluster, tmp_path: Path
) -> None:
    from mopd_hpc.logs.summary import summarize_run

    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    knobs = {"MOPD_PROBE_HOLD_S": "300", "MOPD_PROBE_EXIT_CODE": "3", "MOPD_PROBE_EXIT_HET_GROUP": "1"}
    proc = subprocess.run(
        ["salloc", "-N1", "-c2", ":", "-N2", "-c2", str(BIN / "mopd-debug"), "run", str(CONFIG), "--probe", "--run-dir",
         str(run_dir)], env={**slurm_cluster.env, **knobs}, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\[debug run\] the step of rollout ended with code 3: stopping the others", proc.stdout)
    assert re.search(r"\[n[23] probe-[34]\] probe: exiting with 3 as MOPD_PROBE_EXIT_CODE asks", proc.stdout)
    job_id = json.loads((run_dir / "state" / "job.json").read_text())["job_id"]
    wait_for(lambda: job_gone(slurm_cluster, job_id), 30, f"allocation {job_id} released")
    s = summarize_run(run_dir)
    f = s.first_failure
    assert f is not None
    assert (f.cause.key, f.role, f.exit_code) == ("exit_code", "probe", 3)
    assert (f.host, f.index) in (("n2", 3), ("n3", 4))
    assert s.job.job_id == job_id
    trainer = {c.state for c in s.children if c.host == "n1"}
    assert trainer == {"killed"}  # stopped by their guard after the rollout failed: teardown
