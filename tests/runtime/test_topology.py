"""RankTopology.from_env over every situation of issue 4, and `mopd-debug topology` as a subprocess."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mopd_hpc.runtime.topology import RankTopology, TopologyError

REPO = Path(__file__).resolve().parents[2]

#: `srun --het-group=0,1` over a job with component 0 = n1 (2 tasks), component 1 = n[2-3] (1 task
#: each); variables as observed on Slurm 22.05 (slurm-local-findings.md §4).
MULTI_GROUP_STEP = {
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_ID": "14",
    "SLURM_JOB_ID_HET_GROUP_0": "14",
    "SLURM_JOB_ID_HET_GROUP_1": "15",
    "SLURM_JOB_NODELIST": "n[1-3]",
    "SLURM_STEP_NODELIST": "n[1-3]",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "2",
    "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2",
    "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1(x2)",
}
#: One node, 4 tasks, every task sees the node's GPUs 3 and 1 ... (overridden per test).
PLAIN = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
}


def topo(env: dict[str, str], role: str | None = None, **kw: str) -> RankTopology:
    return RankTopology.from_env(env, role=role, **kw)


def error_of(env: dict[str, str], role: str | None = None, **kw: str) -> str:
    with pytest.raises(TopologyError) as info:
        RankTopology.from_env(env, role=role, **kw)
    assert isinstance(info.value, ValueError)
    return str(info.value)


@pytest.mark.parametrize(
    ("host", "procid", "nodeid", "localid", "group", "rank", "node_index", "hosts"),
    [
        ("n1", 0, 0, 0, 0, 0, 0, ["n1"]),
        ("n1", 1, 0, 1, 0, 1, 0, ["n1"]),
        ("n2", 2, 1, 0, 1, 0, 0, ["n2", "n3"]),
        ("n3", 3, 2, 0, 1, 1, 1, ["n2", "n3"]),
    ],
)
@pytest.mark.parametrize("hint", ["launcher", "hostname", "nodeid"])
def test_multi_group_step_rebases_rank(
    host: str,
    procid: int,
    nodeid: int,
    localid: int,
    group: int,
    rank: int,
    node_index: int,
    hosts: list[str],
    hint: str,
) -> None:
    env = dict(
        MULTI_GROUP_STEP, SLURM_PROCID=str(procid), SLURM_NODEID=str(nodeid), SLURM_LOCALID=str(localid)
    )
    if hint in ("launcher", "hostname"):
        env["SLURMD_NODENAME"] = host
    if hint in ("launcher", "nodeid"):
        env["MOPD_HET_GROUP"] = str(group)
    d = topo(env, role="probe").to_dict()
    assert (d["het_group"], d["het_size"], d["rank"], d["world_size"]) == (group, 2, rank, 2)
    assert (d["node_index"], d["node_count"], d["group_hosts"], d["hostname"]) == (
        node_index,
        len(hosts),
        hosts,
        host,
    )
    assert d["job_id"] == "14"
    assert d["local_world_size"] == (2 if group == 0 else 1)


def test_single_group_step_on_group_0() -> None:
    env = {
        "SLURM_HET_SIZE": "2", "SLURM_JOB_ID": "14", "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_NODELIST": "n1",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]",
        "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "0",
        "SLURM_LOCALID": "1", "SLURMD_NODENAME": "n1", "MOPD_HET_GROUP": "0",
    }  # fmt: skip
    d = topo(env, role="actor").to_dict()
    assert (d["het_group"], d["rank"], d["world_size"], d["local_rank"], d["group_hosts"]) == (
        0,
        1,
        2,
        1,
        ["n1"],
    )
    assert (d["gpu_tokens"], d["local_device_index"], d["physical_gpu"]) == ([], None, None)


def test_het_job_ignores_job_nodelist_of_another_group() -> None:
    # Older Slurm leaves SLURM_JOB_NODELIST at component 0's nodes inside a group-1 step.
    env = {
        "SLURM_HET_SIZE": "2", "SLURM_JOB_ID": "14", "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]",
        "SLURM_STEP_NODELIST": "n[2-3]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
        "SLURMD_NODENAME": "n2",
    }  # fmt: skip
    d = topo(env).to_dict()
    assert (d["het_group"], d["group_hosts"], d["node_index"], d["rank"]) == (1, ["n2", "n3"], 0, 0)


@pytest.mark.parametrize(("localid", "token", "index"), [("0", "3", 0), ("1", "1", 1)])
def test_non_contiguous_visible_devices(localid: str, token: str, index: int) -> None:
    env = dict(PLAIN, SLURM_LOCALID=localid, SLURM_PROCID=str(2 + int(localid)), CUDA_VISIBLE_DEVICES="3,1")
    t = topo(env, role="actor")
    assert t.gpu_tokens == ("3", "1")
    assert (t.local_device_index, t.device_token, t.physical_gpu) == (index, token, token)
    assert (t.rank, t.world_size, t.node_index, t.hostname, t.local_world_size) == (
        2 + index,
        4,
        1,
        "gpu08",
        2,
    )


def test_step_gpus_map_renumbered_indices_to_physical_ids() -> None:
    env = dict(PLAIN, CUDA_VISIBLE_DEVICES="0,1", SLURM_STEP_GPUS="4,6", SLURM_LOCALID="1", SLURM_PROCID="3")
    t = topo(env)
    assert (t.gpu_tokens, t.physical_gpus, t.physical_gpu) == (("0", "1"), ("4", "6"), "6")
    same = topo(dict(env, CUDA_VISIBLE_DEVICES="6,4"))  # not renumbered: tokens are the ids already
    assert (same.physical_gpus, same.physical_gpu) == (("6", "4"), "4")


@pytest.mark.parametrize(
    "token",
    ["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-8932f9", "GPU-8"],
)
def test_uuid_tokens_full_and_short_are_kept(token: str) -> None:
    t = topo(dict(PLAIN, CUDA_VISIBLE_DEVICES=token, SLURM_STEP_GPUS="2"), role="rollout")
    assert (t.gpu_tokens, t.local_device_index, t.physical_gpu) == ((token,), 0, token)


@pytest.mark.parametrize(
    "token", ["MIG-8932f937-d72c-4106-c12f-20bd9faed9f6", "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0"]
)
def test_mig_for_rollout_raises_and_for_actor_is_kept(token: str) -> None:
    env = dict(PLAIN, CUDA_VISIBLE_DEVICES=token)
    message = error_of(env, role="rollout")
    assert token in message and "MIG" in message and "'rollout'" in message and "whole GPUs" in message
    t = topo(env, role="actor")
    assert (t.gpu_tokens, t.local_device_index, t.physical_gpu) == ((token,), 0, token)


@pytest.mark.parametrize("value", [None, "", "NoDevFiles", "-1"])
def test_no_gpu(value: str | None) -> None:
    env = dict(PLAIN) if value is None else dict(PLAIN, CUDA_VISIBLE_DEVICES=value)
    d = topo(env, role="teacher").to_dict()
    assert (d["gpu_tokens"], d["local_device_index"], d["physical_gpu"], d["device_token"]) == (
        [],
        None,
        None,
        None,
    )


def test_negative_index_hides_the_rest_like_cuda() -> None:
    assert topo(dict(PLAIN, CUDA_VISIBLE_DEVICES="2,-1,3")).gpu_tokens == ("2",)


def test_local_backend_without_slurm() -> None:
    t = topo({"MOPD_HOSTNAME": "laptop"})
    assert t.to_dict() | {} == {
        "backend": "local", "role": None, "job_id": "local", "het_group": 0, "het_size": 1, "node_index": 0,
        "node_count": 1, "group_hosts": ["laptop"], "hostname": "laptop", "rank": 0, "world_size": 1,
        "local_rank": 0, "local_world_size": 1, "gpu_tokens": [], "local_device_index": None,
        "physical_gpus": [], "physical_gpu": None, "device_token": None,
    }  # fmt: skip


@pytest.mark.parametrize("how", ["env", "argument"])
def test_local_backend_inside_an_allocation_ignores_slurm_procid(how: str) -> None:
    env = dict(PLAIN, SLURM_PROCID="3", MOPD_RANK="1", MOPD_WORLD_SIZE="2", MOPD_HOSTNAME="gpu08")
    env["CUDA_VISIBLE_DEVICES"] = "0,1"
    kw = {"backend": "local"} if how == "argument" else {}
    if how == "env":
        env["MOPD_BACKEND"] = "local"
    t = topo(env, role="actor", **kw)
    assert (t.backend, t.rank, t.world_size, t.local_rank, t.job_id) == ("local", 1, 2, 1, "local")
    assert (t.local_device_index, t.device_token) == (1, "1")


def test_guard_child_on_slurm_takes_its_ranks_from_the_guard() -> None:
    env = dict(
        PLAIN, SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="1(x2)", SLURM_PROCID="1", SLURM_GPUS_ON_NODE="8"
    )
    env |= {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "MOPD_RANK": "11", "MOPD_WORLD_SIZE": "16"}
    env |= {"MOPD_LOCAL_RANK": "3", "MOPD_LOCAL_WORLD_SIZE": "8"}
    t = topo(env, role="actor")
    assert (t.backend, t.rank, t.world_size, t.local_rank, t.local_world_size) == ("slurm", 11, 16, 3, 8)
    assert (t.node_index, t.hostname, t.job_id, t.local_device_index, t.device_token) == (
        1,
        "gpu08",
        "77",
        3,
        "3",
    )
    assert "MOPD_WORLD_SIZE is not" in error_of(dict(env, MOPD_WORLD_SIZE=""))


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "4 tasks"]),
        ({"SLURM_PROCID": "x"}, ["SLURM_PROCID='x'", "integer"]),
        ({"SLURM_PROCID": ""}, ["SLURM_PROCID is not set", "--local"]),
        ({"SLURM_LOCALID": "2"}, ["SLURM_LOCALID=2", "2 tasks"]),
        ({"SLURMD_NODENAME": "gpu09"}, ["SLURMD_NODENAME='gpu09'", "gpu07"]),
        ({"SLURM_STEP_NODELIST": "gpu[07-"}, ["SLURM_STEP_NODELIST='gpu[07-'", "unbalanced"]),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, ["SLURM_TASKS_PER_NODE='2(x3)'", "3 nodes"]),
        ({"CUDA_VISIBLE_DEVICES": "0"}, []),  # control: valid
        ({"CUDA_VISIBLE_DEVICES": "gpu0"}, ["CUDA_VISIBLE_DEVICES='gpu0'", "'gpu0'"]),
        ({"CUDA_VISIBLE_DEVICES": "0,0"}, ["CUDA_VISIBLE_DEVICES='0,0'", "twice"]),
        ({"CUDA_VISIBLE_DEVICES": "0,,1"}, ["CUDA_VISIBLE_DEVICES='0,,1'", "empty item"]),
        ({"MOPD_BACKEND": "k8s"}, ["MOPD_BACKEND='k8s'", "'slurm', 'local'"]),
    ],
)
def test_contradictory_plain_input(change: dict[str, str], fragments: list[str]) -> None:
    env = {k: v for k, v in (PLAIN | change).items() if v}
    if not fragments:
        assert topo(env).local_device_index == 0
        return
    message = error_of(env)
    for fragment in fragments:
        assert fragment in message


def test_more_tasks_per_node_than_visible_gpus() -> None:
    env = dict(
        PLAIN, SLURM_NTASKS="8", SLURM_TASKS_PER_NODE="4(x2)", CUDA_VISIBLE_DEVICES="0,1", SLURM_PROCID="5"
    )
    message = error_of(env)
    assert (
        "CUDA_VISIBLE_DEVICES='0,1'" in message and "4 tasks" in message and "more tasks than GPUs" in message
    )


def test_a_subset_of_several_gpus_has_no_device_rule() -> None:
    env = dict(PLAIN, CUDA_VISIBLE_DEVICES="2,3", SLURM_GPUS_ON_NODE="8")
    message = error_of(env)
    assert "2 of the 8 GPUs" in message and "SLURM_GPUS_ON_NODE=8" in message


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"MOPD_HET_GROUP": "2"}, ["MOPD_HET_GROUP=2", "SLURM_HET_SIZE=2"]),
        ({"MOPD_HET_GROUP": "0", "SLURMD_NODENAME": "n3"}, ["SLURMD_NODENAME='n3'", "het group 0", "['n1']"]),
        ({"SLURM_NTASKS_HET_GROUP_1": ""}, ["SLURM_NTASKS_HET_GROUP_1 is not set", "rebase"]),
        ({"SLURM_NTASKS": "5", "SLURM_STEP_NUM_TASKS": "5"}, ["cannot rebase SLURM_PROCID=3", "5 tasks"]),
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "", "SLURM_STEP_NUM_TASKS": ""}, ["SLURM_PROCID=7", "rank 5"]),
    ],
)
def test_contradictory_het_input(change: dict[str, str], fragments: list[str]) -> None:
    env = MULTI_GROUP_STEP | {"SLURM_PROCID": "3", "SLURM_NODEID": "2", "SLURMD_NODENAME": "n3"}
    env = {k: v for k, v in (env | {"MOPD_HET_GROUP": "1"} | change).items() if v}
    message = error_of(env)
    for fragment in fragments:
        assert fragment in message


def test_het_group_that_cannot_be_told_apart() -> None:
    env = MULTI_GROUP_STEP | {
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n[1-3]",
        "SLURM_PROCID": "0",
        "SLURMD_NODENAME": "n1",
    }
    assert "export MOPD_HET_GROUP" in error_of(env)


def test_local_backend_contradictions() -> None:
    assert "MOPD_RANK=2 is not below MOPD_WORLD_SIZE=2" in error_of(
        {"MOPD_RANK": "2", "MOPD_WORLD_SIZE": "2"}
    )
    assert "MOPD_WORLD_SIZE='0'" in error_of({"MOPD_WORLD_SIZE": "0"})
    assert "role='rolout'" in error_of({"MOPD_HOSTNAME": "h"}, role="rolout")


def test_record_is_frozen_with_slots_and_env_is_never_read_implicitly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = topo(dict(PLAIN))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.rank = 0  # type: ignore[misc]
    assert not hasattr(t, "__dict__")
    monkeypatch.setenv("SLURM_JOB_ID", "999")
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert topo({"MOPD_HOSTNAME": "h"}).backend == "local"  # only the mapping passed in counts


def test_direct_construction_validates() -> None:
    fields = topo(dict(PLAIN, CUDA_VISIBLE_DEVICES="0")).to_dict()
    fields = {k: v for k, v in fields.items() if k not in ("physical_gpu", "device_token")}
    with pytest.raises(TopologyError, match=r"rank=9 not in \[0, world_size=4\)"):
        RankTopology.from_dict(fields | {"rank": 9})
    with pytest.raises(TopologyError, match="hostname='gpu07' is not group_hosts"):
        RankTopology.from_dict(fields | {"hostname": "gpu07"})


# ---- the CLI, as a real subprocess with a crafted environment -------------------------------------


def run_cli(module: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_cli_json_for_a_het_task() -> None:
    env = MULTI_GROUP_STEP | {
        "SLURM_PROCID": "3",
        "SLURM_NODEID": "2",
        "SLURMD_NODENAME": "n3",
        "MOPD_HET_GROUP": "1",
    }
    proc = run_cli(
        "mopd_hpc.cli.debug_topology", ["--json", "--role", "rollout"], env | {"CUDA_VISIBLE_DEVICES": "0"}
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["job_id"], d["het_group"], d["rank"], d["world_size"], d["hostname"]) == ("14", 1, 1, 2, "n3")
    assert (d["role"], d["gpu_tokens"], d["local_device_index"]) == ("rollout", ["0"], 0)


def test_cli_local_flag_inside_an_allocation() -> None:
    env = dict(PLAIN, MOPD_RANK="1", MOPD_WORLD_SIZE="3", MOPD_HOSTNAME="box")
    proc = run_cli("mopd_hpc.cli.debug_topology", ["--json", "--local"], env)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["backend"], d["rank"], d["world_size"], d["hostname"]) == ("local", 1, 3, "box")


def test_cli_table() -> None:
    proc = run_cli("mopd_hpc.cli.debug_topology", [], dict(PLAIN, CUDA_VISIBLE_DEVICES="GPU-8932f9"))
    assert proc.returncode == 0, proc.stderr
    assert "job 77" in proc.stdout and "GPU-8932f9" in proc.stdout and "gpu08" in proc.stdout


def test_cli_exit_2_with_the_error() -> None:
    proc = run_cli(
        "mopd_hpc.cli.debug_topology", ["--role", "rollout"], dict(PLAIN, CUDA_VISIBLE_DEVICES="MIG-abc1")
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "mopd-debug topology: error:" in proc.stderr and "'MIG-abc1'" in proc.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("mopd_hpc.cli.debug_ports") is None,
    reason="mopd-debug imports every verb; debug_ports (another part of issue 4) is not there yet",
)
def test_mopd_debug_routes_topology() -> None:
    proc = run_cli("mopd_hpc.cli.debug", ["topology", "--json"], dict(PLAIN))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rank"] == 2
    bad = run_cli("mopd_hpc.cli.debug", ["topology"], dict(PLAIN, SLURM_PROCID="9"))
    assert bad.returncode == 2 and "SLURM_PROCID=9" in bad.stderr
