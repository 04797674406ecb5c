"""Four user-visible rough edges, pinned: the dry-run rank map shows the weight sync the config uses (AWEX
transfer ranks only for awex, the broadcast group for torch); `mopd-debug shell` gives the step the run dir
and the job's het size, and `mopd-submit` prints a ports line per het group; `mopd-debug run` checks the
allocation's CPUs per task; `mopd-logs summarize | head` exits quietly with 141 as `tail` does."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mopd_hpc.cli import debug_run, debug_shell, submit
from mopd_hpc.config import load_run_config
from mopd_hpc.launch import start
from mopd_hpc.launch.debug_session import Allocation, AllocationShapeError, check_fit
from mopd_hpc.launch.debug_shell import job_run_dir, parse_scontrol_job, shell_argv
from mopd_hpc.launch.rankmap import broadcast_rank, rank_map_rows
from mopd_hpc.logs.index import append_job_index
from mopd_hpc.plan.placement import place_children

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
HET = (
    CONFIGS / "slurm_het_cpu.yaml"
)  # weight_sync.backend: torch; trainer -c2 (1 node), rollout -c1 (2 nodes)
AWEX = CONFIGS / "qwen3_8gpu_colocated.yaml"  # weight_sync.backend: awex, awex_mode: colocate


def dry_run(config: Path, *flags: str) -> str:
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args([str(config), "--dry-run", *flags])
    assert submit.execute(args, out=out, err=err, environ={}, python=sys.executable) == 0, err.getvalue()
    return out.getvalue()


# ---- 1. the rank map follows weight_sync.backend ------------------------------------------------------
def test_torch_sync_rank_map_shows_the_broadcast_group_not_awex() -> None:
    text = dry_run(HET)
    assert "AWEX" not in text and "transfer" not in text
    assert "; torch broadcast world 1 + 2 = 3 (trainer rank 0 to 2 rollout engine(s))" in text
    assert "torch broadcast rank" in text
    rows = rank_map_rows(place_children(load_run_config(HET)), "torch")
    assert [(r["role"], r["index"], r["broadcast_rank"]) for r in rows] == [
        ("actor", "0", "0 (source)"), ("teacher", "0", "-"), ("teacher", "1", "-"),
        ("rollout", "0", "1"), ("rollout", "1", "2"),
    ]  # fmt: skip
    assert all("transfer_rank" not in r for r in rows)
    # a probe plan keeps the ranks of the roles the probes stand in for
    probe = dry_run(HET, "--probe")
    line = next(x for x in probe.splitlines() if "rollout (probe 4)" in x)
    assert line.rstrip(" │").endswith("│ 2")


def test_broadcast_rank_is_the_torch_sender_layout() -> None:
    # engines/weight_sync/torch.py: the trainer joins as rank 0, server i as rank 1 + i; no one else joins
    assert [broadcast_rank("rollout", i) for i in range(4)] == [1, 2, 3, 4]
    assert (broadcast_rank("actor", 0), broadcast_rank("actor", 1), broadcast_rank("teacher", 0)) == (
        0,
        None,
        None,
    )


def test_awex_sync_rank_map_keeps_the_transfer_ranks_and_names_the_mode() -> None:
    text = dry_run(AWEX)
    assert "AWEX infer world 8 + train world 8 = 16 (awex_mode colocate)" in text
    assert "AWEX transfer rank" in text and "broadcast" not in text
    rows = rank_map_rows(place_children(load_run_config(AWEX)), "awex")
    assert [r["transfer_rank"] for r in rows if r["role"] == "rollout"] == [str(i) for i in range(8)]
    with pytest.raises(
        ValueError, match=r"weight_sync backend='nccl': expected one of \('awex', 'torch', 'ipc'\)"
    ):
        rank_map_rows(place_children(load_run_config(AWEX)), "nccl")


# ---- 2. mopd-debug shell: run dir and het size; a ports line per het group ------------------------------
def scontrol_text(run_dir: str | None) -> str:
    """`scontrol show job -o 102` of a running 2-group job (fields as tests/launch/test_debug_sessions.py records)."""
    out = f" StdOut={run_dir}/logs/batch.102.log" if run_dir else ""
    return (
        "JobId=102 HetJobId=102 HetJobOffset=0 JobName=slurm-het-cpu JobState=RUNNING Partition=debug "
        f"NodeList=n1 BatchHost=n1 NumNodes=1 StdErr=/x/logs/batch.102.log StdIn=/dev/null{out} Power=\n"
        "JobId=103 HetJobId=102 HetJobOffset=1 JobName=slurm-het-cpu JobState=RUNNING Partition=debug "
        f"NodeList=n[2-3] BatchHost=n2 NumNodes=2 StdIn=/dev/null{out} Power=\n"
    )


def run_shell_script(argv: list[str], step_env: dict[str, str], stdin: str) -> str:
    """Run the shell's `bash -c SCRIPT` (what srun starts on the node) in a step-like environment."""
    assert argv[-3:-1] == ["bash", "-c"]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **step_env}
    proc = subprocess.run(
        ["bash", "-c", argv[-1]],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_shell_exports_the_run_dir_and_the_het_size(weird_tmp_path: Path) -> None:
    run_dir = str(weird_tmp_path / "run")
    comps = parse_scontrol_job(scontrol_text(run_dir))
    assert job_run_dir(comps) == run_dir  # from StdOut=<run_dir>/logs/batch.<id>.log, hostile path and all
    assert job_run_dir(parse_scontrol_job(scontrol_text(None))) is None
    argv = shell_argv("102", comps, "n3", sys.executable, run_dir=run_dir)
    assert argv[:3] == ["srun", "--jobid=102", "--het-group=1"]
    # an srun from outside the batch shell: a het-group-1 step on n3 with no SLURM_HET_* variable
    step = {
        "SLURM_JOB_ID": "102", "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n3", "SLURM_JOB_NODELIST": "n3", "SLURMD_NODENAME": "n3",
    }  # fmt: skip
    out = run_shell_script(
        argv, step, 'echo "RUN=$MOPD_RUN_DIR|GROUP=$MOPD_HET_GROUP|SIZE=$SLURM_HET_SIZE"\n'
    )
    assert f"mopd-debug shell: job 102 het group 1 (component job 103), node n3; run dir {run_dir};" in out
    assert f"RUN={run_dir}|GROUP=1|SIZE=2" in out  # in the interactive shell itself
    topo = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if "│" in line
    }
    assert (topo["het_group"], topo["het_size"], topo["hostname"], topo["job_id"]) == ("1", "2", "n3", "102")


def test_shell_run_dir_from_the_job_index_when_scontrol_has_no_batch_log(tmp_path: Path) -> None:
    state = tmp_path / "state"
    entry = {
        "job_id": "102",
        "run_dir": str(tmp_path / "run"),
        "name": "x",
        "submitted_at": 0.0,
        "config": "/c",
    }
    append_job_index(entry, state)
    argv = debug_shell.build("102", "n1", lambda _id: scontrol_text(None), {"XDG_STATE_HOME": str(state)})
    assert f"export MOPD_RUN_DIR={tmp_path / 'run'} SLURM_HET_SIZE=2 MOPD_HET_GROUP=0;" in argv[-1]
    unknown = debug_shell.build(
        "102", "n1", lambda _id: scontrol_text(None), {"XDG_STATE_HOME": str(tmp_path)}
    )
    assert (
        "MOPD_RUN_DIR" not in unknown[-1].split(";")[0]
        and "run dir unknown (MOPD_RUN_DIR unset)" in unknown[-1]
    )
    plain = parse_scontrol_job("JobId=8 JobState=RUNNING NodeList=n[1-2] StdOut=/r/logs/batch.8.log\n")
    assert shell_argv("8", plain, "n2", "/p", run_dir=job_run_dir(plain))[-1].startswith(
        "export MOPD_RUN_DIR=/r; echo"
    )  # not a het job: no SLURM_HET_SIZE / MOPD_HET_GROUP


def test_submit_prints_a_ports_line_for_every_het_group(tmp_path: Path) -> None:
    debug = tmp_path / "bin" / "mopd-debug"
    het = start.ports_commands("77", place_children(load_run_config(HET)), debug)
    assert het == [
        f"srun --jobid=77 --het-group=0 --overlap {debug} ports   # leases on the trainer nodes",
        f"srun --jobid=77 --het-group=1 --overlap {debug} ports   # leases on the rollout nodes",
    ]
    colocated = start.ports_commands("78", place_children(load_run_config(AWEX)), debug)
    assert colocated == [f"srun --jobid=78 --overlap {debug} ports   # leases on its nodes"]


def test_submit_through_a_fake_sbatch_prints_both_ports_lines(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text("#!/bin/sh\necho 4242\n")
    (bindir / "sbatch").chmod(0o755)
    environ = {"PATH": f"{bindir}:{os.environ['PATH']}", "XDG_STATE_HOME": str(tmp_path / "state")}
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    args = parser.parse_args([str(HET), "--probe", "--run-dir", str(tmp_path / "run")])
    out, err = io.StringIO(), io.StringIO()
    assert submit.execute(args, out=out, err=err, environ=environ, python=sys.executable) == 0, err.getvalue()
    lines = [x.strip() for x in out.getvalue().splitlines() if x.strip().startswith("srun ")]
    debug = Path(sys.executable).parent / "mopd-debug"
    assert lines == [
        f"srun --jobid=4242 --het-group={g} --overlap {debug} ports   # leases on the {name} nodes"
        for g, name in ((0, "trainer"), (1, "rollout"))
    ]


# ---- 3. mopd-debug run: CPUs per task ----------------------------------------------------------------
def het_env(cpus0: str, cpus1: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "106", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]", "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0": cpus0,
        "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1": cpus1,
    }  # fmt: skip


def test_check_fit_compares_cpus_per_task_with_the_config() -> None:
    cfg = load_run_config(HET)
    plan = place_children(cfg)
    cpus = [g.cpus_per_task for g in cfg.cluster.groups().values()]
    assert cpus == [2, 1]
    short = Allocation.from_env(het_env("1", "2(x2)"))  # `salloc -N1 : -N2 -c2`: the trainer node has 1 CPU
    assert short.cpus_per_node == (1, 2)
    with pytest.raises(AllocationShapeError) as info:
        check_fit(short, plan, cpus)
    assert str(info.value) == (
        "allocation 106 does not fit config 'slurm-het-cpu': het group 0 (trainer): cpus_per_task is 2 in the "
        "config, 1 in the allocation (the fewest CPUs on one of its nodes, SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0; "
        "its steps run one task per node): allocate with `salloc -N1 -c2 : -N2 -c1 ...`"
    )
    with pytest.raises(
        AllocationShapeError, match=r"het group 1 \(rollout\): cpus_per_task is 3 in the config, 1 "
    ):
        check_fit(Allocation.from_env(het_env("2", "2,1")), plan, [2, 3])  # the fewest node counts
    check_fit(Allocation.from_env(het_env("2", "1(x2)")), plan, cpus)  # exactly enough
    check_fit(Allocation.from_env(het_env("4", "2(x2)")), plan, cpus)  # more is fine
    check_fit(short, plan)  # no config CPUs given: nodes only
    with pytest.raises(AllocationShapeError, match=r"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1='two': count list"):
        Allocation.from_env(het_env("2", "two"))
    plain = Allocation.from_env(
        {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_CPUS_PER_NODE": "1"}
    )
    local = load_run_config(CONFIGS / "local_cpu.yaml")
    with pytest.raises(AllocationShapeError, match=r"het group 0 \(group\): cpus_per_task is 2 in the config, 1 in "
                       r"the allocation \(the fewest CPUs on one of its nodes, SLURM_JOB_CPUS_PER_NODE;"):  # fmt: skip
        check_fit(plain, place_children(local), [local.cluster.group.cpus_per_task])


def test_debug_run_refuses_too_few_cpus_before_writing_anything(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    debug_run.add_arguments(parser)
    args = parser.parse_args([str(HET), "--probe", "--run-dir", str(tmp_path / "run")])
    out, err = io.StringIO(), io.StringIO()
    environ = {"PATH": os.environ["PATH"], **het_env("2", "2(x2)")}
    environ["SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0"] = "1"
    assert debug_run.execute(args, out=out, err=err, environ=environ, python=sys.executable) == 2
    assert "het group 0 (trainer): cpus_per_task is 2 in the config, 1 in the allocation" in err.getvalue()
    assert "allocate with `salloc -N1 -c2 : -N2 -c1 ...`" in err.getvalue()
    assert not (tmp_path / "run").exists() and out.getvalue() == ""


def test_debug_run_outside_salloc_refuses_before_the_job_is_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No SLURM_JOB_ID: the refusal comes first (preparing resolves the models: tens of seconds for a hub
    config), with the salloc command that fits the config read from its het groups alone."""
    from mopd_hpc.launch import prepare

    def not_called(*_a: object, **_k: object) -> None:
        raise AssertionError("prepare_job ran before the allocation was checked")

    monkeypatch.setattr(prepare, "prepare_job", not_called)
    parser = argparse.ArgumentParser()
    debug_run.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    args = parser.parse_args([str(HET), "--run-dir", str(tmp_path / "run")])
    assert debug_run.execute(args, out=out, err=err, environ={"PATH": "/bin"}, python=sys.executable) == 2
    assert err.getvalue() == (
        "mopd-debug run: mopd-debug run starts the job's steps inside an allocation, but SLURM_JOB_ID is unset: "
        "run it under salloc, e.g. `salloc -N1 : -N2 mopd-debug run run.yaml` for a 2-group het job; for this "
        f"config: `salloc -N1 -c2 : -N2 -c1 mopd-debug run {HET}`\n"
    )
    assert not (tmp_path / "run").exists() and out.getvalue() == ""
    bad = tmp_path / "bad.yaml"  # a config that does not load: the plain refusal, still before any preparing
    bad.write_text("cluster: [\n")
    err = io.StringIO()
    args = parser.parse_args([str(bad)])
    assert debug_run.execute(args, out=out, err=err, environ={"PATH": "/bin"}, python=sys.executable) == 2
    assert err.getvalue().endswith("for a 2-group het job\n")


# ---- 4. mopd-logs summarize into a closed pipe -------------------------------------------------------
def test_summarize_into_a_closed_pipe_exits_141_quietly(tmp_path: Path) -> None:
    """`mopd-logs summarize RUN | head -3`: the reader is gone before the summary is written; exit 141 (128 +
    SIGPIPE) without a traceback, as `mopd-logs tail` does, not rich's exit 1 (a failed run's code)."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "job.json").write_text(json.dumps({"job_id": "4242", "restart_count": 0}))
    argv = [sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", "--no-sacct", str(tmp_path)]
    whole = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert whole.returncode == 0 and "job 4242" in whole.stdout, whole.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) is gone before anything is written
    try:
        proc = subprocess.run(
            argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == ""


def test_summary_of_a_probe_run_says_so(tmp_path: Path) -> None:
    """A probe run writes no metrics; the summary says it was a probe run, not 'no metrics yet'."""
    run_dir = tmp_path / "probe"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    submitted = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(REPO / "configs" / "local_cpu.yaml"), "--local",
         "--probe", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    summary = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(run_dir)],
        capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "160"},
    )  # fmt: skip
    assert summary.returncode == 0, summary.stderr[-2000:]
    assert "probe run: the children report their environment and exit" in summary.stdout
    assert "no metrics yet" not in summary.stdout
