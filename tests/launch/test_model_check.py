"""`mopd-submit --check` on the models: hub ids through a hub cache built here, damaged files named.

The hub cache is written by the test in a temporary HF_HUB_CACHE (blobs, snapshot symlinks, refs/main, as the
hub writes it); nothing reaches the network (HF_HUB_OFFLINE=1). The models are micro Qwen3 checkpoints with
the tiny models' character tokenizer (tests/helpers_models.py), each damaged one way.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers_configs import NO_SFT_WARMUP
from helpers_models import save_micro_model_dir, write_hub_snapshot

from mopd_hpc.cli import submit
from mopd_hpc.launch.model_files import safetensors_header
from mopd_hpc.runtime.signals import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local_cpu.yaml"
HUB_ID = "Qwen/Qwen3-0.6B"
REVISION = "c1899de289a04d12100db370d81485cdf75e47ca"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sound micro model directory (copied by each test that damages it)."""
    return save_micro_model_dir(tmp_path_factory.mktemp("models") / "micro")


def copy_model(model: Path, root: Path, name: str = "m") -> Path:
    return Path(shutil.copytree(model, root / name))


def check(actor: Path | str, teachers: tuple[Path | str, Path | str], *extra: str) -> tuple[int, str, str]:
    """`mopd-submit --check` in this process on configs/local_cpu.yaml with the models replaced."""
    out, err = io.StringIO(), io.StringIO()
    overrides = [
        f"models.actor.path={actor}",
        f"models.tokenizer.path={actor}",
        f"models.teachers[0].path={teachers[0]}",
        f"models.teachers[1].path={teachers[1]}",
        *extra,
    ]
    rc = submit.check(str(CONFIG), overrides, False, out, err)
    return rc, out.getvalue(), err.getvalue()


def submit_process(args: list[str], cache: Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "TERM": "dumb"}
    env.pop("HF_HOME", None)
    return subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


# ----------------------------------------------------------------------------------------- hub ids


def test_a_cached_hub_id_becomes_its_snapshot_and_the_job_reads_it(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = write_hub_snapshot(cache, HUB_ID, model, REVISION)
    sets = ["--set", f"models.actor.path={HUB_ID}", "--set", f"models.tokenizer.path={HUB_ID}"]
    sets += ["--set", f"models.teachers[0].path={HUB_ID}", "--set", f"models.teachers[1].path={model}"]
    proc = submit_process(["--check", str(CONFIG), *sets], cache)
    assert proc.returncode == 0, proc.stderr
    assert f"# models.actor.path: hub id {HUB_ID} is the cached snapshot {snapshot}" in proc.stdout
    resolved = yaml.safe_load(proc.stdout)["models"]
    assert resolved["actor"]["path"] == resolved["tokenizer"]["path"] == str(snapshot)
    assert resolved["teachers"][0]["path"] == str(snapshot)
    assert resolved["teachers"][1]["path"] == str(model)
    # a submission writes the snapshot directory into the config.yaml every child reads
    run_dir, script = tmp_path / "run", tmp_path / "job.sbatch"
    proc = submit_process(
        [
            str(CONFIG),
            *sets,
            "--set",
            "cluster.backend=slurm",
            "--run-dir",
            str(run_dir),
            "--render",
            str(script),
        ],
        cache,
    )
    assert proc.returncode == 0, proc.stderr
    written = yaml.safe_load((run_dir / "config.yaml").read_text())["models"]
    assert written["actor"]["path"] == written["tokenizer"]["path"] == written["teachers"][0]["path"]
    assert written["actor"]["path"] == str(snapshot) and Path(snapshot, "model.safetensors").is_file()


def test_a_hub_id_the_cache_lacks_is_refused_with_how_to_fetch_it(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    write_hub_snapshot(cache, "Qwen/Qwen3-1.7B", model)  # another id: this one is not there
    proc = submit_process(["--check", str(CONFIG), "--set", f"models.actor.path={HUB_ID}"], cache)
    assert proc.returncode == EXIT_USAGE, proc.stdout
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[0] == f"{CONFIG}: 1 problem", proc.stderr
    assert lines[1].startswith(
        f"  - models.actor.path: hub id {HUB_ID!r} is neither a directory here nor in "
    )
    assert f"the Hugging Face cache of this host ({cache})" in lines[1]
    assert f"`hf download {HUB_ID}`" in lines[1] and f"huggingface-cli download {HUB_ID}" in lines[1]


def test_an_unscored_teachers_hub_id_is_not_refused(model: Path, tmp_path: Path) -> None:
    """distillation_coefficient 0: no teacher is loaded, so its path is never read."""
    rc, out, err = check(
        model,
        ("Org/not-cached", model),
        "loss.distillation_coefficient=0",
        "loss.rl_coefficient=1",
        "data.samples_per_prompt=2",
        NO_SFT_WARMUP,  # a warm-up trains on the teachers' answers: refused without distillation
    )
    assert rc == 0, err


# ------------------------------------------------------------------------------- damaged files


def test_sound_models_pass(model: Path) -> None:
    rc, out, err = check(model, (model, model))
    assert rc == 0, err
    assert err == ""


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    ("damage", "file", "says"),
    [
        (lambda d: _truncate(d / "tokenizer.json"), "tokenizer.json", "truncated JSON"),
        (lambda d: (d / "tokenizer_config.json").write_text("{not json"), "tokenizer_config.json", "JSON"),
        (lambda d: (d / "config.json").write_bytes(b"\x00\x13garbage\xff"), "config.json", "unreadable"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json", "expected a JSON object"),
        (lambda d: (d / "config.json").write_text('{"hidden_size": 8}'), "config.json", "model_type"),
        (lambda d: _truncate(d / "model.safetensors", 0.9), "model.safetensors", "truncated"),
        (lambda d: _truncate(d / "model.safetensors", 0.0001), "model.safetensors", "truncated"),
        (lambda d: (d / "model.safetensors").unlink(), "m", "no weights"),
        (lambda d: (d / "tokenizer.json").unlink(), "m", "no tokenizer"),
    ],
    ids=[
        "truncated-tokenizer",
        "garbage-tokenizer-config",
        "binary-config",
        "config-not-object",
        "config-no-model-type",
        "truncated-safetensors-data",
        "truncated-safetensors-header",
        "no-weights",
        "no-tokenizer",
    ],
)
def test_a_damaged_file_is_refused_naming_field_and_file(model, tmp_path, damage, file, says) -> None:
    broken = copy_model(model, tmp_path)
    damage(broken)
    rc, out, err = check(model, (model, broken))
    assert rc == EXIT_USAGE and out == ""
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert problems and all(p.startswith("  - models.teachers[1].path: ") for p in problems), err
    named = str(broken / file) if file != "m" else str(broken)
    assert any(named in p and says in p for p in problems), err


def test_the_actors_damage_is_named_on_the_actors_fields(model: Path, tmp_path: Path) -> None:
    broken = copy_model(model, tmp_path)
    _truncate(broken / "tokenizer.json")
    rc, _, err = check(broken, (model, model))
    assert rc == EXIT_USAGE
    assert f"  - models.actor.path: {broken / 'tokenizer.json'}: truncated JSON" in err
    assert f"  - models.tokenizer.path: {broken / 'tokenizer.json'}: truncated JSON" in err


def test_a_teacher_with_another_tokenizer_is_refused(model: Path, tmp_path: Path) -> None:
    other = copy_model(model, tmp_path)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["x"], vocab["y"] = vocab["y"], vocab["x"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    rc, _, err = check(model, (model, other))
    assert rc == EXIT_USAGE
    assert "  - models.teachers[1].path: teacher 'legs' (" in err
    assert "does not share the tokenizer of actor 'actor'" in err and "token id" in err


def test_sharded_weights_check_every_shard_the_index_names(model: Path, tmp_path: Path) -> None:
    broken = copy_model(model, tmp_path)
    tensors, error = safetensors_header(broken / "model.safetensors")
    assert error is None and tensors
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00002.safetensors" for name in tensors}}
    index["weight_map"]["lm_head.extra"] = "model-00002-of-00002.safetensors"
    (broken / "model.safetensors").rename(broken / "model-00001-of-00002.safetensors")
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, _, err = check(model, (model, broken))
    assert rc == EXIT_USAGE
    assert (
        f"{broken / 'model-00002-of-00002.safetensors'}: missing (named by model.safetensors.index.json)"
        in err
    )


def test_safetensors_header_reads_sizes_exactly(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {"k": "v"}}
    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(24))
    assert safetensors_header(path) == ({"a": header["a"]}, None)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(25))
    assert safetensors_header(path)[1].endswith("1 trailing bytes")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(23))
    assert safetensors_header(path)[1].endswith(f"but its header describes {8 + len(raw) + 24}: truncated")
    header["a"]["data_offsets"] = [0, 20]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(20))
    assert "spans 20 bytes; expected 24" in safetensors_header(path)[1]
