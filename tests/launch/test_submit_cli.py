"""`mopd-submit --dry-run / --render / --resume / --probe`: real subprocesses, no Slurm needed (sbatch is not on
PATH here), and `execute()` with its streams passed in."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

from mopd_hpc.cli import submit
from mopd_hpc.config import load_run_config
from mopd_hpc.launch import prepare, start
from mopd_hpc.plan.placement import place_children

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def no_slurm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOPD_"))}
    env["PATH"] = str(Path(sys.executable).parent)  # the venv only: no sbatch
    return env


def mopd_submit(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=cwd, env=no_slurm_env(), check=False,
    )  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_dry_run_prints_the_script_and_the_rank_map_without_slurm(tmp_path: Path) -> None:
    assert not any((Path(p) / "sbatch").exists() for p in no_slurm_env()["PATH"].split(os.pathsep))
    proc = mopd_submit(  # AWEX (into sglang: not run by the job yet) prints its transfer world
        "--dry-run",
        CONFIGS / "qwen3_coder_4node.yaml",
        "--run-dir",
        tmp_path / "run",
        "--set",
        "weight_sync.backend=awex",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # the --check warnings (one a line), then the rank map, then the script (sbatch command first)
    lines = out.splitlines()
    first_other = next(i for i, line in enumerate(lines) if not line.startswith("# warning: "))
    assert first_other >= 3 and lines[first_other].startswith("rank map of 'qwen3-coder")
    assert out.index("72 children") < out.index("sbatch --parsable $SBATCH_SCRIPT")
    assert any(
        w.startswith("# warning: rollout.backend: the sglang backend has been tested with a stand-in")
        for w in lines[:first_other]
    )
    assert "#SBATCH hetjob" in out and "#SBATCH --gpus-per-node=8" in out and "#SBATCH --exclusive" in out
    assert f"MOPD_RUN_DIR={tmp_path / 'run'}" in out
    assert "72 children" in out and "AWEX infer world 32 + train world 32 = 64" in out
    rows = [line for line in out.splitlines() if "│ 1:rollout" in line]
    assert len(rows) == 8 and "http, nccl, dist_init (assigned at start)" in rows[0] and "│ 28-31" in rows[-1]
    assert not (tmp_path / "run").exists()  # a dry run creates nothing


def test_render_writes_a_bash_clean_script(tmp_path: Path) -> None:
    target = tmp_path / "scripts" / "new" / "job.sbatch"  # its folder is made
    proc = mopd_submit(CONFIGS / "slurm_het_cpu.yaml", "--render", target, "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert f"sbatch {target}" in proc.stdout
    script = target.read_text()
    assert script.startswith("#!/bin/bash") and "--plan" in script and "--bind auto" in script
    assert subprocess.run(["bash", "-n", str(target)], check=False).returncode == 0
    # the run dir is prepared as for a submission: `sbatch job.sbatch` runs as written
    run = tmp_path / "run"
    assert {"config.yaml", "plan.json", "guard.token", "logs"} <= {p.name for p in run.iterdir()}
    assert (run / "guard.token").stat().st_mode & 0o777 == 0o600
    assert f"prepared its run dir {run}" in proc.stdout


def test_probe_flag_swaps_every_role_keeping_placement() -> None:
    out, err = io.StringIO(), io.StringIO()
    args = parse(str(CONFIGS / "slurm_het_cpu.yaml"), "--dry-run", "--probe")
    assert submit.execute(args, out=out, err=err, environ={}, python=sys.executable) == 0
    text = out.getvalue()
    assert "# -- het group 1: rollout (roles: probe)" in text and "probe-only" in text
    assert "rollout (probe 4)" in text and "actor (probe 0)" in text


def test_resume_needs_an_existing_run(tmp_path: Path) -> None:
    proc = mopd_submit(CONFIGS / "slurm_het_cpu.yaml", "--dry-run", "--resume", tmp_path)
    assert proc.returncode == 2
    assert "holds no earlier run (plan.json or config.yaml)" in proc.stderr
    (tmp_path / "plan.json").write_text("{}")
    proc = mopd_submit(CONFIGS / "slurm_het_cpu.yaml", "--dry-run", "--resume", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"MOPD_RUN_DIR={tmp_path}" in proc.stdout


def test_slurm_backend_without_sbatch_fails_clearly(tmp_path: Path) -> None:
    proc = mopd_submit(CONFIGS / "slurm_het_cpu.yaml", "--probe", "--run-dir", tmp_path / "run")
    assert proc.returncode == start.EXIT_SUBMIT_FAILED
    assert "sbatch is not on PATH" in proc.stderr
    # the run dir was prepared before submission: plan, resolved config, private token
    assert (tmp_path / "run" / "plan.json").exists() and (tmp_path / "run" / "config.yaml").exists()
    assert (tmp_path / "run" / "guard.token").stat().st_mode & 0o777 == 0o600


def test_layout_and_config_errors_exit_2() -> None:
    err = io.StringIO()
    args = parse(str(CONFIGS / "local_cpu.yaml"), "--dry-run", "--set", "cluster.group.nodes=0")
    assert submit.execute(args, out=io.StringIO(), err=err, environ={}, python=sys.executable) == 2
    assert "cluster.group.nodes" in err.getvalue()
    err = io.StringIO()
    args = parse(
        str(CONFIGS / "gsm8k_qwen3_14b_to_0_6b.yaml"), "--dry-run", "--set", "rollout.mode=separated",
        "--set", "weight_sync.backend=torch", "--set", "weight_sync.awex_mode=null",
        "--set", "models.actor.tensor_parallel=4", "--set", "rollout.engines.count=2",
        "--set", "rollout.engines.tensor_parallel=2",
    )  # fmt: skip
    assert submit.execute(args, out=io.StringIO(), err=err, environ={}, python=sys.executable) == 2
    assert "does not divide the actor's 4 ranks" in err.getvalue()


def test_unrunnable_roles_fall_back_to_probes() -> None:

    plan = place_children(load_run_config(CONFIGS / "local_cpu.yaml"))
    missing = prepare.unrunnable_roles(plan)
    assert set(missing) <= {"actor", "teacher", "rollout"}
    assert prepare.unrunnable_roles(plan.as_probe()) == []


def test_render_quotes_a_hostile_run_dir(weird_tmp_path: Path) -> None:
    target = weird_tmp_path / "job.sbatch"
    run_dir = weird_tmp_path / "run"
    proc = mopd_submit(CONFIGS / "slurm_het_cpu.yaml", "--render", target, "--run-dir", run_dir)
    assert proc.returncode == 0, proc.stderr
    script = target.read_text()
    assert f"MOPD_RUN_DIR='{weird_tmp_path}/run'".replace("'; echo x", "'\"'\"'; echo x") in script
    assert subprocess.run(["bash", "-n", str(target)], check=False).returncode == 0
