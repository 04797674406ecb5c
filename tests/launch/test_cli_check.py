"""`mopd-submit --check`: a real subprocess on every shipped config (exit 0) and on bad ones (exit 2)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import helpers_fork
import pytest
import yaml
from helpers_models import hub_cache_for

from mopd_hpc.cli import submit
from mopd_hpc.config import RunConfig
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.launch.hub_cache import is_hub_id
from mopd_hpc.launch.model_check import model_paths, resolve_hub_ids
from mopd_hpc.runtime.signals import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def mopd_submit(
    *args: str | Path, hub_cache: Path | None = None, columns: int = 80
) -> subprocess.CompletedProcess[str]:
    """Run the console entry point in a child process (the module form: no dependence on PATH) on a terminal of
    `columns`; `hub_cache`: the Hugging Face hub cache it reads (HF_HUB_CACHE, offline)."""
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    if hub_cache is not None:
        env |= {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    return helpers_fork.run(
        ["-m", "mopd_hpc.cli.submit", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def hub_ids(cfg: RunConfig) -> list[str]:
    """The model paths of `cfg` that are hub ids (no such directory in the repository)."""
    return [m.value for m in model_paths(cfg) if is_hub_id(m.value) and not (REPO / m.value).is_dir()]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding every hub id the shipped configs name (helpers_models.hub_cache_for)."""
    return hub_cache_for(CONFIGS, tmp_path_factory.mktemp("hub"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_check_prints_the_resolved_config(path: Path, hub_cache: Path) -> None:
    cfg = RunConfig.from_yaml(path)
    proc = mopd_submit("--check", path, hub_cache=hub_cache if hub_ids(cfg) else None)
    if gaps := job_gaps(cfg):  # the production configs: engines no role runs yet
        # if --check passes, the job's roles can run it: else exit 2, naming each field, nothing on stdout
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        lines = proc.stderr.splitlines()
        assert lines[0].endswith(f"asks for what the job's roles do not run yet ({len(gaps)}):")
        assert lines[1 : 1 + len(gaps)] == [f"  - {g.render()}" for g in gaps]
        return
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"# {path} is valid — {cfg.name}: backend {cfg.cluster.backend}")
    # The whole output is YAML (the header lines are comments) and it is the resolved config: hub ids
    # replaced by the cache's snapshot directories.
    resolved = resolve_hub_ids(cfg, base=REPO, cache_dir=hub_cache)[0]
    assert RunConfig.from_dict(yaml.safe_load(proc.stdout)) == resolved
    assert (resolved == cfg) == (not hub_ids(cfg))


#: The shipped configs that --check passes only with --allow-unverified (issue 31 item 6).
OPT_IN_CONFIGS = ("qwen3_8gpu_colocated.yaml", "gsm8k_qwen3_14b_to_0_6b.yaml")


@pytest.mark.parametrize("name", OPT_IN_CONFIGS)
def test_production_configs_pass_check_with_allow_unverified(name: str, hub_cache: Path) -> None:
    """Every refusal of these configs is one of code not yet run on GPUs: with the opt-in, --check exits 0
    and prints each as a warning, the resolved config recording `allow_unverified: true`."""
    path = REPO / "configs" / name
    cfg = RunConfig.from_yaml(path)
    gaps = job_gaps(cfg)
    assert gaps and all(g.unverified for g in gaps)
    proc = mopd_submit("--check", path, "--allow-unverified", hub_cache=hub_cache if hub_ids(cfg) else None)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stdout.splitlines() if line.startswith("# warning: unverified: ")]
    assert [w.removeprefix("# warning: unverified: ").split(" = ")[0] for w in warned] == [
        g.path for g in gaps
    ]
    assert yaml.safe_load(proc.stdout)["allow_unverified"] is True


def test_check_refuses_a_hub_id_this_host_has_not_downloaded(tmp_path: Path) -> None:
    proc = mopd_submit("--check", REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml", hub_cache=tmp_path)
    assert proc.returncode == EXIT_USAGE
    assert "models.actor.path: hub id 'Qwen/Qwen3-0.6B' is neither a directory here nor in the Hugging " in (
        proc.stderr
    )
    assert "`hf download Qwen/Qwen3-14B`" in proc.stderr  # the teacher's, too
    # what the job's roles do not run is named in the same answer, not only once the models are fetched
    gaps = job_gaps(RunConfig.from_yaml(REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml"))
    lines = proc.stderr.splitlines()
    assert lines[0].endswith(": 3 problems") and len(gaps) == 3
    assert lines[4:] == [
        f"mopd-submit: its fields are valid, and it also asks for what the job's roles do not run yet "
        f"({len(gaps)}):",
        *(f"  - {g.render()}" for g in gaps),
        "use --allow-unverified (allow_unverified: true) to run it with these 3 setting(s) unverified, "
        "--dry-run/--render to review it, or --probe to run the control plane of this shape",
    ]
    assert all(g.unverified for g in gaps)  # every one is let through by the opt-in the last line names
    assert [g.path for g in gaps] == [
        "models.actor.tensor_parallel",
        "models.teachers[0].tensor_parallel",
        "weight_sync.backend",  # awex from 8 trainer ranks has not run on GPUs
    ]


def test_the_way_out_of_gaps_names_the_opt_in_when_any_is_unverified() -> None:
    """The last line of the refusal of `job_gaps`: the opt-in first when it lets all the gaps through, with how
    many it leaves when it lets only some through, not named when none is unverified."""
    from mopd_hpc.config.problems import Problem
    from mopd_hpc.launch.prepare import gaps_refusal

    untested = Problem("models.actor.tensor_parallel", "has not run", 8, "≤ 1", unverified="tests/x_gpu.py")
    unsupported = Problem("rollout.backend", "is not run by the rollout role", "vllm", "sglang")
    review = "--dry-run/--render to review it, or --probe to run the control plane of this shape"
    assert gaps_refusal([untested]).splitlines()[-1] == (
        f"use --allow-unverified (allow_unverified: true) to run it with these 1 setting(s) unverified, {review}"
    )
    assert gaps_refusal([untested, unsupported, unsupported]).splitlines()[-1] == (
        "use --allow-unverified (allow_unverified: true) to let the 1 unverified one(s) through (the other 2 "
        f"still refuse), {review}"
    )
    assert gaps_refusal([unsupported]).splitlines()[-1] == f"use {review}"


def test_bad_config_exits_2_with_every_problem_on_stderr(tmp_path: Path) -> None:
    text = (REPO / "configs" / "local_cpu.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        re.sub(
            r"batch_size: \d+", "batch_size: 0", text.replace("chain: {chain: 1.0}", "chain: {reasoner: 1.0}")
        )
    )
    proc = mopd_submit("--check", bad)
    assert proc.returncode == EXIT_USAGE == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{bad}: 2 problems",
        "  - data.batch_size: must be greater than or equal to 1 (got 0)",
        "  - routes.chain: unknown teacher 'reasoner' (known: chain, legs)",
    ]


def test_set_and_local_reach_the_resolved_config() -> None:
    proc = mopd_submit(
        "--check",
        "configs/slurm_het_cpu.yaml",
        "--local",
        "--set",
        "steps=3",
        "--set",
        "loss.estimator=sampled",
        "--set",
        "loss.correction=mask",
    )
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert (resolved["cluster"]["backend"], resolved["steps"], resolved["loss"]["correction"]) == (
        "local",
        3,
        "mask",
    )


def test_topk_resolves_correction_none_and_refuses_truncate_naming_both_fields() -> None:
    """estimator topk: the unset correction resolves to none (and the resolved config loads again); an explicit
    truncate is refused by --check, naming loss.estimator and loss.correction."""
    proc = mopd_submit("--check", "configs/slurm_het_cpu.yaml", "--local")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert (resolved["loss"]["estimator"], resolved["loss"]["correction"]) == ("topk", "none")
    from mopd_hpc.config.loss import LossConfig

    assert LossConfig(**resolved["loss"]).correction == "none"  # the resolved section loads as written
    proc = mopd_submit(
        "--check", "configs/slurm_het_cpu.yaml", "--local", "--set", "loss.correction=truncate"
    )
    assert proc.returncode != 0
    assert "loss.correction" in proc.stderr and "loss.estimator 'topk'" in proc.stderr, proc.stderr


def test_bad_override_exits_2() -> None:
    proc = mopd_submit("--check", "configs/local_cpu.yaml", "--set", "loss.corection=mask")
    assert proc.returncode == 2
    assert "--set loss.corection: unknown key (got 'corection';" in proc.stderr
    assert "did you mean 'correction'?" in proc.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    proc = mopd_submit("--check", tmp_path / "absent.yaml")
    assert proc.returncode == 2
    assert "cannot read the config file: No such file or directory" in proc.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("mopd-submit")
    if not script.exists():
        pytest.skip(f"{script} not installed (pip install -e . installs it)")
    proc = subprocess.run(
        [str(script), "--check", "configs/local_cpu.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "is valid" in proc.stdout


def test_check_function_takes_its_streams() -> None:
    """The logic is a function over its collaborators (STYLE.md rule 13): testable with StringIO."""
    out, err = io.StringIO(), io.StringIO()
    assert submit.check("configs/local_cpu.yaml", ["seed=4"], False, out, err) == 0
    assert err.getvalue() == "" and yaml.safe_load(out.getvalue())["seed"] == 4
    out, err = io.StringIO(), io.StringIO()
    assert submit.check("configs/local_cpu.yaml", ["seed=-4"], False, out, err) == 2
    assert out.getvalue() == "" and "seed: must be greater than or equal to 0 (got -4)" in err.getvalue()


def test_main_parses_argv(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert submit.main(["--check", "configs/local_cpu.yaml", "--set", "steps=9"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["steps"] == 9
    with pytest.raises(SystemExit) as info:
        submit.main([])
    assert info.value.code == 2


def test_check_warns_about_model_directories_missing_here(tmp_path: Path) -> None:
    from mopd_hpc.config import load_run_config
    from mopd_hpc.launch.paths import path_warnings as missing_model_paths

    cfg = load_run_config(
        REPO / "configs" / "local_cpu.yaml",
        ["models.teachers[0].path=.cache/models/teacher_chainsum", "models.teachers[1].path=Qwen/Qwen3-0.6B"],
    )
    student = tmp_path / ".cache" / "models" / "student"
    student.mkdir(parents=True)
    (student / "config.json").write_text("{}")
    assert missing_model_paths(cfg, tmp_path) == [
        "models.teachers[0].path: no such directory here: .cache/models/teacher_chainsum "
        "(the job fails at start unless it exists there)"
    ]  # the student is built, a hub id is not a directory
    not_built = "models.actor.path: .cache/models/student is not built yet (`--local` builds the tiny models on first use)"
    (student / "config.json").unlink()  # the directory an interrupted first build leaves: built again
    assert missing_model_paths(cfg, tmp_path)[0] == not_built
    student.rmdir()
    assert missing_model_paths(cfg, tmp_path)[0] == not_built
    # a GPU config's `student` is not one of the CPU tiny models: it is never built on first use
    gpu = load_run_config(REPO / "configs" / "local_gpu_colocated.yaml")
    assert missing_model_paths(gpu, tmp_path)[0] == (
        "models.actor.path: no such directory here: .cache/models/gpu_0_6b/student "
        "(the job fails at start unless it exists there)"
    )
    from mopd_hpc.launch.local_setup import missing_builder_dirs

    assert missing_builder_dirs(gpu) == []
