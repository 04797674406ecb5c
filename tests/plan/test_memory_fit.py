"""The memory plan decides (`plan/memory_fit.py`, `launch/memory_check.py`): a plan over a known GPU memory is
refused, naming the phase, the child, its largest holding and the way out solved from the plan; the GPU's memory
from `cluster.<group>.gpu_memory_gb`, `gpu_type` or this machine's GPU; the HF engine's KV cache bounded by
`rollout.graph_rows`.

The production case is issue 31's: `configs/gsm8k_qwen3_14b_to_0_6b.yaml` (Qwen3-0.6B student, Qwen3-14B teacher)
squeezed onto one GPU with the HF rollout engine, where the rollout's KV cache — not the micro-batch — is the
culprit. The models' config.json are the public model cards' shapes (no weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_models import QWEN3_0_6B

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.config.cluster import GPU_TYPE_GIB
from mopd_hpc.launch.memory_check import LOCAL_SOURCE, UNCHECKED, memory_check
from mopd_hpc.plan import memory_fit as mf
from mopd_hpc.plan import memory_plan as mp
from mopd_hpc.plan.placement import place_children

REPO = Path(__file__).resolve().parents[2]
GSM8K = REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml"
COLOCATED = REPO / "configs" / "local_gpu_colocated_awex.yaml"
#: Qwen3-14B's config.json fields (the model card's).
QWEN3_14B = {
    "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 17408, "vocab_size": 151936, "tie_word_embeddings": False,
}  # fmt: skip
#: The GSM8K shape on one GPU: actor, teacher and one HF rollout engine share it.
ONE_GPU = [
    "cluster.group.gpus_per_node=1", "models.actor.tensor_parallel=1", "models.teachers.0.tensor_parallel=1",
    "rollout.engines.count=1", "rollout.backend=hf",
]  # fmt: skip


def read(path: str) -> dict[str, object]:
    return QWEN3_14B if "14B" in path else QWEN3_0_6B


def refusals(config: Path, sets: list[str]) -> list[str]:
    cfg = load_run_config(str(config), sets, False)
    return mf.memory_refusals(cfg, place_children(cfg), read)


@pytest.mark.parametrize("gpu_type", ["H100-80GB", "H200-141GB"])
def test_the_shipped_gsm8k_plan_fits_80_and_141_gib_cards(gpu_type: str) -> None:
    assert refusals(GSM8K, [f"cluster.group.gpu_type={gpu_type}"]) == []


def test_gsm8k_on_one_gpu_names_the_rollout_kv_cache_and_the_graph_rows_that_fit() -> None:
    sets = [*ONE_GPU, "cluster.group.gpu_type=H100-80GB"]
    (refusal,) = refusals(GSM8K, sets)
    # 1,024 rows × (1,024 + 2,048) slots × 28 layers × K and V × 8 heads × 128 × 2 bytes
    kv = 1024 * 3072 * 28 * 2 * 8 * 128 * 2
    assert (
        f"(largest holding: rollout 0's KV cache (1024 rows × 3072 slots), {kv / 2**30:.1f} GiB)" in refusal
    )
    assert refusal.startswith(
        "cluster.group.gpu_type (H100-80GB: 79.6 GiB): the memory plan of cluster.group "
    )
    assert (
        "micro_batch_tokens" not in refusal and "activation_checkpointing" not in refusal
    )  # not the culprit
    n = int(refusal.split("rollout.graph_rows ≤ ")[1].split(" ")[0])
    assert refusals(GSM8K, [*sets, f"rollout.graph_rows={n}"]) == []
    assert refusals(GSM8K, [*sets, f"rollout.graph_rows={n + 1}"]) != []
    # the bound is the plan's: N rows of cache, and the engine decodes at most N rows together
    cfg = load_run_config(str(GSM8K), [*sets, f"rollout.graph_rows={n}"], False)
    (gpu,) = mp.memory_plan(cfg, place_children(cfg), read)
    (cache,) = [h for c in gpu.children for h in c.holdings if h.what.startswith("KV cache")]
    assert (
        cache.what == f"KV cache ({n} rows × 3072 slots)" and cache.bytes == n * 3072 * 28 * 2 * 8 * 128 * 2
    )


def test_the_rollout_role_decodes_at_most_graph_rows_together(tmp_path: Path) -> None:
    from mopd_hpc.roles.env import RoleEnv
    from mopd_hpc.roles.rollout import server_args

    role = RoleEnv.from_env(
        {
            "MOPD_RUN_DIR": str(tmp_path), "MOPD_ROLE": "rollout", "MOPD_INDEX": "0", "MOPD_JOB_ID": "local-1",
            "MOPD_BACKEND": "local", "MOPD_HOST": "localhost", "MOPD_WORLD_SIZE": "1", "MOPD_PORT_HTTP": "1",
        }
    )  # fmt: skip
    bounded = server_args(role, load_run_config(str(COLOCATED), ["rollout.graph_rows=48"], False), {})
    assert (bounded.max_batch_rows, bounded.graph_rows) == (48, 48)
    whole = server_args(role, load_run_config(str(COLOCATED), [], False), {})
    cfg = load_run_config(str(COLOCATED), [], False)
    rows = cfg.data.batch_size * cfg.data.samples_per_prompt
    assert (whole.max_batch_rows, whole.graph_rows) == (rows, rows)
    above = server_args(role, load_run_config(str(COLOCATED), [f"rollout.graph_rows={rows + 8}"], False), {})
    assert above.graph_rows == rows  # a bound above the share: the share


def test_the_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.graph_rows: .*sglang sizes a KV pool of its own"):
        load_run_config(str(GSM8K), ["rollout.backend=sglang", "rollout.graph_rows=64"], False)
    with pytest.raises(ConfigError, match=r"cluster\.group\.gpu_type: the GPU's memory is given twice"):
        load_run_config(
            str(COLOCATED), ["cluster.group.gpu_type=H200-141GB", "cluster.group.gpu_memory_gb=80"], False
        )
    with pytest.raises(ConfigError, match=r"cluster\.group\.gpu_type"):
        load_run_config(str(COLOCATED), ["cluster.group.gpu_type=V100"], False)
    cfg = load_run_config(str(COLOCATED), ["cluster.group.gpu_type=H200-141GB"], False)
    assert cfg.cluster.group.capacity_gib == GPU_TYPE_GIB["H200-141GB"] == 140.4
    (gpu,) = mp.memory_plan(cfg, place_children(cfg), read)
    assert gpu.capacity_gib == 140.4


def test_check_holds_a_local_job_to_this_machines_gpu_and_says_when_nothing_is_known() -> None:
    long = ["data.batch_size=256", "rollout.sampling.max_new_tokens=2048"]
    local = load_run_config(str(COLOCATED), long, False)
    unknown = memory_check(local, read, local_memory=lambda: None)
    assert unknown == mf_check((), UNCHECKED)
    (refusal,) = memory_check(local, read, local_memory=lambda: 80.0).refusals
    assert refusal.startswith(
        f"{LOCAL_SOURCE} (80 GiB): the memory plan of cluster.group node 0 GPU 0 needs "
    )
    assert "rollout.graph_rows ≤ " in refusal
    # on Slurm this machine's GPU is not the job's: unknown unless the config says
    slurm = load_run_config(str(COLOCATED), [*long, "cluster.backend=slurm"], False)
    assert memory_check(slurm, read, local_memory=lambda: 80.0) == mf_check((), UNCHECKED)
    known = load_run_config(
        str(COLOCATED), [*long, "cluster.backend=slurm", "cluster.group.gpu_memory_gb=80"], False
    )
    checked = memory_check(known, read, local_memory=lambda: None)
    assert checked.unchecked == "" and checked.refusals[0].startswith(
        "cluster.group.gpu_memory_gb (80 GiB): "
    )
    cpu = load_run_config(str(REPO / "configs" / "local_cpu.yaml"), [], False)
    assert memory_check(cpu, read, local_memory=lambda: 80.0) == mf_check()


def test_teachers_on_their_own_gpus_is_named_when_they_are_the_culprit() -> None:
    """A 14B teacher beside a 0.6B student on a 40 GiB card: only taking the teacher off the GPU fits it."""
    sets = ["models.teachers.0.residency=always", "cluster.group.gpu_type=A100-40GB"]
    cfg = load_run_config(str(COLOCATED), sets, False)

    def big_teacher(path: str) -> dict[str, object]:
        return QWEN3_14B if "teacher" in path else QWEN3_0_6B

    (refusal,) = mf.memory_refusals(cfg, place_children(cfg), big_teacher)
    assert "(largest holding: teacher teacher's weights, 27.5 GiB)" in refusal
    assert refusal.endswith("teachers on GPUs of their own") or "teacher_placement: own_gpus" in refusal


def mf_check(refusals: tuple[str, ...] = (), unchecked: str = "") -> object:
    from mopd_hpc.launch.memory_check import MemoryCheck

    return MemoryCheck(refusals, unchecked)
