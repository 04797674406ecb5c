"""Submission side effects: env scrubbing, the private run dir, node.sh, and sbatch through submitit.

`sbatch`, `sacct`, `squeue` and `scancel` are fake executables on PATH (shell stubs recording argv and
environment); submitit's own plumbing (`CommandFunction`, `JobPaths`, `Job`) runs for real.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mopd_hpc.launch import slurm as launch_slurm
from mopd_hpc.launch.env import scrub_slurm_env, submit_environment
from mopd_hpc.launch.jobspec import Component, JobSpec
from mopd_hpc.launch.render import render
from mopd_hpc.launch.rundir import RunDir, RunDirError, prepare_run_dir
from mopd_hpc.launch.slurm import HetInfoWatcher, HetSlurmExecutor, HetSlurmJob, SubmitError, submit
from mopd_hpc.runtime.jobids import JobState

REPO = Path(__file__).resolve().parents[2]
NODE_SH = REPO / "launchers" / "node.sh"

INHERITED = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOBID": "77",
    "SLURM_CPU_BIND": "quiet,mask_cpu:0x3",
    "SLURM_MEM_PER_CPU": "500",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURMD_NODENAME": "n1",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SBATCH_ACCOUNT": "inherited",
    "SALLOC_PARTITION": "debug",
    "SRUN_CPUS_PER_TASK": "4",
    "PMI_RANK": "0",
    "PMI_SIZE": "2",
    "PMIX_RANK": "0",
    "HOME": "/home/u",
    "MOPD_KEEP": "yes",
}


def test_scrub_removes_inherited_slurm_and_pmi_but_keeps_slurm_conf() -> None:
    env = scrub_slurm_env(INHERITED)
    assert env == {"SLURM_CONF": "/etc/slurm/slurm.conf", "HOME": "/home/u", "MOPD_KEEP": "yes"}
    assert INHERITED["SLURM_JOB_ID"] == "77"  # the input is not modified
    assert scrub_slurm_env(INHERITED, keep={"SLURM_CONF", "PMI_SIZE"})["PMI_SIZE"] == "2"


def test_submit_environment_scrubs_only_inside_an_allocation() -> None:
    inside = submit_environment(INHERITED)
    assert inside.inside_allocation
    assert set(inside.environ) == {"SLURM_CONF", "HOME", "MOPD_KEEP"}
    assert inside.removed == tuple(sorted(set(INHERITED) - {"SLURM_CONF", "HOME", "MOPD_KEEP"}))
    login = {"SBATCH_ACCOUNT": "mine", "HOME": "/home/u"}  # a user's own sbatch defaults on a login node
    outside = submit_environment(login)
    assert not outside.inside_allocation and outside.environ == login and outside.removed == ()


def test_prepare_run_dir_modes_and_idempotency(weird_tmp_path: Path) -> None:
    run = prepare_run_dir(weird_tmp_path / "run")
    assert run == RunDir.at(weird_tmp_path / "run")
    for path in (run.root, run.logs, run.state, run.submit):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE(run.secret_file.stat().st_mode) == 0o600
    token = run.secret_file.read_text()
    assert len(token.strip()) >= 32
    run.root.chmod(0o755)
    again = prepare_run_dir(run.root)
    assert again.secret_file.read_text() == token  # a resubmission keeps the token
    assert stat.S_IMODE(run.root.stat().st_mode) == 0o700  # and tightens the directory again
    run.secret_file.chmod(0o644)
    with pytest.raises(RunDirError, match="mode 0644: expected 0600"):
        prepare_run_dir(run.root)
    (weird_tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="is not a directory"):
        prepare_run_dir(weird_tmp_path / "file")


def test_node_sh_exports_het_group_and_execs_the_guard(weird_tmp_path: Path) -> None:
    guard = weird_tmp_path / "guard"
    guard.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'pid': os.getpid(), "
        "'env': {k: v for k, v in os.environ.items() if k.startswith('MOPD_')}}))\n"
    )
    guard.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "14"}
    run_dir = str(weird_tmp_path / "run")
    argv = [
        str(NODE_SH),
        "--het-group",
        "1",
        "--component",
        "rollout",
        "--roles",
        "rollout",
        "--run-dir",
        run_dir,
        "--secret-file",
        run_dir + "/guard.token",
        "--",
        str(guard),
        "--flag",
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    out = json.loads(proc.communicate(timeout=30)[0])
    assert proc.returncode == 0
    assert out["pid"] == proc.pid  # exec, not a child: Slurm's signals reach the guard itself
    assert out["argv"] == ["--flag", "--run-dir", run_dir, "--job-id", "14"]
    assert out["env"] == {
        "MOPD_HET_GROUP": "1",
        "MOPD_COMPONENT": "rollout",
        "MOPD_ROLES": "rollout",
        "MOPD_RUN_DIR": run_dir,
        "MOPD_SECRET_FILE": run_dir + "/guard.token",
    }


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--het-group", "x", "--component", "a", "--run-dir", "/r", "--", "true"],
            {"SLURM_JOB_ID": "1"},
            "--het-group 'x'",
        ),
        (
            ["--het-group", "0", "--component", "a", "--run-dir", "/r"],
            {"SLURM_JOB_ID": "1"},
            "no guard command",
        ),
        (
            ["--het-group", "0", "--component", "a", "--run-dir", "/r", "--", "true"],
            {},
            "SLURM_JOB_ID is unset",
        ),
        (["--bogus"], {"SLURM_JOB_ID": "1"}, "unknown argument '--bogus'"),
    ],
)
def test_node_sh_usage_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    done = subprocess.run(
        [str(NODE_SH), *argv],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr


FAKE_SBATCH = r"""#!/bin/bash
printf '%s\n' "$@" >"$FAKE_DIR/sbatch.argv"
env >"$FAKE_DIR/sbatch.env"
cp "${@: -1}" "$FAKE_DIR/sbatch.script"
[[ -n ${FAKE_SBATCH_FAIL:-} ]] && { echo "sbatch: error: Batch job submission failed: Invalid account" >&2; exit 1; }
echo "4242;cluster"
"""
FAKE_SACCT = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_DIR/sacct.calls"
[[ -n ${FAKE_SACCT_FAIL:-} ]] && { echo "Slurm accounting storage is disabled" >&2; exit 1; }
printf 'JobID|JobName|State|ExitCode|Restarts|NodeList\n4242+0|x|RUNNING|0:0|0|n1\n4242+0.0|node.sh|RUNNING|0:0||n1\n4242+1|x|FAILED|1:0|0|n[2-3]\n'
"""
FAKE_SQUEUE = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_DIR/squeue.calls"
printf '4242+0|COMPLETING|n1|None\n4242+1|COMPLETING|n[2-3]|None\n'
"""
FAKE_SCANCEL = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_DIR/scancel.calls"
"""


@pytest.fixture()
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin dir with fake sbatch/sacct/squeue/scancel, first on PATH; FAKE_DIR is where they record."""
    bin_dir, fake = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir()
    fake.mkdir()
    for name, text in (
        ("sbatch", FAKE_SBATCH),
        ("sacct", FAKE_SACCT),
        ("squeue", FAKE_SQUEUE),
        ("scancel", FAKE_SCANCEL),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(fake))
    monkeypatch.setattr(HetSlurmJob, "watcher", HetInfoWatcher(delay_s=0))
    return fake


def _spec(run_dir: Path) -> JobSpec:
    return JobSpec.heterogeneous(
        job_name="fake",
        run_dir=str(run_dir),
        trainer=Component(het_group=0, name="trainer", nodes=1, roles=("actor",)),
        rollout=Component(het_group=1, name="rollout", nodes=2, roles=("rollout",)),
        launcher=str(NODE_SH),
        guard_command=("mopd-guard",),
        secret_file=str(RunDir.at(run_dir).secret_file),
    )


def test_submit_runs_sbatch_with_scrubbed_env_and_folds_het_state(
    weird_tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = weird_tmp_path / "run"
    request = render(_spec(run_dir))
    environ = {**INHERITED, "PATH": os.environ["PATH"], "FAKE_DIR": str(fake_slurm)}
    job = submit(request, environ)
    assert isinstance(job, HetSlurmJob) and job.job_id == "4242"
    # The run dir and token exist before sbatch ran; the script went in as rendered.
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "guard.token").stat().st_mode) == 0o600
    assert (fake_slurm / "sbatch.script").read_text() == request.script
    argv = (fake_slurm / "sbatch.argv").read_text().splitlines()
    assert argv[:1] == ["--parsable"] and Path(argv[1]).parent == run_dir / "submit"
    assert (run_dir / "submit" / "4242_submission.sh").read_text() == request.script
    env_names = {
        line.split("=", 1)[0] for line in (fake_slurm / "sbatch.env").read_text().splitlines() if "=" in line
    }
    leaked = {
        n for n in env_names if n.startswith(("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SRUN_", "PMI"))
    }
    assert leaked == {"SLURM_CONF"}
    assert "MOPD_KEEP" in env_names
    # State: sacct rows 4242+0 / 4242+1 folded under 4242.
    status = job.status()
    assert status.source == "sacct" and [c.job_id.component for c in status.components] == [
        "4242+0",
        "4242+1",
    ]
    assert job.state == "RUNNING" and job.job_state is JobState.RUNNING
    assert (fake_slurm / "sacct.calls").read_text().split()[-1] == "--jobs=4242"
    # Without accounting the watcher asks squeue.
    monkeypatch.setenv("FAKE_SACCT_FAIL", "1")
    status = job.status()
    assert status.source == "squeue" and status.state is JobState.RUNNING
    job.cancel()
    assert (fake_slurm / "scancel.calls").read_text().splitlines() == ["4242"]


def test_submit_errors(tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    request = render(_spec(tmp_path / "run"))
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "1")
    with pytest.raises(SubmitError, match="Invalid account"):
        submit(request, dict(os.environ))
    with pytest.raises(SubmitError, match="sbatch is not on PATH"):
        HetSlurmExecutor(tmp_path / "submit", {"PATH": str(tmp_path / "nowhere")})
    with pytest.raises(SubmitError, match="contains '%'"):
        HetSlurmExecutor(tmp_path / "a%j", dict(os.environ))
    wrong = render(_spec(tmp_path / "run2").replace(secret_file=str(tmp_path / "elsewhere.token")))
    with pytest.raises(SubmitError, match="expected .*run2/guard.token"):
        submit(wrong, dict(os.environ))
    executor = HetSlurmExecutor(tmp_path / "submit", dict(os.environ))
    with pytest.raises(SubmitError, match="submits rendered scripts only"):
        executor.submit(print, "x")


@pytest.mark.parametrize(
    ("output", "job_id"), [("4242\n", "4242"), ("17;c1", "17"), ("Submitted batch job 99\n", "99")]
)
def test_sbatch_output_parsing(output: str, job_id: str) -> None:
    assert launch_slurm.HetSlurmExecutor._get_job_id_from_submission_command(output) == job_id
    with pytest.raises(SubmitError, match="could not read a job id"):
        launch_slurm.HetSlurmExecutor._get_job_id_from_submission_command("sbatch: error: nope")


def test_cpu_threads_budget_is_affinity_capped_by_slurm_cpus_per_task() -> None:
    import os

    from mopd_hpc.roles.env import RoleEnvError, cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads({}) == cores
    assert cpu_threads({}, share=2) == max(1, cores // 2)
    assert cpu_threads({}, share=10 * cores) == 1  # never 0
    assert cpu_threads({"SLURM_CPUS_PER_TASK": "1"}) == 1  # the task asked for 1 CPU: 1 thread
    assert cpu_threads({"SLURM_CPUS_PER_TASK": str(cores + 8)}) == cores  # never above the affinity
    with pytest.raises(RoleEnvError, match="SLURM_CPUS_PER_TASK='two': expected a positive integer"):
        cpu_threads({"SLURM_CPUS_PER_TASK": "two"})
    # OMP_NUM_THREADS caps it (the test suite's parallel workers set 1), never raises it
    assert cpu_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert cpu_threads({"OMP_NUM_THREADS": str(cores + 8)}) == cores
    assert cpu_threads({"OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": str(cores)}, share=1) == 1
    with pytest.raises(RoleEnvError, match="OMP_NUM_THREADS='0': expected a positive integer"):
        cpu_threads({"OMP_NUM_THREADS": "0"})
