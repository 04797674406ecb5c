"""The device a guard child computes on (`runtime/child_device.py`), as `RoleEnv.device` carries it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd_hpc.roles.env import RoleEnv, RoleEnvError
from mopd_hpc.runtime.child_device import ChildDevice
from mopd_hpc.runtime.topology import TopologyError


def test_no_gpu_is_the_cpu() -> None:
    for env in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}):
        device = ChildDevice.from_env(env)
        assert (device, device.is_cuda, device.torch_name) == (ChildDevice(), False, "cpu")


def test_the_first_visible_gpu_unless_the_plan_names_a_base() -> None:
    assert ChildDevice.from_env({"CUDA_VISIBLE_DEVICES": "4,5"}) == ChildDevice(0, "4", "4")
    colocated = ChildDevice.from_env({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "MOPD_BASE_GPU_ID": "2"})
    assert (colocated, colocated.torch_name) == (ChildDevice(2, "2", "2"), "cuda:2")
    uuid = ChildDevice.from_env({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def", "MOPD_BASE_GPU_ID": "1"})
    assert (uuid.index, uuid.token, uuid.physical) == (1, "GPU-def", "GPU-def")


def test_the_physical_id_follows_slurms_renumbering() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "6,7", "MOPD_BACKEND": "slurm"}
    assert ChildDevice.from_env(env | {"MOPD_BASE_GPU_ID": "1"}) == ChildDevice(1, "1", "7")
    assert ChildDevice.from_env(env | {"MOPD_BACKEND": "local"}) == ChildDevice(0, "0", "0")


def test_a_base_outside_the_visible_gpus_names_both() -> None:
    with pytest.raises(TopologyError, match=r"^MOPD_BASE_GPU_ID=2 is not among the 2 GPUs .*'0,1'"):
        ChildDevice.from_env({"CUDA_VISIBLE_DEVICES": "0,1", "MOPD_BASE_GPU_ID": "2"})
    with pytest.raises(TopologyError, match=r"^MOPD_BASE_GPU_ID='x': expected an integer >= 0"):
        ChildDevice.from_env({"CUDA_VISIBLE_DEVICES": "0", "MOPD_BASE_GPU_ID": "x"})


def test_the_role_env_carries_the_device(tmp_path: Path) -> None:
    env = {"MOPD_RUN_DIR": str(tmp_path), "MOPD_ROLE": "rollout", "MOPD_INDEX": "1", "MOPD_JOB_ID": "7"}
    assert RoleEnv.from_env(env).device == ChildDevice()
    gpu = RoleEnv.from_env(env | {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "MOPD_BASE_GPU_ID": "3"})
    assert (gpu.device.index, gpu.device.torch_name) == (3, "cuda:3")
    with pytest.raises(RoleEnvError, match="CUDA_VISIBLE_DEVICES='0,,1'"):
        RoleEnv.from_env(env | {"CUDA_VISIBLE_DEVICES": "0,,1"})
