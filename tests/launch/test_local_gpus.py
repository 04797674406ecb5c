"""The GPUs of a local job (launch/local_gpus.py), and how `mopd-submit --local` refuses a config that asks
for more GPUs than this machine shows, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mopd_hpc.launch.local import local_environment
from mopd_hpc.launch.local_gpus import LocalGpuError, local_gpu_tokens, machine_gpus

REPO = Path(__file__).resolve().parents[2]


def _listing(*tokens: str):
    return lambda: tokens


def test_machine_gpus_prefer_cuda_visible_devices() -> None:
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": "2,GPU-5e1c,MIG-ab"}, _listing("0")) == (
        "2",
        "GPU-5e1c",
        "MIG-ab",
    )
    assert machine_gpus({"CUDA_VISIBLE_DEVICES": ""}, _listing("0", "1")) == ()  # set and empty: none
    assert machine_gpus({}, _listing("0", "1")) == ("0", "1")  # unset: nvidia-smi's list
    with pytest.raises(LocalGpuError):
        machine_gpus({"CUDA_VISIBLE_DEVICES": "0,,1"}, _listing())


def test_the_first_gpus_per_node_are_taken() -> None:
    assert local_gpu_tokens({"CUDA_VISIBLE_DEVICES": "3,1,7"}, 2) == ("3", "1")
    assert local_gpu_tokens({}, 0, list_gpus=lambda: pytest.fail("no probe for a CPU job")) == ()


def test_too_few_gpus_names_the_field_and_both_counts() -> None:
    with pytest.raises(LocalGpuError) as info:
        local_gpu_tokens({}, 8, list_gpus=_listing("0"))
    assert str(info.value) == (
        "cluster.group.gpus_per_node: the config asks for 8 GPU(s), this machine shows 1 (nvidia-smi -L); run it "
        "where 8 GPU(s) are visible (CUDA_VISIBLE_DEVICES), or submit it to a Slurm cluster (cluster.backend: "
        "slurm, without --local)"
    )
    with pytest.raises(LocalGpuError, match=r"shows no GPU \(CUDA_VISIBLE_DEVICES=''\)"):
        local_gpu_tokens({"CUDA_VISIBLE_DEVICES": ""}, 1)
    with pytest.raises(LocalGpuError, match=r"shows no GPU \(nvidia-smi not found\)"):
        local_gpu_tokens({}, 1, list_gpus=lambda: None)


def test_the_guard_gets_the_chosen_gpus_and_cpu_jobs_get_none() -> None:
    assert (
        local_environment({"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}, ("1",))["CUDA_VISIBLE_DEVICES"]
        == "1"
    )
    assert local_environment({"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == ""


def test_submit_local_refuses_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml"),
         "--local", "--probe", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "cluster.group.gpus_per_node: the config asks for 8 GPU(s), this machine shows no GPU" in proc.stderr
    )
    assert not run_dir.exists()  # nothing prepared, nothing started
