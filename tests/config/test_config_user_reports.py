"""A new user's six reports, pinned: a torch actor on several GPU ranks is a job gap (on CPU ranks it is data
parallel, issue 16); submits print
the --check warnings and a local run refuses missing model directories / jsonl files before anything starts;
a missing jsonl file warns; a jsonl source left out of data.eval warns; --dry-run puts the warnings and the
rank map before the script and a refusal lists one problem a line; tp 16 on 8 GPUs suggests a divisor."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_configs import submit_here

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.config.data import unevaluated_sources
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.launch import start
from mopd_hpc.launch.paths import MissingPath, local_path_errors, missing_paths, path_warnings

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
LOCAL = CONFIGS / "local_cpu.yaml"
JSONL = "data.sources[0]={kind: jsonl, name: mine, route: chain, weight: 0.3, path: data/mine.jsonl}"


def problems(config: Path, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_run_config(config, list(overrides))
    return {p.path: p.render() for p in info.value.problems}


# ---- 1. a torch actor on several trainer ranks: data parallelism on CPU (issue 16), a job gap on GPUs --------
def test_torch_actor_on_several_cpu_ranks_is_data_parallel() -> None:
    cfg = load_run_config(LOCAL, ["cluster.group.nodes=2"])
    assert ActorParallel.from_config(cfg) == ActorParallel(world=2, dp=2, tp=1, pp=1)
    assert job_gaps(cfg) == []
    rc, out, err = submit_here(str(LOCAL), "--check", "--set", "cluster.group.nodes=2")
    assert (rc, err) == (0, "")
    assert "# actor: world 2 = dp 2 × tp 1 × pp 1 (cluster.group.nodes × actor_ranks_per_node = 2 × 1)" in out


def test_torch_actor_on_several_gpus_is_a_job_gap() -> None:
    cfg = load_run_config(LOCAL, ["cluster.group.gpus_per_node=2", "weight_sync.backend=ipc"])
    assert [g.render() for g in job_gaps(cfg)] == [
        "models.actor.engine: the actor role runs the torch engine at data-parallel size ≤ 1 on GPUs: the actor "
        "has 2 trainer ranks (cluster.group.nodes × gpus_per_node = 1 × 2), dp 2 = world / "
        "(tensor_parallel·pipeline_parallel); more has not run yet: a torch actor at DP 2 on 2 GPUs (DDP over "
        "NCCL; no GPU test yet) (got 'torch'; one trainer slot (cluster.group.nodes × gpus_per_node), or CPU "
        "ranks (cluster.group.gpus_per_node: 0, actor_ranks_per_node), or allow_unverified: true "
        "(--allow-unverified) to run it unverified)"
    ]
    # --check refuses it (if --check passes, the job's roles can run it), naming the field
    rc, out, err = submit_here(str(LOCAL), "--check", "--set", "cluster.group.gpus_per_node=2")
    assert (rc, out) == (2, "")
    assert err.splitlines()[1].startswith("  - models.actor.engine: the actor role runs the torch engine at ")


def test_separated_rollout_gpus_are_not_actor_ranks() -> None:
    base = ["rollout.mode=separated"]
    (gap,) = job_gaps(load_run_config(LOCAL, [*base, "cluster.group.gpus_per_node=3"]))
    assert "2 trainer ranks (cluster.group.nodes × gpus_per_node = 1 × 3 − rollout.engines " \
        "count·tensor_parallel 1·1)" in gap.render()  # fmt: skip
    # 2 GPUs: one for the rollout engine, one for the actor: one trainer rank, valid
    cfg = load_run_config(LOCAL, [*base, "cluster.group.gpus_per_node=2"])
    assert cfg.cluster.group.gpus_per_node == 2 and cfg.models.actor.engine == "torch"
    assert job_gaps(cfg) == [] and ActorParallel.from_config(cfg).world == 1


def test_megatron_actor_is_not_held_to_one_rank() -> None:
    got = problems(CONFIGS / "local_gpu_colocated.yaml", "cluster.group.nodes=2")
    assert "models.actor.engine" not in got


# ---- 2, 3. missing paths: a warning on every submit, an error before a local run ------------------------
def test_missing_paths_records(tmp_path: Path) -> None:
    cfg = load_run_config(LOCAL, ["models.teachers[1].path=./nope/teacher", JSONL])
    assert missing_paths(cfg, tmp_path) == [
        MissingPath("models.actor.path", ".cache/models/student", "directory", built=True),
        MissingPath("models.tokenizer.path", ".cache/models/student", "directory", built=True),
        MissingPath("models.teachers[0].path", ".cache/models/teacher_chain_sum", "directory", built=True),
        MissingPath("models.teachers[1].path", "./nope/teacher", "directory"),
        MissingPath("data.sources[0].path", "data/mine.jsonl", "file"),
    ]
    assert path_warnings(cfg, tmp_path)[-1] == (
        "data.sources[0].path: no such file here: data/mine.jsonl (the job fails at start unless it exists there)"
    )
    assert local_path_errors(cfg, tmp_path) == [
        "models.teachers[1].path: no such directory here: ./nope/teacher (expected an existing directory)",
        "data.sources[0].path: no such file here: data/mine.jsonl (expected an existing file)",
    ]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert [m.field for m in missing_paths(cfg, tmp_path)][-1] == "models.teachers[1].path"
    # a held-out file of the source is a path too
    held = load_run_config(LOCAL, [JSONL.replace("}", ", eval_path: data/mine_test.jsonl}")])
    assert missing_paths(held, tmp_path)[-1] == MissingPath(
        "data.sources[0].eval_path", "data/mine_test.jsonl", "file"
    )


def test_check_warns_about_a_missing_jsonl_file() -> None:
    rc, out, _ = submit_here(str(LOCAL), "--check", "--set", JSONL, "--set", "data.eval.size=0")
    assert rc == 0
    warnings = [line for line in out.splitlines() if line.startswith("# warning: ")]
    # the tiny models' "not built yet" warnings depend on whether this checkout built them already
    assert [w for w in warnings if not w.startswith("# warning: models.")] == [
        "# warning: data.sources[0].path: no such file here: data/mine.jsonl "
        "(the job fails at start unless it exists there)"
    ]


def test_local_run_refuses_a_missing_model_directory_before_anything_starts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rc, out, err = submit_here(
        str(LOCAL), "--local", "--run-dir", str(run), "--set", "models.teachers[1].path=./nope/teacher"
    )
    assert (rc, out) == (2, "")
    assert err.splitlines() == [
        "mopd-submit: cluster.backend is local: 1 path(s) the job reads do not exist here (nothing was started):",
        "  - models.teachers[1].path: no such directory here: ./nope/teacher (expected an existing directory)",
    ]
    assert not run.exists()


def test_slurm_submit_prints_the_warnings_before_the_rank_map(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOPD_"))}
    env["PATH"] = str(Path(sys.executable).parent)  # the venv only: no sbatch
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(CONFIGS / "slurm_het_cpu.yaml"), "--probe",
         "--run-dir", str(tmp_path / "run"), "--set", "models.teachers[1].path=./nope/teacher"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == start.EXIT_SUBMIT_FAILED and "sbatch is not on PATH" in proc.stderr
    warning = (
        "# warning: models.teachers[1].path: no such directory here: ./nope/teacher "
        "(the job fails at start unless it exists there)"
    )
    assert warning in proc.stdout.splitlines()
    assert proc.stdout.index(warning) < proc.stdout.index("rank map of ")


# ---- 4. jsonl sources are not in the held-out evaluation -------------------------------------------------
def test_jsonl_source_left_out_of_the_evaluation_warns() -> None:
    cfg = load_run_config(LOCAL, [JSONL, "data.eval.size=20"])
    (problem,) = unevaluated_sources(cfg.data)
    assert problem.path == "data.sources[0]"
    assert problem.render() == (
        "data.sources[0]: source 'mine' (kind jsonl) is left out of the held-out evaluation (data.eval.size 20): "
        "it has no held-out split; route 'chain' gets no evaluation (eval_fraction or eval_path on the source, "
        "or data.eval.size: 0 to silence this)"
    )
    assert problem.render() in cfg.warnings()
    # a route that also has a reasoning-gym source is evaluated on that one only
    three = (
        "data.sources=[{kind: reasoning_gym, name: chain_sum, route: chain, task: chain_sum, weight: 0.2}, "
        "{kind: jsonl, name: mine, route: chain, path: data/mine.jsonl, weight: 0.1}, "
        "{kind: reasoning_gym, name: legs, route: legs, task: leg_counting, weight: 0.7}]"
    )
    (mixed,) = unevaluated_sources(load_run_config(LOCAL, [three]).data)
    assert mixed.path == "data.sources[1]"
    assert mixed.message.endswith("; route 'chain' is evaluated on its held-out sources only")
    assert unevaluated_sources(load_run_config(LOCAL, [JSONL, "data.eval.size=0"]).data) == []
    # a held-out split of its own (a fraction of its rows, or a second file): evaluated, no warning
    for split in ("eval_fraction: 0.1", "eval_path: data/mine_test.jsonl"):
        own = JSONL.replace("path: data/mine.jsonl", f"path: data/mine.jsonl, {split}")
        assert (
            own != JSONL
            and unevaluated_sources(load_run_config(LOCAL, [own, "data.eval.size=20"]).data) == []
        )
    assert unevaluated_sources(load_run_config(LOCAL).data) == []


# ---- 5. --dry-run order, and a refusal one problem a line ----------------------------------------------
def test_dry_run_prints_warnings_and_rank_map_before_the_script() -> None:
    rc, out, _ = submit_here(str(LOCAL), "--dry-run", "--set", JSONL)
    assert rc == 0
    lines = out.splitlines()
    n = next(i for i, line in enumerate(lines) if not line.startswith("# warning: "))
    assert lines[0] == "# warning: " + unevaluated_sources(load_run_config(LOCAL, [JSONL]).data)[0].render()
    # then the paths missing here (the tiny models' depend on whether this checkout built them already)
    assert [w for w in lines[1:n] if not w.startswith("# warning: models.")] == [
        "# warning: data.sources[0].path: no such file here: data/mine.jsonl "
        "(the job fails at start unless it exists there)"
    ]
    assert lines[n].startswith("# cluster.backend is local: the job runs here")
    assert lines[n + 1].startswith("rank map of 'local-cpu': 4 children")
    assert out.index("rank map of") < out.index("sbatch --parsable $SBATCH_SCRIPT") < out.index("#!/bin/bash")


def test_refusal_of_job_gaps_lists_one_problem_a_line(tmp_path: Path) -> None:
    rc, out, err = submit_here(str(CONFIGS / "qwen3_8gpu_colocated.yaml"), "--run-dir", str(tmp_path / "run"))
    assert (rc, out) == (2, "")
    lines = err.splitlines()
    assert (
        lines[0] == "mopd-submit: this config is valid but asks for what the job's roles do not run yet (3):"
    )
    assert [line.split(":")[0] for line in lines[1:4]] == [
        "  - models.actor.tensor_parallel",
        "  - models.teachers[0].tensor_parallel",
        "  - weight_sync.backend",  # AWEX from 8 trainer ranks: not run on GPUs
    ]
    assert lines[4] == (
        "use --allow-unverified (allow_unverified: true) to run it with these 3 setting(s) unverified, "
        "--dry-run/--render to review it, or --probe to run the control plane of this shape"
    )  # all three have run on CPU, not on GPUs: the opt-in is the way out named first
    assert not (tmp_path / "run").exists()


# ---- 6. an engine wider than the group ---------------------------------------------------------------
def test_tensor_parallel_wider_than_the_group_suggests_a_divisor() -> None:
    got = problems(
        CONFIGS / "qwen3_8gpu_colocated.yaml", "rollout.backend=sglang", "rollout.engines.tensor_parallel=16"
    )
    assert got["rollout.engines.tensor_parallel"] == (
        "rollout.engines.tensor_parallel: must divide cluster.group.gpus_per_node (8) "
        "(got 16; a divisor of the GPUs per node: 1, 2, 4 or 8)"
    )
    assert "rollout.engines.count" not in got  # no "(got 8; at most 0)"
    # a count too large for a fitting tensor_parallel still says how many engines fit
    got = problems(
        CONFIGS / "qwen3_8gpu_colocated.yaml",
        "rollout.backend=sglang",
        "rollout.engines.tensor_parallel=2",
        "weight_sync.backend=torch",
    )
    assert got["rollout.engines.count"].endswith("(got 8; at most 4)")
