"""The memory plan before anything starts (`plan/memory_plan.py`): per GPU of the job plan, each child's
holdings from the config and the models' config.json (`engines/memory/estimates.py`), the largest phase, the
`cluster.<group>.gpu_memory_gb` warning, and `mopd-submit --dry-run` / `--check` printing them.

The case is issue 21's: configs/local_gpu_colocated_awex.yaml (megatron actor and teacher, HF rollout, Qwen3-0.6B
shapes, one GPU) at 16 × 4 × 64 and at the 64 × 4 × 256 that ran out of memory on an H200.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import helpers_fork
import pytest
from helpers_models import QWEN3_0_6B, QWEN3_1_7B, write_stub_checkpoint

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.config.rollout import SGLANG_MEM_FRACTION
from mopd_hpc.engines.memory.estimates import ModelShape, default_micro_batch_tokens, micro_batch_bytes
from mopd_hpc.plan import memory_fit as mf
from mopd_hpc.plan import memory_plan as mp
from mopd_hpc.plan.placement import place_children

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local_gpu_colocated_awex.yaml"
OOM = ["data.batch_size=64", "rollout.sampling.max_new_tokens=256"]
GIB = 2**30


def plan_of(sets: list[str], read=lambda path: QWEN3_0_6B):
    cfg = load_run_config(str(CONFIG), sets, False)
    return cfg, mp.memory_plan(cfg, place_children(cfg), read)


def refusals(sets: list[str], read=lambda path: QWEN3_0_6B) -> list[str]:
    cfg = load_run_config(str(CONFIG), sets, False)
    return mf.memory_refusals(cfg, place_children(cfg), read)


def holdings(gpu: mp.GpuMemory) -> dict[tuple[str, str], mp.Holding]:
    return {(c.label, h.what.split(" (")[0]): h for c in gpu.children for h in c.holdings}


def test_the_colocated_gpu_plan_from_the_formulas() -> None:
    cfg, gpus = plan_of(OOM)
    (gpu,) = gpus
    assert (gpu.group, gpu.node, gpu.gpu, gpu.capacity_gib) == ("group", 0, "0", None)
    assert [c.label for c in gpu.children] == ["actor 0", "teacher teacher", "rollout 0"]
    shape = ModelShape.from_hf_config(QWEN3_0_6B)
    p = shape.params
    h = holdings(gpu)
    assert h["actor 0", "weights"] == mp.Holding("weights", 2 * p)
    assert h["actor 0", "gradients"] == mp.Holding("gradients", 4 * p)  # megatron's fp32 grad buffer
    assert h["actor 0", "optimizer"].bytes == 12 * p  # fp32 main params + Adam moments, DP 1
    rows, length = 64 * 4, 64 + 256
    act = h["actor 0", "activations"]
    assert act.phase == "train" and act.what.startswith(f"activations ({rows * length:,} positions")
    assert act.bytes == micro_batch_bytes(shape, "bfloat16", "megatron", rows * length, rows * 256)
    assert h["teacher teacher", "weights"] == mp.Holding("weights", 2 * p, "teacher")
    rows_scored = (4 << 30) // (length * 151936 * 4)  # roles/teacher.py scoring_rows: 22
    assert h["teacher teacher", "scoring buffers"].bytes == rows_scored * 151936 * (length * 2 + 256 * 4)
    kv = h["rollout 0", "KV cache"]
    slots = 64 + 256  # graph_shape.graph_length: prompt and new tokens each rounded up to 64
    assert kv.what == f"KV cache ({rows} rows × {slots} slots)"
    assert (kv.bytes, kv.phase) == (rows * slots * 28 * 2 * 8 * 128 * 2, None)  # held: the CUDA graphs
    pool = h["rollout 0", "CUDA-graph pool"]
    assert (pool.bytes, pool.phase) == (rows * 151936 * 8, None)  # one decode step's, between batches too
    peak, phase = gpu.peak()
    # actor state + rollout weights, KV cache and CUDA-graph pool
    resident = 2 * p + 4 * p + 12 * p + 2 * p + kv.bytes + pool.bytes
    assert (peak, phase) == (resident + act.bytes, "train")
    assert gpu.children[1].in_phase("train") == 0 and gpu.children[1].in_phase("teacher") > 0
    lines = mp.format_memory_plan(gpus)
    assert lines[0].startswith("# memory plan per GPU")
    assert lines[1] == f"#   cluster.group node 0 GPU 0: {peak / GIB:.1f} at most (in train)"
    assert "the run caps it by the free memory" in lines[2]


#: The whole 64 × 4 × 256 step in one micro-batch (the OOM of issue 21).
WHOLE = "models.actor.micro_batch_tokens=81920"


def test_a_plan_over_the_gpu_is_refused_with_the_micro_batch_that_fits() -> None:
    """The whole 64 × 4 × 256 step in one micro-batch on 140 GiB: refused, naming the train phase, the actor's
    activations and the largest whole-row budget that fits — which, applied, fits, and one row more does not."""
    sets = [*OOM, WHOLE, "cluster.group.gpu_memory_gb=140"]
    cfg, gpus = plan_of(sets)
    ((over,),) = [mf.overflows(cfg, place_children(cfg), lambda path: QWEN3_0_6B)]
    (refusal,) = refusals(sets)
    assert refusal.startswith(
        "cluster.group.gpu_memory_gb (140 GiB): the memory plan of cluster.group node 0 GPU 0 needs "
        f"{over.need / GIB:.1f} GiB in the train phase, more than the GPU has (largest holding: actor 0's "
        "activations (81,920 positions a micro-batch)"
    )
    assert over.need == gpus[0].peak()[0] + 3 * mp.CUDA_CONTEXT_BYTES  # the teacher offloaded: no room
    budget = int(refusal.split("models.actor.micro_batch_tokens ≤ ")[1].split(" ")[0].replace(",", ""))
    assert f"({budget // 320} rows of 320; now 81,920)" in refusal  # whole rows of 64 + 256 positions
    assert "activation_checkpointing: true" in refusal  # recompute alone fits the step too
    assert (
        refusals([*OOM, "cluster.group.gpu_memory_gb=140", f"models.actor.micro_batch_tokens={budget}"]) == []
    )
    assert refusals(
        [*OOM, "cluster.group.gpu_memory_gb=140", f"models.actor.micro_batch_tokens={budget + 320}"]
    )
    # A micro-batch budget brings the same step under the GPU's memory.
    _, fits = plan_of([*OOM, "cluster.group.gpu_memory_gb=140", "models.actor.micro_batch_tokens=16384"])
    assert refusals([*OOM, "cluster.group.gpu_memory_gb=140", "models.actor.micro_batch_tokens=16384"]) == []
    assert fits[0].peak()[0] < 100 * GIB
    assert "16,320 positions" in "\n".join(mp.format_memory_plan(fits))  # whole rows of 320 positions
    # Recompute shrinks the activations too.
    _, ckpt = plan_of([*OOM, WHOLE, "models.actor.activation_checkpointing=true"])
    assert ckpt[0].peak()[0] < gpus[0].peak()[0]


def test_a_null_budget_with_the_gpus_memory_known_is_the_one_the_engine_derives() -> None:
    """micro_batch_tokens null and 140 GiB: the budget is `default_micro_batch_tokens` of what the train phase
    leaves free (the GPU less the actor's state, the other children's train-phase holdings and a CUDA context
    per child), floored to whole rows; the step then fits."""
    cfg, gpus = plan_of([*OOM, "cluster.group.gpu_memory_gb=140"])
    (gpu,) = gpus
    shape = ModelShape.from_hf_config(QWEN3_0_6B)
    h = holdings(gpu)
    state = sum(h["actor 0", k].bytes for k in ("weights", "gradients", "optimizer"))
    # the teacher is offloaded outside its phase here; the rollout engine holds its weights and KV cache
    others = h["rollout 0", "weights"].bytes + h["rollout 0", "KV cache"].bytes
    free = 140 * GIB - state - others - 3 * mp.CUDA_CONTEXT_BYTES
    budget = default_micro_batch_tokens(shape, "bfloat16", "megatron", free)
    positions = budget // 320 * 320
    act = h["actor 0", "activations"]
    assert act.what.startswith(f"activations ({positions:,} positions")
    assert act.bytes == micro_batch_bytes(shape, "bfloat16", "megatron", positions, positions * 256 // 320)
    assert refusals([*OOM, "cluster.group.gpu_memory_gb=140"]) == [] and gpu.peak()[0] <= 140 * GIB
    # Detected in the job instead of configured: the same plan.
    _, detected = plan_of(OOM)
    cfg2 = load_run_config(str(CONFIG), OOM, False)
    same = mp.memory_plan(cfg2, place_children(cfg2), lambda path: QWEN3_0_6B, capacity_gib=140.0)
    assert same == gpus and detected[0].capacity_gib is None


def test_eager_decoding_holds_the_kv_cache_in_the_rollout_only(tmp_path: Path) -> None:
    """`rollout.compile_decode: false`: the engine decodes eagerly and frees its KV cache after each batch, so
    the plan holds it in `rollout` only (and no CUDA-graph pool), the train phase has that much more free and the derived budget grows;
    the rollout role passes the switch to its server (`roles/rollout.server_args`)."""
    from mopd_hpc.roles.env import RoleEnv
    from mopd_hpc.roles.rollout import server_args

    sets = [*OOM, "cluster.group.gpu_memory_gb=140"]
    _, compiled = plan_of(sets)
    cfg, eager = plan_of([*sets, "rollout.compile_decode=false"])
    kv, kv_eager = (holdings(g[0])["rollout 0", "KV cache"] for g in (compiled, eager))
    assert (kv.phase, kv_eager.phase) == (None, "rollout") and kv.bytes == kv_eager.bytes
    pool = holdings(compiled[0])["rollout 0", "CUDA-graph pool"]  # no graphs when eager
    assert ("rollout 0", "CUDA-graph pool") not in holdings(eager[0])
    assert eager[0].children[2].in_phase("train") == (
        compiled[0].children[2].in_phase("train") - kv.bytes - pool.bytes
    )
    activations = [holdings(g[0])["actor 0", "activations"].bytes for g in (compiled, eager)]
    assert activations[1] > activations[0]  # the derived budget: more positions a micro-batch
    role = RoleEnv.from_env(
        {
            "MOPD_RUN_DIR": str(tmp_path), "MOPD_ROLE": "rollout", "MOPD_INDEX": "0", "MOPD_JOB_ID": "local-1",
            "MOPD_BACKEND": "local", "MOPD_HOST": "localhost", "MOPD_WORLD_SIZE": "1", "MOPD_PORT_HTTP": "1",
        }
    )  # fmt: skip
    assert server_args(role, cfg, {}).compile_decode is False
    assert server_args(role, load_run_config(str(CONFIG), sets, False), {}).compile_decode is True


@pytest.mark.parametrize(("mode", "phase"), [("colocated", "rollout"), ("separated", None)])
def test_a_colocated_sglang_engine_holds_its_gpu_in_the_rollout_only(mode: str, phase: str | None) -> None:
    """It releases weights and KV pool when the step leaves ROLLOUT (trainer/rollout_memory.py)."""
    sets = ["rollout.backend=sglang", "weight_sync.backend=torch", "weight_sync.awex_mode=null"]
    sets += ["cluster.group.gpu_memory_gb=140"]
    if mode == "separated":
        sets += ["rollout.mode=separated", "cluster.group.gpus_per_node=2"]
    cfg, gpus = plan_of(sets)
    rollout = [h for gpu in gpus for c in gpu.children if c.label == "rollout 0" for h in c.holdings]
    assert [h.what.split(" (")[0] for h in rollout] == ["weights", "KV pool"]
    assert all(h.phase == phase for h in rollout)
    weights, pool = rollout
    assert weights.bytes + pool.bytes == int(SGLANG_MEM_FRACTION * 140 * GIB)
    # rollout.mem_fraction_static sizes the pool (the role passes the same value to sglang.Engine)
    _, gpus = plan_of([*sets, "rollout.mem_fraction_static=0.3"])
    (weights, pool) = [h for gpu in gpus for c in gpu.children if c.label == "rollout 0" for h in c.holdings]
    assert (
        weights.bytes + pool.bytes == int(0.3 * 140 * GIB)
        and pool.what == "KV pool (mem_fraction_static 0.3)"
    )


@pytest.mark.parametrize(("sets", "why"), [(["rollout.mem_fraction_static=0.4"], "hf engine sizes its KV cache"),
                                           (["rollout.backend=sglang", "rollout.mem_fraction_static=1.0"], "less than 1")])  # fmt: skip
def test_mem_fraction_static_is_refused_with_hf_and_outside_0_1(sets: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match="rollout.mem_fraction_static") as err:
        load_run_config(str(CONFIG), [*sets, "weight_sync.backend=ipc", "weight_sync.awex_mode=null"], False)
    assert why in str(err.value)


def test_unreadable_models_and_cpu_jobs() -> None:
    cfg, gpus = plan_of([], read=lambda path: None)
    assert mp.format_memory_plan(gpus) == [
        "# memory plan: not planned — .cache/models/gpu_0_6b/student/config.json (actor 0, rollout 0) and "
        ".cache/models/gpu_0_6b/teacher/config.json (teacher teacher) are not readable here; it is made where "
        "they are: in the job, or with --local"
    ]
    assert all("not readable here: not planned" in c.note for c in gpus[0].children)  # residency's reason
    assert mf.memory_refusals(cfg, place_children(cfg), lambda path: None, capacity_gib=1.0) == []
    # Only the teacher's config.json unreadable: the GPU's plan without it, the teacher named once.
    _, part = plan_of([], read=lambda path: None if "teacher" in path else QWEN3_0_6B)
    lines = mp.format_memory_plan(part)
    assert lines[1].endswith("at most (in train; without 1 child not planned)")
    assert [line.split(":")[0] for line in lines[2:4]] == ["#     actor 0", "#     rollout 0"]
    assert lines[4:] == [
        "# memory plan: left out — .cache/models/gpu_0_6b/teacher/config.json (teacher teacher) is not "
        "readable here; it is made where it is: in the job, or with --local"
    ]
    cpu = load_run_config(str(REPO / "configs" / "local_cpu.yaml"), [], False)
    assert mp.memory_plan(cpu, place_children(cpu)) == ()
    assert mp.format_memory_plan(()) == ["# memory plan: no GPU in this job"]
    assert mf.memory_refusals(cpu, place_children(cpu), capacity_gib=1.0) == []


def test_constants_follow_the_engines_defaults() -> None:
    pytest.importorskip("torch")
    from mopd_hpc.engines.rollout.sglang_backend import SGLangLaunch
    from mopd_hpc.engines.teacher.process import TeacherArgs
    from mopd_hpc.roles.teacher import SCORING_BUDGET_BYTES

    assert mp.TEACHER_ROWS == TeacherArgs.__dataclass_fields__["max_batch_rows"].default
    assert mp.SCORING_BUDGET_BYTES == SCORING_BUDGET_BYTES
    assert SGLANG_MEM_FRACTION == SGLangLaunch.__dataclass_fields__["mem_fraction_static"].default


def mopd_submit(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOPD_"))}
    env["PYTHONPATH"] = str(REPO)
    return helpers_fork.run(
        ["-m", "mopd_hpc.cli.submit", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


#: A step whose rollout KV cache outgrows an 80 GiB card: 256 × 4 rows × (64 + 2,048) slots on one engine.
LONG = ["data.batch_size=256", "rollout.sampling.max_new_tokens=2048", "cluster.group.gpu_type=H100-80GB"]


def test_check_refuses_a_plan_over_the_gpu_and_the_way_out_it_names_passes(tmp_path: Path) -> None:
    """`mopd-submit --check` (a real subprocess, stub checkpoints of the 0.6B shape): the KV cache of the
    1,024 rows of a step is refused on an H100 naming the rollout phase's culprit and `rollout.graph_rows ≤ N`;
    --check with that N passes, with N + 1 it is refused; --dry-run still prints the plan, with the refusal as a
    warning."""
    for name in ("student", "teacher"):  # --check opens the files a child reads: a tokenizer, weights too
        write_stub_checkpoint(tmp_path / name, QWEN3_0_6B)
    sets = [f"models.actor.path={tmp_path / 'student'}", f"models.teachers.0.path={tmp_path / 'teacher'}"]
    sets += [f"models.tokenizer.path={tmp_path / 'student'}", *LONG]
    flags = [arg for s in sets for arg in ("--set", s)]
    check = mopd_submit(str(CONFIG), "--check", *flags, cwd=tmp_path)
    assert check.returncode == 2, check.stdout
    assert "the memory plan does not fit the GPU" in check.stderr
    assert (
        "cluster.group.gpu_type (H100-80GB: 79.6 GiB): the memory plan of cluster.group node 0 GPU 0"
        in check.stderr
    )
    assert "(largest holding: rollout 0's KV cache (1024 rows × 2112 slots), 231.0 GiB)" in check.stderr
    n = int(check.stderr.split("rollout.graph_rows ≤ ")[1].split(" ")[0])
    assert 1 <= n < 1024 and "(now 1024)" in check.stderr
    fits = mopd_submit(str(CONFIG), "--check", *flags, "--set", f"rollout.graph_rows={n}", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr
    over = mopd_submit(str(CONFIG), "--check", *flags, "--set", f"rollout.graph_rows={n + 1}", cwd=tmp_path)
    assert over.returncode == 2 and "rollout.graph_rows ≤ " in over.stderr
    dry = mopd_submit(str(CONFIG), "--dry-run", *flags, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "# memory plan per GPU (estimates, GiB; engines/memory/estimates.py):" in dry.stdout
    assert "#   cluster.group node 0 GPU 0: " in dry.stdout and " of 79.6 at most (in " in dry.stdout
    assert "# warning: cluster.group.gpu_type (H100-80GB: 79.6 GiB): the memory plan" in dry.stdout


# --- weight_sync.backend: ipc (engines/weight_sync/ipc.py) --------------------------------------------------

IPC = ["weight_sync.backend=ipc", "weight_sync.awex_mode=null"]
FIXED = "models.actor.micro_batch_tokens=16384"


def _own(child: mp.ChildMemory) -> int:
    return sum(h.bytes for h in child.holdings if not h.what.startswith("activations"))


def test_the_ipc_buffer_is_resident_on_actor_rank_0_as_measured() -> None:
    """With ipc the actor's GPU holds exactly the buffer more than with AWEX on the same config, in every
    phase; its size is the one the H200 measured for Qwen3-0.6B bf16 (benchmarks/results/weight_sync_ipc.json:
    the megatron converter's HF weights, tied head once)."""
    import json

    measured = json.loads((REPO / "benchmarks" / "results" / "weight_sync_ipc.json").read_text())
    (ipc_row,) = [r for r in measured["rows"] if r["method"] == "ipc" and r["size"] == "0.6b"]
    _, awex = plan_of([*OOM, FIXED])
    _, ipc = plan_of([*OOM, FIXED, *IPC])
    buffer = holdings(ipc[0])["actor 0", "ipc weight-sync buffer"]
    assert buffer == mp.Holding("ipc weight-sync buffer", ipc_row["bytes"])  # resident: phase None
    assert buffer.bytes == 1_192_099_840
    a, b = awex[0].children[0], ipc[0].children[0]
    assert all(b.in_phase(ph) - a.in_phase(ph) == buffer.bytes for ph in mp.PHASES)
    assert [c.in_phase(ph) for c in awex[0].children[1:] for ph in mp.PHASES] == [
        c.in_phase(ph) for c in ipc[0].children[1:] for ph in mp.PHASES
    ]
    assert ipc[0].peak()[0] - awex[0].peak()[0] == buffer.bytes
    assert "ipc weight-sync buffer 1.1;" in "\n".join(mp.format_memory_plan(ipc))
    # A null budget derived from the GPU's memory: the buffer is part of what the train phase leaves out.
    _, awex140 = plan_of([*OOM, "cluster.group.gpu_memory_gb=140"])
    _, ipc140 = plan_of([*OOM, "cluster.group.gpu_memory_gb=140", *IPC])
    assert _own(ipc140[0].children[0]) - _own(awex140[0].children[0]) == buffer.bytes
    act = {
        name: holdings(g[0])["actor 0", "activations"].bytes
        for name, g in (("awex", awex140), ("ipc", ipc140))
    }
    assert act["ipc"] < act["awex"] and ipc140[0].peak()[0] <= 140 * GIB


def test_the_ipc_buffer_warns_and_moves_the_teacher_out() -> None:
    """--check's over-capacity warning and the residency decision count the buffer: a GPU sized between the
    AWEX plan and the ipc plan warns with ipc only, and a teacher that stays with AWEX leaves with ipc."""
    from mopd_hpc.plan.residency_plan import planned_residency

    _, awex = plan_of([*OOM, FIXED])
    (gpu,) = awex
    buffer = mp.ipc_buffer_bytes(ModelShape.from_hf_config(QWEN3_0_6B), "bfloat16")
    from mopd_hpc.plan.residency_plan import gpu_bytes

    between = (gpu_bytes(gpu, frozenset())[0] + buffer // 2) / GIB  # the teacher offloaded: the least need
    sets = [*OOM, FIXED, f"cluster.group.gpu_memory_gb={between}"]
    assert refusals(sets) == []
    (refusal,) = refusals([*sets, *IPC])
    assert "in the train phase, more than the GPU has" in refusal
    # The teacher resident in every phase: fits with AWEX, not with the buffer too.

    need, _ = gpu_bytes(gpu, frozenset({"teacher"}))
    room = (need + buffer // 2) / GIB
    decisions = {}
    for name, extra in (("awex", []), ("ipc", IPC)):
        cfg = load_run_config(str(CONFIG), [*OOM, FIXED, *extra], False)
        decision, _ = planned_residency(cfg, place_children(cfg), lambda path: QWEN3_0_6B, capacity_gib=room)
        decisions[name] = decision
    assert (
        decisions["awex"].offload == frozenset()
        and "teacher teacher: resident" in decisions["awex"].reasons[0]
    )
    assert (
        decisions["ipc"].offload == {"teacher"} and "offloaded between phases" in decisions["ipc"].reasons[0]
    )


def test_other_syncs_and_cpu_jobs_hold_no_ipc_buffer() -> None:
    sep = load_run_config(str(REPO / "configs" / "local_gpu_separated.yaml"), [], False)
    gpus = mp.memory_plan(sep, place_children(sep), lambda path: QWEN3_0_6B)
    assert len(gpus) == 2 and not any(
        h.what.startswith("ipc") for g in gpus for c in g.children for h in c.holdings
    )
    _, torch_sync = plan_of(
        ["rollout.backend=sglang", "weight_sync.backend=torch", "weight_sync.awex_mode=null"]
    )
    assert not any(h.what.startswith("ipc") for c in torch_sync[0].children for h in c.holdings)
    cpu = load_run_config(str(REPO / "configs" / "local_cpu.yaml"), ["weight_sync.backend=ipc"], False)
    assert mp.memory_plan(cpu, place_children(cpu)) == ()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("engine", ["torch", "megatron"])
def test_ipc_buffer_bytes_is_what_the_sync_allocates(tmp_path: Path, engine: str, tied: bool) -> None:
    """The oracle: what `IpcSync` allocates on its first push over the engine's `named_weights()` of a real
    micro Qwen3 — the torch engine's own; megatron's at TP 1 is `mcore_to_hf(full_mcore_state())`, here of
    the checkpoint through `hf_to_mcore` with a padded vocabulary — and the bytes of its unique storages
    (a tied head once, though the torch engine names it twice)."""
    pytest.importorskip("torch")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mopd_hpc.config import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, mcore_to_hf, pad_vocab_size
    from mopd_hpc.engines.torch.engine import TorchTrainEngine
    from mopd_hpc.trainer.weight_sync import IpcSync

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(str(tmp_path / "model"))
    hf_config = config.to_dict()
    if engine == "torch":
        actor = TorchTrainEngine.from_pretrained(
            tmp_path / "model",
            dtype="bfloat16",
            device="cpu",
            optimizer=OptimizerConfig(lr=1e-3),
            loss=LossConfig(),
        )
        named = list(actor.named_weights())
    else:
        model = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.bfloat16)
        shape = Qwen3Shape.from_hf_config(hf_config, pad_vocab_size(40, 1))
        assert shape.padded_vocab_size > 40  # padded rows exist, and are dropped again
        named = list(mcore_to_hf(hf_to_mcore(model.state_dict(), shape), shape).items())
    assert len(named) == 2 + 11 * 2 + (engine == "torch" or not tied)  # lm_head.weight: torch names it tied
    sync = IpcSync(SimpleNamespace(named_weights=lambda: iter(named)))
    asyncio.run(sync.push(0, []))
    try:
        assert {t.dtype for _, t in named} == {torch.bfloat16}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in named}
        assert len(storages) == 2 + 11 * 2 + (not tied)
        expected = mp.ipc_buffer_bytes(ModelShape.from_hf_config(hf_config), "bfloat16")
        assert sync.buffers.nbytes == sum(storages.values()) == expected
    finally:
        asyncio.run(sync.close([]))


# --- the 8-GPU colocated config (configs/qwen3_8gpu_colocated.yaml) -----------------------------------------

GPU8 = REPO / "configs" / "qwen3_8gpu_colocated.yaml"


def test_a_colocated_child_is_planned_on_the_gpu_it_computes_on() -> None:
    """Colocated children see all 8 GPUs (CUDA_VISIBLE_DEVICES); each is planned on its own device only
    (`ChildSpec.compute_gpus`): GPU r holds actor r, one teacher rank and rollout engine r; an engine of
    TP 2 puts half of its weights on each of its two GPUs."""
    cfg = load_run_config(str(GPU8), [], False)
    gpus = mp.memory_plan(cfg, place_children(cfg), lambda path: QWEN3_1_7B)
    assert [g.gpu for g in gpus] == [str(i) for i in range(8)]
    assert [[c.child for c in g.children] for g in gpus] == [
        [f"actor {i}", f"teacher {i}", f"rollout {i}"] for i in range(8)
    ]
    weights = ModelShape.from_hf_config(QWEN3_1_7B).params * 2
    assert holdings(gpus[0])["rollout 0", "weights"].bytes == weights
    tp2 = load_run_config(  # sglang: an hf engine (the config's) runs on one GPU
        str(GPU8),
        ["rollout.backend=sglang", "rollout.engines.count=4", "rollout.engines.tensor_parallel=2"],
        False,
    )
    gpus2 = mp.memory_plan(tp2, place_children(tp2), lambda path: QWEN3_1_7B)
    engines = [[c.child for c in g.children if c.child.startswith("rollout")] for g in gpus2]
    assert engines == [[f"rollout {i // 2}"] for i in range(8)]
    assert holdings(gpus2[1])["rollout 0", "weights"].bytes == weights // 2


def _models(tmp_path: Path) -> None:
    for name in ("student", "teacher"):
        write_stub_checkpoint(tmp_path / "models" / "qwen3_8gpu" / name, QWEN3_1_7B)


@pytest.mark.parametrize("readable", [False, True])
def test_dry_run_of_the_8_gpu_config(tmp_path: Path, readable: bool) -> None:
    """Its models are not readable on the submit host (paths relative to the working directory): one summary
    line naming each config.json once with its children, no per-GPU or per-child line. Readable (stub
    checkpoints of the 1.7B shape where the config points): the per-GPU plan, one line per GPU and child."""
    if readable:
        _models(tmp_path)
    dry = mopd_submit(str(GPU8), "--dry-run", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    plan = [line for line in lines if line.startswith("# memory plan") or line.startswith("#   cluster.")]
    children = [line for line in lines if line.startswith("#     ")]
    if not readable:
        assert plan == [
            "# memory plan: not planned — models/qwen3_8gpu/student/config.json (actor ×8, rollout ×8) and "
            "models/qwen3_8gpu/teacher/config.json (teacher ×8) are not readable here; it is made where they "
            "are: in the job, or with --local"
        ]
        assert children == [] and dry.stdout.count("not readable here") == 1
        return
    assert plan[0] == "# memory plan per GPU (estimates, GiB; engines/memory/estimates.py):"
    assert [line.split(":")[0] for line in plan[1:]] == [
        f"#   cluster.group node 0 GPU {i}" for i in range(8)
    ]
    assert [line.split(":")[0] for line in children] == [
        f"#     {who}" for i in range(8) for who in (f"actor {i}", "teacher teacher", f"rollout {i}")
    ]
    assert "not readable" not in dry.stdout and "not planned" not in dry.stdout
