"""What the job's engines and roles can run: one frozen declaration per model family, actor engine, teacher
engine, rollout backend and weight-sync backend (issue 19), and the opt-in for what has not run on GPUs.

Where the rest lives: the declarations' record types (each attribute documented) are config/capability_specs.py;
the refusals derived from them are config/actor_refusals.py (loss, optimizer, the actor's shape, MoE) and
config/serving_refusals.py (teachers, rollout, the rollout package's version, weight sync, model families);
`config/job_gaps.py` applies them to a config, `config/refusals.py` renders them as the docs' table.

The rule: if `mopd-submit --check` passes, the job's roles can run the config. `--check` (so every submit)
refuses what a declaration here does not cover (`config/job_gaps.py` `job_gaps`, the config rules' device checks
in `config/rules.py`), each refusal a `Problem` naming the field, the value and the way out; the engines and
roles re-check the same declarations at start (a config edited after submit): `TorchTrainEngine` and
`MegatronTrainEngine` call `loss_refusals` (engine_only), `roles/actor.check_actor_engine` calls
`actor_refusals` and `loss_refusals`, the teacher role and server call `teacher_refusals`. When an issue adds a
capability, it changes a declaration below, nothing else: e.g. a reference model for the KL penalty is `reference=True` on the engine that scores
it; megatron top-k is `"topk"` in its `estimators`.

What each role starts: the actor role one process per trainer slot (`config/parallel.py` actor_world), the
engine's tp·pp·dp ranks; the teacher role one process per rank of each replica (`plan/placement.py`): at
tensor_parallel 1 one server, above it a leader serving HTTP plus tensor_parallel − 1 followers holding the
other shards (roles/teacher_replica.py); the rollout role one server per `rollout.engines.count`. A teacher
engine's tensor_parallel below is the largest replica that has run with it: the role's leader/follower path
is tested on CPU with a stand-in shard engine (tests/engines/test_teacher_replica_role.py), and megatron's stays at 1
until its replica of TP > 1 has run on GPUs (the multi-GPU issue).

Verified, unverified, unsupported: each limit below (tensor_parallel, data_parallel_gpu, trainer_ranks_gpu) is
the largest size that has RUN on GPUs here. A limit named in a declaration's `unverified` is one whose code
goes further (written, tested on CPU gloo ranks or with a stand-in) but whose GPU test has not run (its
`untested`): beyond it the refusal is unverified (`Problem.unverified`), and `allow_unverified: true`
(`mopd-submit --allow-unverified`) turns it into a warning. A limit not named there is unsupported (no
code runs beyond it, or the combination is known not to work: megatron at pipeline_parallel > 1, an hf
rollout engine over several GPUs, the torch broadcast between two ranks of one GPU): refused whatever the
opt-in says.

Imports no torch (it is read on the submit host in a second). The refusals' table in README.md and docs/ is
`refusals_table()` (tests/config/test_config_contract.py checks the docs hold it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from mopd_hpc.config.capability_specs import (
    ActorEngineSpec,
    ModelFamilySpec,
    RolloutBackendSpec,
    TeacherEngineSpec,
    WeightSyncSpec,
)
from mopd_hpc.config.problems import Problem

#: Device kinds a declaration names: "cpu" (a group with gpus_per_node 0) and "gpu".
DEVICES = ("cpu", "gpu")
#: The opt-in's config field (RunConfig.allow_unverified) and its command-line spelling.
OPT_IN_FIELD = "allow_unverified"
OPT_IN_FLAG = "--allow-unverified"
#: The way out an unverified refusal adds to its own.
OPT_IN_WAY = f"{OPT_IN_FIELD}: true ({OPT_IN_FLAG}) to run it unverified"


def unverified(problem: Problem, untested: str) -> Problem:
    """`problem` marked unverified (`untested`: the GPU test that has not run), its way out naming the opt-in."""
    way = f"{problem.expected}, or {OPT_IN_WAY}" if problem.expected else OPT_IN_WAY
    return replace(problem, expected=way, unverified=untested or "no GPU test yet")


def standing(problems: Iterable[Problem], allow_unverified: bool) -> list[Problem]:
    """The problems that refuse: all of them, or with `allow_unverified` all but the unverified ones."""
    return [p for p in problems if not (allow_unverified and p.unverified)]


#: The model families the job's engines load, by config.json `architectures[0]` (issue 33). The torch
#: engines and the hf rollout load each with transformers' class, SGLang with its own; the megatron engines
#: through the HF ⇄ megatron converter (engines/megatron/convert.py), which maps all three. Each has run on
#: an H100 as the megatron actor of the colocated job, 3 steps with the hf rollout (eager and compiled
#: decode) and with SGLang (`benchmarks/moe_step.py`, `--student llama`; benchmarks/results/moe_step*.json,
#: llama_step*.json), and its megatron logits equal transformers' (tests/engines/test_megatron_moe_gpu.py,
#: test_megatron_llama_gpu.py): nothing `untested`.
MODEL_FAMILIES: dict[str, ModelFamilySpec] = {
    "Qwen3ForCausalLM": ModelFamilySpec("Qwen3ForCausalLM", "qwen3", moe=False),
    # Qwen3-Coder-30B-A3B, Qwen3-30B-A3B, 235B-A22B: 128 experts, 8 routed per token
    "Qwen3MoeForCausalLM": ModelFamilySpec("Qwen3MoeForCausalLM", "qwen3_moe", moe=True),
    # Llama 3.x (3.1/3.2/3.3: the llama3 RoPE scaling of its config.json)
    "LlamaForCausalLM": ModelFamilySpec("LlamaForCausalLM", "llama", moe=False),
}


#: The causal-LM class transformers picks for a config.json without `architectures`, by its model_type.
MODEL_TYPE_ARCHITECTURES = {spec.model_type: name for name, spec in MODEL_FAMILIES.items()}


ACTOR_ENGINES: dict[str, ActorEngineSpec] = {
    "torch": ActorEngineSpec(
        name="torch",
        devices=("cpu", "gpu"),
        estimators=("sampled", "topk"),
        loss_rl=True,
        advantage_rl=("sampled",),  # the topk estimator has no per-token advantage to add α·A_ORM to
        reference=True,  # engines/reference.py: the starting actor, scored in each rank's TEACHER phase
        schedules=("constant", "cosine", "linear"),
        warmup=True,
        tensor_parallel=1,
        pipeline_parallel=1,
        data_parallel_cpu=None,  # DDP over gloo (issue 16)
        data_parallel_gpu=1,  # DDP over NCCL has not run in the job yet: the same code as over gloo
        untested="a torch actor at DP 2 on 2 GPUs (DDP over NCCL; no GPU test yet)",
        unverified=("data_parallel_gpu",),
        router_losses=True,  # engines/moe_routing.py
        routing_replay=True,
        expert_parallel=1,  # transformers' MoE blocks hold every expert on the rank
    ),
    "megatron": ActorEngineSpec(
        name="megatron",
        devices=("gpu",),
        estimators=("sampled", "topk"),  # top-k over the vocab-parallel logits (mopd/vocab_parallel.py)
        loss_rl=True,
        advantage_rl=("sampled",),
        reference=True,  # engines/reference.py with the megatron scoring engine
        schedules=("constant", "cosine", "linear"),  # megatron-core's OptimizerParamScheduler
        warmup=True,
        # the actor group starts every DP x TP rank of the megatron engine (tp_share, shard_plan, sharded
        # checkpoints); it has run at one rank only: the 2-GPU tests have not run
        tensor_parallel=1,
        pipeline_parallel=1,
        data_parallel_cpu=None,
        data_parallel_gpu=1,
        untested="tests/engines/test_megatron_actor_group_gpu.py (2 GPUs)",
        # megatron-core's EP group within the DP ranks (engines/megatron/expert_parallel.py: the DDP's expert
        # buffers, every expert gathered for the weight sync and the checkpoint); it has run on CPU over gloo
        # (tests/engines/test_megatron_ep_cpu.py), not on GPUs (NCCL, the alltoall dispatcher)
        expert_parallel=1,
        expert_parallel_untested="tests/engines/test_megatron_ep_gpu.py (2 GPUs)",
        router_losses=True,  # megatron-core's own, set on its config (engines/megatron/router_losses.py)
        routing_replay=True,  # megatron-core's RouterReplay (engines/megatron/routing_replay.py)
        unverified=(
            "tensor_parallel",
            "data_parallel_gpu",
            "expert_parallel",
        ),  # pipeline_parallel > 1: no code
    ),
}


TEACHER_ENGINES: dict[str, TeacherEngineSpec] = {
    "torch": TeacherEngineSpec("torch", devices=("cpu", "gpu"), tensor_parallel=1, topk=True),
    # a TP replica's leader/followers run on CPU with a stand-in shard engine; with megatron not yet on GPUs
    "megatron": TeacherEngineSpec(
        "megatron",
        devices=("gpu",),
        tensor_parallel=1,
        topk=True,
        unverified=("tensor_parallel",),
        untested="tests/engines/test_megatron_teacher_tp_gpu.py (2 GPUs)",
    ),
}


ROLLOUT_BACKENDS: dict[str, RolloutBackendSpec] = {
    # transformers generate on one device: an engine of tensor_parallel > 1 would use one of its GPUs
    "hf": RolloutBackendSpec(
        "hf", runs_in_job=True, devices=("cpu", "gpu"), tensor_parallel=1, routed_experts=True
    ),
    # roles/rollout_sglang.py: an in-process sglang.Engine, tensor parallel inside the engine, SGLang 0.5.17 (it
    # pins torch 2.11.0, the GPU machines' torch; 0.5.23 pins torch 2.14.1). CI runs a stand-in for
    # sglang.Engine; the one-GPU colocated path (ipc weight sync, memory release/resume) ran on an H100 with
    # SGLang 0.5.17 itself (tests/engines/test_sglang_ipc_gpu.py, benchmarks/results/gpu_step_roles.json); separated
    # engines on GPUs of their own have run with the stand-in only (2 GPUs): --check warns for that mode
    "sglang": RolloutBackendSpec(
        "sglang",
        runs_in_job=True,
        devices=("gpu",),
        tensor_parallel=None,
        package="sglang",
        stand_in_modes=("separated",),
        versions=("0.5.17", "0.5.18"),
    ),
}


WEIGHT_SYNCS: dict[str, WeightSyncSpec] = {
    "torch": WeightSyncSpec(
        "torch",
        actor_engines=("torch", "megatron"),
        rollout_backends=("hf", "sglang"),
        layouts=(("separated", "cpu"), ("separated", "gpu"), ("colocated", "cpu")),
    ),
    # engines/weight_sync/ipc.py: shared buffers (CUDA IPC / a /dev/shm file), read by the rollout server's
    # /update_weights_from_ipc: the hf server copies them into its parameters; the sglang server hands
    # SGLang's `Engine.update_weights_from_tensor` references to them (engines/rollout/sglang_ipc.py)
    "ipc": WeightSyncSpec(
        "ipc",
        actor_engines=("torch", "megatron"),
        rollout_backends=("hf", "sglang"),
        layouts=(("colocated", "cpu"), ("colocated", "gpu")),
    ),
    # the job's AWEX reader is the hf rollout server's (/awex/init); the writer is the megatron actor's, on
    # every trainer rank (trainer/rank_writer.py): from more than one it has not run on GPUs
    "awex": WeightSyncSpec(
        "awex",
        actor_engines=("megatron",),
        rollout_backends=("hf",),
        trainer_ranks_gpu=1,
        untested="tests/engines/test_awex_tp_gpu.py (a TP 2 actor: 2 GPUs colocated, 4 separated)",
        unverified=("trainer_ranks_gpu",),
        # megatron sends each expert under its checkpoint name; the hf engine's reader receives them into its
        # fused experts (engines/weight_sync/awex_hf.py): awex's plan replayed bitwise on CPU
        # (tests/engines/test_awex_hf.py); colocated, CUDA IPC, it ran bitwise on an H100
        # (tests/engines/test_awex_hf_gpu.py[colocate-qwen3_moe]); separated (NCCL, 2 GPUs) it has not
        experts_untested=(("separated", "tests/engines/test_awex_hf_gpu.py[separate-qwen3_moe] (2 GPUs)"),),
        # awex 0.9.0 registers converters by architecture (engines/weight_sync/awex.py REGISTERED_ARCHITECTURES;
        # tests/config/test_megatron_refusals.py checks these are among them): no Llama
        architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    ),
}


def other_ways(table: dict[str, Any], field: str, ok: Any, but: str = "") -> str:
    """', or <field>: a / b' for the declared names but `but` that `ok(spec)` accepts ('' when none)."""
    names = [name for name, spec in table.items() if name != but and ok(spec)]
    return f", or {field}: {' / '.join(names)}" if names else ""


def device_kinds(devices: tuple[str, ...]) -> str:
    """`("cpu", "gpu")` → "CPU / GPU": the device kinds as a refusal names them."""
    return " / ".join(d.upper() for d in devices)


def process_count(n: int) -> str:
    """How many processes a size of `n` ranks is, as a refusal says it: "one process", "at most n ranks"."""
    return "one process" if n == 1 else f"at most {n} ranks"
