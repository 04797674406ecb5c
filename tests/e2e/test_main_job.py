"""The whole local path of the main job, as `make run` takes it: `mopd-submit CONFIG --local` → the local backend's
guard → actor (controller), teachers, rollout engine → metrics, checkpoints, evaluation table; 3 steps on micro
models. The config names its models by paths relative to the submit directory: the local setup hook makes them
absolute before the children (which run in the run directory) read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers_jobs import job_env, submit_local
from test_controller import assert_metrics, micro_config

from mopd_hpc.config import RunConfig
from mopd_hpc.launch.local_setup import missing_builder_dirs
from mopd_hpc.runtime.guard.fork_server import GPU_DEVICE_FILES


@pytest.fixture(scope="module")
def smoke(
    micro_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One 3-step local run (the smoke test's), its models named relative to the submit directory; the run dir
    and the finished `mopd-submit` process. Shared by the tests that assert on it."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    run_dir = tmp_path / "run"
    config = micro_config(micro_models, run_dir, tmp_path / "c.yaml", **{"loss.estimator": "topk"})
    doc = yaml.safe_load(config.read_text())
    rel = os.path.relpath(micro_models, tmp_path)
    for model in (doc["models"]["actor"], doc["models"]["tokenizer"], *doc["models"]["teachers"]):
        model["path"] = str(Path(rel) / Path(model["path"]).name)
    config.write_text(yaml.safe_dump(doc))
    # relative paths must not depend on the submitter's shell variable
    proc = submit_local(config, cwd=tmp_path, env=job_env(PWD="/nonexistent"))
    return run_dir, proc


def test_local_smoke_through_mopd_submit(micro_models, smoke):
    run_dir, proc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = assert_metrics(run_dir, 3)
    assert [line["rollout/weight_version"] for line in lines] == [0.0, 1.0, 2.0]
    assert all(line["time/teacher_s"] > 0 for line in lines)
    assert "end/teacher" in proc.stdout and "legs" in proc.stdout  # the evaluation table, printed
    resolved = RunConfig.from_yaml(run_dir / "config.yaml")
    assert Path(resolved.models.actor.path) == (micro_models / "student").resolve()
    record = json.loads((run_dir / "eval.json").read_text())
    assert {r: sorted(v) for r, v in record["routes"].items()} == {
        r: ["n", "student_end", "student_start", "teacher"] for r in ("chain", "legs")
    }
    assert record["student_weights"] == {"start": "0", "end": "3"}  # evaluated on the rollout engine
    assert (run_dir / "student_final" / "model.safetensors").is_file()
    events = [json.loads(x) for f in (run_dir / "events").glob("*.jsonl") for x in f.read_text().splitlines()]
    exits = {(e["role"], e["index"]): e.get("exit_code") for e in events if e.get("event") == "exit"}
    assert exits == {("actor", 0): 0, ("teacher", 0): 0, ("teacher", 1): 0, ("rollout", 0): 0}
    forked = {(e["role"], e["index"]): e["forked"] for e in events if e.get("event") == "spawn"}
    on_gpu_node = any(os.path.exists(path) for path in GPU_DEVICE_FILES)  # there every child is exec'ed
    assert forked == dict.fromkeys(exits, not on_gpu_node)  # from the guard's fork server


def test_missing_tiny_models_are_built_on_first_use(tmp_path):
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "local_cpu.yaml").read_text())
    base = tmp_path / "cache"
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(base / "student")
    doc["models"]["teachers"][0]["path"] = str(base / "teacher_chain_sum")
    doc["models"]["teachers"][1]["path"] = str(tmp_path / "own" / "my_teacher")  # not a builder model
    cfg = RunConfig.from_dict(doc)
    assert missing_builder_dirs(cfg) == [base]
    (base / "student").mkdir(parents=True)
    (base / "student" / "config.json").write_text("{}")
    (base / "teacher_chain_sum").mkdir()
    (base / "teacher_chain_sum" / "config.json").write_text("{}")
    assert missing_builder_dirs(cfg) == []


def test_summarizer_on_the_smoke_runs_real_run_dir(smoke):
    """`mopd-logs summarize` on a real main-job run dir: no failure, progress and evaluation read back."""
    from mopd_hpc.logs.summary import no_sacct, summarize_run

    run_dir, proc = smoke  # the smoke test's run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = summarize_run(run_dir, sacct_runner=no_sacct)
    assert summary.first_failure is None
    assert summary.progress.last_step == 3
    assert set(summary.progress.routes) == {"chain", "legs"}
    assert summary.progress.eval is not None and set(summary.progress.eval) == {"chain", "legs"}
    assert {(c.role, c.index): c.state for c in summary.children} == {
        ("actor", 0): "exited", ("teacher", 0): "exited", ("teacher", 1): "exited", ("rollout", 0): "exited",
    }  # fmt: skip
    cli = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.logs", "summarize", str(run_dir), "--json"],
        env=job_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["progress"]["last_step"] == 3


def test_a_tiny_model_an_interrupted_first_build_left_is_built_again(tmp_path, monkeypatch):
    """Ctrl-C (or a crash) during the first `make run`'s model build leaves `.cache/models/teacher_chain_sum`
    behind without its config.json (the builder makes the directory, trains, then saves). The next
    `mopd-submit configs/local_cpu.yaml --local` opened its files and refused it (config.json missing, no
    tokenizer, no weights) before it could build it again; now it is "not built yet" and built again."""
    from mopd_hpc.launch.paths import missing_paths

    repo = Path(__file__).resolve().parents[2]
    config = repo / "configs" / "local_cpu.yaml"
    partial = tmp_path / ".cache" / "models" / "teacher_chain_sum"
    partial.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [env.get("PYTHONPATH")])])  # this checkout
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--check"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("# warning: models.")] == [
        f"# warning: {field}: .cache/models/{name} is not built yet (`--local` builds the tiny models on first use)"
        for field, name in (
            ("models.actor.path", "student"),
            ("models.tokenizer.path", "student"),
            ("models.teachers[0].path", "teacher_chain_sum"),
            ("models.teachers[1].path", "teacher_leg_counting"),
        )
    ]
    cfg = RunConfig.from_yaml(config)
    monkeypatch.chdir(tmp_path)
    assert missing_builder_dirs(cfg) == [Path(".cache/models")]  # the local setup builds into it again
    (partial / "config.json").write_text("{}")  # a finished build: checked as any model directory
    assert "models.teachers[0].path" not in [m.field for m in missing_paths(cfg, tmp_path)]
