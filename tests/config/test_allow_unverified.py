"""The opt-in for what is written but has not run on GPUs here (issue 31 item 4): `mopd-submit
--allow-unverified` (= `--set allow_unverified=true`).

Without it, each unverified refusal (megatron TP > 1 and DP > 1, torch DP > 1 on GPUs, a megatron teacher at
TP > 1, AWEX from several trainer ranks) still comes from --check and names the opt-in as a way out. With it,
--check passes and prints each as a warning, `--render` writes them into the run dir (unverified.json,
records/unverified.py) and config.yaml records `allow_unverified: true`, and `mopd-logs summarize` (a real
subprocess) shows them; the roles' own re-check at start lets the same through. What is unsupported (megatron
at pipeline_parallel > 1, an hf rollout engine of tensor_parallel 2, the torch broadcast between two ranks of
one GPU) stays refused with the flag. Oracle: the refusals' and warnings' fields and texts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from helpers_configs import submit_here

from mopd_hpc.config import load_run_config
from mopd_hpc.config.capabilities import OPT_IN_WAY
from mopd_hpc.config.job_gaps import job_gaps, unverified_gaps
from mopd_hpc.records.metrics import MetricsWriter
from mopd_hpc.records.run_dir import CONFIG_FILE, METRICS_FILE, UNVERIFIED_FILE
from mopd_hpc.records.unverified import read_unverified

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local_cpu.yaml"
#: A megatron actor on a 2-GPU group (constant lr, ipc weight sync: the rollout shares the GPUs).
MEGATRON = [
    "cluster.group.gpus_per_node=2", "models.actor.engine=megatron", "weight_sync.backend=ipc",
    "models.actor.optimizer.schedule=constant", "models.actor.optimizer.warmup_ratio=0",
]  # fmt: skip
#: Each unverified shape, with the fields its refusals name (in job_gaps' order).
UNVERIFIED = {
    "megatron_tp2": ([*MEGATRON, "models.actor.tensor_parallel=2"], ["models.actor.tensor_parallel"]),
    "megatron_dp2": (MEGATRON, ["models.actor.engine"]),
    "torch_dp2_gpu": (["cluster.group.gpus_per_node=2", "weight_sync.backend=ipc"], ["models.actor.engine"]),
    "teacher_tp2": (
        [
            *MEGATRON,
            "models.actor.tensor_parallel=2",
            "models.teachers[0].engine=megatron",
            "models.teachers[0].tensor_parallel=2",
        ],
        ["models.actor.tensor_parallel", "models.teachers[0].tensor_parallel"],
    ),  # fmt: skip
    "awex_2_ranks": (
        [*MEGATRON, "models.actor.tensor_parallel=2", "weight_sync.backend=awex", "rollout.engines.count=2"],
        ["models.actor.tensor_parallel", "weight_sync.backend"],
    ),
}
#: Unsupported: refused with the opt-in too (field refused).
UNSUPPORTED = {
    "megatron_pp2": ([*MEGATRON, "models.actor.pipeline_parallel=2"], "models.actor.pipeline_parallel"),
    "hf_rollout_tp2": (
        ["cluster.group.gpus_per_node=2", "weight_sync.backend=ipc", "rollout.engines.tensor_parallel=2"],
        "rollout.engines.tensor_parallel",
    ),
    "torch_sync_colocated_gpu": (["cluster.group.gpus_per_node=1"], "weight_sync.backend"),
}


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def refused_lines(err: str) -> dict[str, str]:
    return {line[4:].split(":")[0]: line for line in err.splitlines() if line.startswith("  - ")}


@pytest.mark.parametrize("name", list(UNVERIFIED))
def test_without_the_flag_each_unverified_refusal_comes_and_names_it(name: str) -> None:
    overrides, fields = UNVERIFIED[name]
    rc, out, err = submit_here(str(LOCAL), "--check", *sets(overrides))
    assert rc == 2 and out == ""
    lines = refused_lines(err)
    assert list(lines) == fields, err
    for line in lines.values():
        assert line.endswith(f"or {OPT_IN_WAY})"), line
        assert "allow_unverified: true (--allow-unverified)" in line


@pytest.mark.parametrize("name", list(UNVERIFIED))
def test_with_the_flag_check_passes_and_prints_each_as_a_warning(name: str) -> None:
    overrides, fields = UNVERIFIED[name]
    rc, out, err = submit_here(str(LOCAL), "--check", "--allow-unverified", *sets(overrides))
    assert rc == 0, err
    warned = [line for line in out.splitlines() if line.startswith("# warning: unverified: ")]
    assert [w.removeprefix("# warning: unverified: ").split(" = ")[0] for w in warned] == fields
    for line in warned:
        assert "(not run on GPUs here; let through by allow_unverified)" in line
    # the field spelling is the same switch: --set allow_unverified=true
    cfg = load_run_config(LOCAL, [*overrides, "allow_unverified=true"])
    assert job_gaps(cfg) == [] and [p.path for p in unverified_gaps(cfg)] == fields
    assert "allow_unverified: true" in out  # the resolved config shows it


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_a_known_broken_combination_is_still_refused_with_the_flag(name: str) -> None:
    overrides, field = UNSUPPORTED[name]
    rc, out, err = submit_here(str(LOCAL), "--check", "--allow-unverified", *sets(overrides))
    assert rc == 2 and out == "", out
    lines = refused_lines(err)
    assert field in lines, err
    assert "allow_unverified" not in lines[field]  # no opt-in is offered for it


def test_the_run_dir_and_the_summary_show_what_ran_unverified(tmp_path: Path) -> None:
    overrides, fields = UNVERIFIED["awex_2_ranks"]
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    rc, out, err = submit_here(
        str(LOCAL), "--render", str(script), "--run-dir", str(run_dir), "--allow-unverified", *sets(overrides)
    )
    assert rc == 0, err
    assert yaml.safe_load((run_dir / CONFIG_FILE).read_text())["allow_unverified"] is True
    record = json.loads((run_dir / UNVERIFIED_FILE).read_text())
    warnings = read_unverified(run_dir)
    assert list(warnings) == record["warnings"] and [w.split(" = ")[0] for w in warnings] == fields
    assert all(f"# warning: unverified: {w}" in out for w in warnings)
    with MetricsWriter.open(run_dir / METRICS_FILE) as metrics:  # the job ran a step
        metrics.write(1, {"loss": 0.5})
    summary = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert json.loads(summary.stdout)["job"]["unverified"] == list(warnings), summary.stderr
    screen = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    shown = [line for line in screen.stdout.splitlines() if "ran unverified (allow_unverified)" in line]
    assert len(shown) == len(fields), screen.stdout + screen.stderr
    # a later submission that lets nothing through leaves no stale record
    rc, _, err = submit_here(str(LOCAL), "--render", str(script), "--resume", str(run_dir))
    assert rc == 0, err
    assert not (run_dir / UNVERIFIED_FILE).exists() and read_unverified(run_dir) == ()


def test_the_roles_recheck_lets_through_what_check_let_through(tmp_path: Path) -> None:
    """The actor role's check at start (`check_actor_engine`, on a child that sees a GPU, world 2) and the
    teacher server's (`build_engine`, a megatron replica of TP 2): refused without the opt-in, let through
    with it (the teacher then stops at what this machine lacks, CUDA, past the TP check); pipeline_parallel 2
    refused either way."""
    from mopd_hpc.engines.protocol import EngineError
    from mopd_hpc.engines.teacher.process import TeacherArgs, build_engine
    from mopd_hpc.roles.actor import check_actor_engine
    from mopd_hpc.roles.env import RoleEnv, RoleEnvError

    role = RoleEnv.from_env(
        {
            "MOPD_RUN_DIR": str(tmp_path), "MOPD_ROLE": "actor", "MOPD_INDEX": "0", "MOPD_JOB_ID": "local-1",
            "MOPD_BACKEND": "local", "MOPD_HOST": "localhost", "MOPD_WORLD_SIZE": "2", "MOPD_PORT_MASTER": "1",
        }
    )  # fmt: skip
    gpu = {"CUDA_VISIBLE_DEVICES": "0,1"}
    overrides = UNVERIFIED["megatron_tp2"][0]
    with pytest.raises(RoleEnvError, match=r"^models\.actor\.tensor_parallel: .*allow_unverified: true"):
        check_actor_engine(load_run_config(LOCAL, overrides), role, gpu)
    assert (
        check_actor_engine(load_run_config(LOCAL, [*overrides, "allow_unverified=true"]), role, gpu)
        == "megatron"
    )
    pp = [*MEGATRON, "models.actor.pipeline_parallel=2", "allow_unverified=true"]
    with pytest.raises(RoleEnvError, match=r"^models\.actor\.pipeline_parallel: "):
        check_actor_engine(load_run_config(LOCAL, pp), role, gpu)
    teacher = TeacherArgs(
        "t", str(tmp_path), "127.0.0.1", 0, "127.0.0.1", engine="megatron", tensor_parallel=2
    )
    with pytest.raises(EngineError, match=r"^tensor_parallel=2: the teacher server runs a megatron teacher"):
        build_engine(teacher)
    with pytest.raises(EngineError, match=r"^--engine='megatron' needs a CUDA device") as opted:
        build_engine(replace(teacher, allow_unverified=True))
    assert "tensor_parallel" not in str(opted.value)
