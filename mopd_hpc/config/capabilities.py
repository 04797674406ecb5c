"""What the job's engines and roles can run: one frozen declaration per actor engine, teacher engine, rollout
backend and weight-sync backend (issue 19), and the refusals derived from them.

The rule: if `mopd-submit --check` passes, the job's roles can run the config. `--check` (so every submit)
refuses what a declaration here does not cover (`config/gaps.py` `job_gaps`, the config rules' device checks
in `config/rules.py`), each refusal a `Problem` naming the field, the value and the way out; the engines and
roles re-check the same declarations at start (a config edited after submit): `TorchTrainEngine` and
`MegatronTrainEngine` call `loss_refusals` (engine_only), `roles/actor.check_actor_engine` calls
`actor_refusals` and `loss_refusals`, the teacher role and server call `teacher_refusals`. When an issue adds a capability, it changes a declaration
below, nothing else: e.g. a reference model for the KL penalty is `reference=True` on the engine that scores
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

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mopd_hpc.config.problems import Problem, join_path

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


@dataclass(frozen=True, slots=True)
class ActorEngineSpec:
    """What an actor (train) engine runs, as the actor role builds it.

    Attributes:
        name: `models.actor.engine`.
        devices: device kinds it trains on ("cpu", "gpu").
        estimators: `loss.estimator` values its distillation term computes.
        loss_rl: the loss-level RL term c_rl·L_GRPO (`loss.rl_coefficient > 0`).
        advantage_rl: estimators with which the advantage-level term A_t + α·A_ORM (`loss.orm_alpha > 0`)
            runs.
        reference: the job's roles score a reference model for this actor, whose log-probs reach the KL
            penalty (`loss.kl_coefficient > 0`; the engines' GRPO term computes it when given them).
        schedules: `models.actor.optimizer.schedule` values; warmup: `warmup_ratio > 0` is applied.
        tensor_parallel, pipeline_parallel: the largest sizes the role runs.
        data_parallel_cpu, data_parallel_gpu: the largest data-parallel size on each device kind (None: any).
        untested: the GPU test that has not run beyond those sizes (named in the refusal; "" when the
            limit is the engine's own).
        router_losses: it adds a mixture-of-experts actor's router losses (`loss.router_*`).
        routing_replay: its forward replays the rollout's routed experts (`rollout.routing_replay`).
        expert_parallel: the largest expert-parallel size it runs; expert_parallel_untested: the GPU test
            that has not run beyond it ("" when the limit is the engine's own).
        unverified: the limits (`"tensor_parallel"`, `"data_parallel_gpu"`) whose code goes beyond them,
            not yet run on GPUs: `allow_unverified` lets a config past them (module docstring); the others
            are unsupported.
    """

    name: str
    devices: tuple[str, ...]
    estimators: tuple[str, ...]
    loss_rl: bool
    advantage_rl: tuple[str, ...]
    reference: bool
    schedules: tuple[str, ...]
    warmup: bool
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel_cpu: int | None
    data_parallel_gpu: int | None
    untested: str = ""
    router_losses: bool = False
    routing_replay: bool = False
    expert_parallel: int = 1
    expert_parallel_untested: str = ""
    unverified: tuple[str, ...] = ()

    def data_parallel(self, device: str) -> int | None:
        return self.data_parallel_gpu if device == "gpu" else self.data_parallel_cpu


@dataclass(frozen=True, slots=True)
class TeacherEngineSpec:
    """What a teacher (scoring) engine serves: device kinds, the largest tensor-parallel size that has run,
    top-k; `unverified` ("tensor_parallel") when a larger replica is written (roles/teacher_replica.py) but
    has not run on GPUs, `untested` the test that has not run."""

    name: str
    devices: tuple[str, ...]
    tensor_parallel: int
    topk: bool
    unverified: tuple[str, ...] = ()
    untested: str = ""


@dataclass(frozen=True, slots=True)
class RolloutBackendSpec:
    """A rollout backend: whether the rollout role runs it, on which devices, at what TP per engine."""

    name: str
    runs_in_job: bool
    devices: tuple[str, ...]
    tensor_parallel: int | None  # GPUs per engine; None: any that fits a node
    package: str | None = None  # the Python package the role imports for it (checked where the job runs)
    #: rollout modes tested with a stand-in for the package only: --check warns for them
    stand_in_modes: tuple[str, ...] = ()
    routed_experts: bool = False  # answers each token's routed experts (rollout routing replay)
    #: The package's versions the role has run with, as pip's (lowest inclusive, highest exclusive); also
    #: pyproject's extra of the same name (tests/engines/test_sglang_version.py checks the two agree).
    versions: tuple[str, str] | None = None

    @property
    def version_range(self) -> str:
        """The `versions` as a pip specifier, e.g. ">=0.5.17,<0.5.18" ("" when any version)."""
        return f">={self.versions[0]},<{self.versions[1]}" if self.versions else ""


@dataclass(frozen=True, slots=True)
class WeightSyncSpec:
    """A weight-sync backend: the actor engines it writes from and the rollout backends it reads into."""

    name: str
    actor_engines: tuple[str, ...]
    rollout_backends: tuple[str, ...]
    #: (rollout.mode, device) pairs it connects: the torch broadcast cannot join an actor and a rollout
    #: engine on one GPU (NCCL refuses two ranks of a communicator on one device); ipc shares memory,
    #: so it needs both on one node (colocated).
    layouts: tuple[tuple[str, str], ...] = (
        ("separated", "cpu"),
        ("separated", "gpu"),
        ("colocated", "cpu"),
        ("colocated", "gpu"),
    )
    #: The largest actor world (trainer ranks) it has run from on GPUs (None: whatever the actor engine runs),
    #: and the test that has not run beyond it (named in the refusal).
    trainer_ranks_gpu: int | None = None
    untested: str = ""
    #: ("trainer_ranks_gpu",): every trainer rank writes (written, tested on CPU), not yet run on GPUs.
    unverified: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelFamilySpec:
    """A checkpoint family the engines load (`MODEL_FAMILIES`).

    Attributes:
        architecture: config.json `architectures[0]` (the transformers causal-LM class).
        model_type: config.json `model_type` (names the class when `architectures` is absent).
        moe: a mixture of experts (a router and experts in its MLP layers): the router losses
            (`loss.router_*`) and rollout routing replay (`rollout.routing_replay`) apply to it.
        engines: the actor/teacher engines that load it.
        untested: (engine, the GPU test that has not run) for an engine that maps the family but has not run
            it on GPUs (named in the refusal).
    """

    architecture: str
    model_type: str
    moe: bool
    engines: tuple[str, ...] = ("torch", "megatron")
    untested: tuple[tuple[str, str], ...] = ()

    def untested_by(self, engine: str) -> str:
        """The GPU test that has not run `engine` with this family ('' when it has run)."""
        return dict(self.untested).get(engine, "")


# ---------------------------------------------------------------------------------------- the declarations

#: The model families the job's engines load, by config.json `architectures[0]` (issue 33). The torch
#: engines and the hf rollout load each with transformers' class; the megatron engines through the HF ⇄
#: megatron converter (engines/megatron/convert.py), which maps all three: Llama and the MoE experts and
#: router have not run through megatron on GPUs yet (`untested`).
MODEL_FAMILIES: dict[str, ModelFamilySpec] = {
    "Qwen3ForCausalLM": ModelFamilySpec("Qwen3ForCausalLM", "qwen3", moe=False),
    # Qwen3-Coder-30B-A3B, Qwen3-30B-A3B, 235B-A22B: 128 experts, 8 routed per token
    "Qwen3MoeForCausalLM": ModelFamilySpec(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        moe=True,
        untested=(("megatron", "tests/test_megatron_moe_gpu.py (megatron MoE logits = HF's, 1 GPU)"),),
    ),
    # Llama 3.x (3.1/3.2/3.3: the llama3 RoPE scaling of its config.json)
    "LlamaForCausalLM": ModelFamilySpec(
        "LlamaForCausalLM",
        "llama",
        moe=False,
        untested=(("megatron", "tests/test_megatron_llama_gpu.py (megatron Llama logits = HF's, 1 GPU)"),),
    ),
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
        # megatron-core's MoELayer shards experts over an expert-parallel group; EP 1 holds them all
        expert_parallel=1,
        expert_parallel_untested="tests/test_megatron_moe_gpu.py at expert_parallel 2 (2 GPUs)",
        unverified=("tensor_parallel", "data_parallel_gpu"),  # pipeline_parallel > 1: no code
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
    ),
}


# ---------------------------------------------------------------------------------------- the refusals


def _others(table: dict[str, Any], field: str, ok: Any, but: str = "") -> str:
    """', or <field>: a / b' for the declared names but `but` that `ok(spec)` accepts ('' when none)."""
    names = [name for name, spec in table.items() if name != but and ok(spec)]
    return f", or {field}: {' / '.join(names)}" if names else ""


def _devices(devices: tuple[str, ...]) -> str:
    return " / ".join(d.upper() for d in devices)


def _processes(n: int) -> str:
    return "one process" if n == 1 else f"at most {n} ranks"


def loss_refusals(engine: str, loss: Any, *, engine_only: bool = False) -> list[Problem]:
    """The `loss:` settings the job cannot train with the actor engine `engine` (paths `loss.*`), from its
    declaration; `engine_only`: only what the engine itself does not compute (its constructor's re-check: the
    reference log-probs of the KL penalty are an input the engine computes with, the job's roles supply them).

    A term is checked only when it is computed: the estimator when distillation_coefficient > 0, the
    advantage-level term when also orm_alpha > 0, the KL penalty when rl_coefficient > 0 (kl without RL is
    a config error of config/rules.py).
    """
    spec, out = ACTOR_ENGINES[engine], []
    actor = f"the {engine} actor engine"
    distill = loss.distillation_coefficient > 0
    if distill and loss.estimator not in spec.estimators:
        out.append(
            Problem(
                "loss.estimator",
                f"{actor} computes estimator {' / '.join(spec.estimators)} only",
                loss.estimator,
                f"loss.estimator: {spec.estimators[0]}"
                + _others(
                    ACTOR_ENGINES, "models.actor.engine", lambda s: loss.estimator in s.estimators, but=engine
                ),
            )
        )
    if loss.rl_coefficient > 0 and not spec.loss_rl:
        out.append(
            Problem(
                "loss.rl_coefficient",
                f"{actor} has no loss-level RL term (c_rl·L_GRPO)",
                loss.rl_coefficient,
                "rl_coefficient: 0 (loss.orm_alpha adds the reward at the advantage level)"
                + _others(ACTOR_ENGINES, "models.actor.engine", lambda s: s.loss_rl, but=engine),
            )
        )
    if distill and loss.orm_alpha > 0 and loss.estimator not in spec.advantage_rl:
        out.append(
            Problem(
                "loss.orm_alpha",
                f"the advantage-level composition A_t + α·A_ORM needs a per-token advantage: {actor} adds it "
                f"with estimator {' / '.join(spec.advantage_rl) or 'none'}, not {loss.estimator!r}",
                loss.orm_alpha,
                "orm_alpha: 0 (loss.rl_coefficient adds the reward as a loss term), or loss.estimator: "
                + " / ".join(spec.advantage_rl),
            )
        )
    if loss.rl_coefficient > 0 and loss.kl_coefficient > 0 and not spec.reference and not engine_only:
        out.append(
            Problem(
                "loss.kl_coefficient",
                f"the KL penalty needs a reference model's log-probs, and the job scores none for {actor}",
                loss.kl_coefficient,
                "kl_coefficient: 0"
                + _others(ACTOR_ENGINES, "models.actor.engine", lambda s: s.reference, but=engine),
            )
        )
    return out


def optimizer_refusals(engine: str, optimizer: Any) -> list[Problem]:
    """The lr schedule the actor engine `engine` does not apply (path models.actor.optimizer.schedule)."""
    spec = ACTOR_ENGINES[engine]
    if optimizer.schedule in spec.schedules and (spec.warmup or optimizer.warmup_ratio == 0):
        return []
    return [
        Problem(
            "models.actor.optimizer.schedule",
            f"the {engine} engine trains at "
            + (
                "a constant lr "
                if spec.schedules == ("constant",)
                else f"schedule {' / '.join(spec.schedules)} "
            )
            + f"(warmup_ratio {optimizer.warmup_ratio})",
            optimizer.schedule,
            f"schedule: {spec.schedules[0]}{'' if spec.warmup else ' and warmup_ratio: 0'} "
            f"with engine: {engine}"
            + _others(
                ACTOR_ENGINES, "engine", lambda s: s.warmup and optimizer.schedule in s.schedules, but=engine
            ),
        )
    ]


def actor_refusals(
    engine: str,
    device: str,
    world: int,
    tp: int,
    pp: int,
    *,
    how: str = "",
    group_path: str = "cluster.<group>",
) -> list[Problem]:
    """The actor shape the role does not run with engine `engine`: `world` ranks on `device` ("cpu"/"gpu")
    at tensor_parallel `tp` and pipeline_parallel `pp` (dp = world / (tp·pp)); `how` says how the world was
    counted, `group_path` is the trainer group's YAML path (for the way out)."""
    spec, out = ACTOR_ENGINES[engine], []
    if device not in spec.devices:
        return [
            Problem(
                "models.actor.engine",
                f"the {engine} engine trains on {_devices(spec.devices)} only; the actor's device is a "
                f"{device.upper()}",
                engine,
                f"a {_devices(spec.devices)} group ({group_path}.gpus_per_node)"
                + _others(ACTOR_ENGINES, "engine", lambda s: device in s.devices, but=engine),
            )
        ]
    if tp > spec.tensor_parallel:
        why = (
            f"tensor_parallel {tp} has not run with this engine yet: {spec.untested} has not run"
            if spec.untested
            else f"tensor_parallel {tp} needs ranks it does not start"
        )
        problem = Problem(
            "models.actor.tensor_parallel",
            f"the actor role runs the {engine} engine at tensor_parallel ≤ {spec.tensor_parallel} "
            f"({_processes(spec.tensor_parallel)}): {why}",
            tp,
            f"expected ≤ {spec.tensor_parallel}",
        )
        out.append(unverified(problem, spec.untested) if "tensor_parallel" in spec.unverified else problem)
    if pp > spec.pipeline_parallel:
        out.append(
            Problem(
                "models.actor.pipeline_parallel",
                f"the actor role runs the {engine} engine at pipeline_parallel ≤ {spec.pipeline_parallel}: "
                f"pipeline_parallel {pp} needs ranks it does not start",
                pp,
                f"expected ≤ {spec.pipeline_parallel}",
            )
        )
    dp, limit = world // max(1, tp * pp), spec.data_parallel(device)
    if limit is not None and dp > limit:
        slots = "one trainer slot" if limit * tp * pp == 1 else f"at most {limit * tp * pp} trainer slots"
        per_node = "gpus_per_node" if device == "gpu" else "actor_ranks_per_node"
        ways = [f"{slots} ({group_path}.nodes × {per_node})"]
        if device == "gpu" and "cpu" in spec.devices and spec.data_parallel_cpu is None:
            ways.append(f"CPU ranks ({group_path}.gpus_per_node: 0, actor_ranks_per_node)")
        for other in ACTOR_ENGINES.values():
            other_limit = other.data_parallel(device)
            if other.name == engine:
                continue
            if device in other.devices and (other_limit is None or other_limit >= dp):
                ways.append(f"engine: {other.name}")
            elif device == "gpu" and "cpu" in other.devices and other.data_parallel_cpu is None:
                ways.append(f"engine: {other.name} on CPU ranks")
        problem = Problem(
            "models.actor.engine",
            f"the actor role runs the {engine} engine at data-parallel size ≤ {limit} on "
            f"{device.upper()}s: the actor "
            f"has {world} trainer ranks{f' ({how})' if how else ''}, dp {dp} = world / "
            f"(tensor_parallel·pipeline_parallel)"
            + (f"; more has not run yet: {spec.untested}" if spec.untested else ""),
            engine,
            ", or ".join(ways),
        )
        written = f"data_parallel_{device}" in spec.unverified
        out.append(unverified(problem, spec.untested) if written else problem)
    return out


def teacher_refusals(
    index: int,
    engine: str,
    device: str,
    tp: int,
    estimator: str | None = None,
    *,
    table: Mapping[str, TeacherEngineSpec] = TEACHER_ENGINES,
) -> list[Problem]:
    """What the teacher role does not serve for `models.teachers[index]`: its `engine` on `device` at
    tensor_parallel `tp`, answering top-k when `estimator` is "topk". `table`: the declarations (the role's
    tests pass a stand-in engine's)."""
    spec, path, out = table[engine], join_path("models", "teachers", index), []
    if device not in spec.devices:
        out.append(
            Problem(
                f"{path}.engine",
                f"the {engine} teacher engine scores on {_devices(spec.devices)} only; the teacher's device "
                f"is a {device.upper()}",
                engine,
                "a GPU group" + _others(TEACHER_ENGINES, "engine", lambda s: device in s.devices, but=engine),
            )
        )
    if tp > spec.tensor_parallel:
        problem = Problem(
            f"{path}.tensor_parallel",
            f"the teacher role serves a {engine} teacher at tensor_parallel ≤ {spec.tensor_parallel}: a "
            f"replica of tensor_parallel {tp} (a leader and {tp - 1} follower rank(s)) has not run with "
            "this engine yet" + (f": {spec.untested} has not run" if spec.untested else ""),
            tp,
            f"expected ≤ {spec.tensor_parallel}",
        )
        out.append(unverified(problem, spec.untested) if "tensor_parallel" in spec.unverified else problem)
    if estimator == "topk" and not spec.topk:
        out.append(
            Problem(
                f"{path}.engine",
                f"the {engine} teacher engine answers no top-k (loss.estimator is 'topk')",
                engine,
                "loss.estimator: sampled" + _others(TEACHER_ENGINES, "engine", lambda s: s.topk, but=engine),
            )
        )
    return out


def rollout_refusals(backend: str, tensor_parallel: int) -> list[Problem]:
    """What the rollout role does not run: the `backend`, or its engines at `tensor_parallel`."""
    spec = ROLLOUT_BACKENDS[backend]
    running = [name for name, s in ROLLOUT_BACKENDS.items() if s.runs_in_job]
    if not spec.runs_in_job:
        return [
            Problem(
                "rollout.backend",
                f"the rollout role runs the {' / '.join(running)} server only",
                backend,
                f"expected {' / '.join(repr(r) for r in running)}",
            )
        ]
    if spec.tensor_parallel is not None and tensor_parallel > spec.tensor_parallel:
        return [
            Problem(
                "rollout.engines.tensor_parallel",
                f"a {backend} rollout engine runs on {_processes(spec.tensor_parallel)} (one device): the "
                f"other GPUs of an engine of tensor_parallel {tensor_parallel} would sit idle",
                tensor_parallel,
                f"expected ≤ {spec.tensor_parallel}, and more rollout.engines.count instead",
            )
        ]
    return []


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("0.5.17.post1" → (0, 5, 17))."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def version_refusals(backend: str, installed: str | None, where: str = "this machine") -> list[Problem]:
    """The rollout backend's package at version `installed` (None: not installed, said elsewhere) outside
    the versions the role has run with (`RolloutBackendSpec.versions`), naming both."""
    spec = ROLLOUT_BACKENDS[backend]
    if spec.versions is None or installed is None:
        return []
    low, high = (_release(v) for v in spec.versions)
    if low <= _release(installed) < high:
        return []
    return [
        Problem(
            "rollout.backend",
            f"{spec.package} {installed} is installed on {where}; the {backend} backend has run with "
            f"{spec.package}{spec.version_range} only",
            backend,
            f"pip install '{spec.package}{spec.version_range}', or rollout.backend: "
            + " / ".join(n for n, s in ROLLOUT_BACKENDS.items() if n != backend and s.runs_in_job),
        )
    ]


def weight_sync_refusals(
    backend: str,
    actor_engine: str,
    rollout_backend: str,
    rollout_mode: str = "separated",
    device: str = "cpu",
    actor_world: int = 1,
) -> Iterator[Problem]:
    """What the `backend` weight sync does not connect: the actor engine it writes from, the rollout it
    reads into, the placement (rollout.mode on `device`) it crosses, an actor of `actor_world` trainer ranks
    on GPUs beyond what it has run from (naming the test that has not run)."""
    spec = WEIGHT_SYNCS[backend]
    limit = spec.trainer_ranks_gpu
    if device == "gpu" and limit is not None and actor_world > limit:
        problem = Problem(
            "weight_sync.backend",
            f"the {backend} sync from {actor_world} trainer ranks (every rank a writer at its transfer rank) has "
            f"not run on GPUs: it has run from {'one trainer rank' if limit == 1 else f'{limit} trainer ranks'} only, and "
            f"{spec.untested} has not run",
            backend,
            ("one trainer slot" if limit == 1 else f"at most {limit} trainer slots")
            + _others(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: (
                    (s.trainer_ranks_gpu is None or s.trainer_ranks_gpu >= actor_world)
                    and actor_engine in s.actor_engines
                    and rollout_backend in s.rollout_backends
                    and (rollout_mode, device) in s.layouts
                ),
                but=backend,
            ),
        )
        yield unverified(problem, spec.untested) if "trainer_ranks_gpu" in spec.unverified else problem
    if (rollout_mode, device) not in spec.layouts:
        modes = [m for m, d in spec.layouts if d == device]
        yield Problem(
            "weight_sync.backend",
            f"the {backend} sync does not connect an actor and rollout engines {rollout_mode} on {device.upper()}"
            + (" (NCCL refuses two ranks on one GPU)" if backend == "torch" else ""),
            backend,
            (f"rollout.mode: {' / '.join(modes)}" if modes else "another backend")
            + _others(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: (
                    (rollout_mode, device) in s.layouts
                    and actor_engine in s.actor_engines
                    and rollout_backend in s.rollout_backends
                ),
                but=backend,
            ),
        )
    if actor_engine not in spec.actor_engines:
        yield Problem(
            "weight_sync.backend",
            f"the {backend} writer needs the {' / '.join(spec.actor_engines)} actor; models.actor.engine is "
            f"{actor_engine!r}",
            backend,
            f"models.actor.engine: {' / '.join(spec.actor_engines)}"
            + _others(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: actor_engine in s.actor_engines and (rollout_mode, device) in s.layouts,
                but=backend,
            ),
        )
    if rollout_backend not in spec.rollout_backends:
        yield Problem(
            "weight_sync.backend",
            f"the job's {backend} reader runs in the {' / '.join(spec.rollout_backends)} rollout server only; "
            f"rollout.backend is {rollout_backend!r}",
            backend,
            f"rollout.backend: {' / '.join(spec.rollout_backends)}"
            + _others(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: rollout_backend in s.rollout_backends and (rollout_mode, device) in s.layouts,
                but=backend,
            ),
        )


def model_family_refusals(field: str, engine: str | None, architecture: str, where: str) -> list[Problem]:
    """What the job does not load of the checkpoint at `field` (`models.actor.path`, `models.teachers[i].path`)
    read by `engine` (None: the rollout's, transformers): an `architecture` (config.json `architectures[0]`)
    of no declared family, or one `engine` has not run on GPUs; `where` names the directory."""
    spec = MODEL_FAMILIES.get(architecture)
    names = " / ".join(MODEL_FAMILIES)
    engine_field = field.removesuffix(".path") + ".engine"
    if spec is None or (engine is not None and engine not in spec.engines):
        return [
            Problem(
                field,
                f"the job's engines load {names} checkpoints only (config/capabilities.py MODEL_FAMILIES); "
                f"{where} is a {architecture}",
                architecture,
                f"a checkpoint of {names}",
            )
        ]
    untested = spec.untested_by(engine) if engine is not None else ""
    if not untested:
        return []
    ways = [f"{engine_field}: {e}" for e in spec.engines if e != engine and not spec.untested_by(e)]
    return [
        Problem(
            field,
            f"the {engine} engine maps {architecture} checkpoints (engines/megatron/convert.py) but has not run "
            f"one on GPUs: {untested} has not run; {where} is a {architecture}",
            architecture,
            ", or ".join(ways) or "another engine",
        )
    ]


def moe_refusals(
    engine: str, rollout_backend: str, loss: Any, routing_replay: bool, expert_parallel: int
) -> list[Problem]:
    """The mixture-of-experts settings the actor engine `engine` and the rollout `rollout_backend` do not run:
    the router losses, rollout routing replay, an expert-parallel size above the declared one (naming the GPU
    test that has not run). Whether the actor has routers at all is the model check's (launch/model_check.py)."""
    spec, out = ACTOR_ENGINES[engine], []
    aux = loss.router_aux_loss_coefficient
    if not spec.router_losses and ((aux or 0.0) > 0 or loss.router_z_loss_coefficient > 0):
        field = "router_aux_loss_coefficient" if (aux or 0.0) > 0 else "router_z_loss_coefficient"
        out.append(
            Problem(
                f"loss.{field}",
                f"the {engine} actor engine adds no router loss (its MoE layers' own aux loss is off)",
                getattr(loss, field),
                "0" + _others(ACTOR_ENGINES, "models.actor.engine", lambda s: s.router_losses, but=engine),
            )
        )
    if routing_replay and not spec.routing_replay:
        out.append(
            Problem(
                "rollout.routing_replay",
                f"the {engine} actor engine does not replay the rollout's routed experts",
                True,
                "false"
                + _others(ACTOR_ENGINES, "models.actor.engine", lambda s: s.routing_replay, but=engine),
            )
        )
    if routing_replay and not ROLLOUT_BACKENDS[rollout_backend].routed_experts:
        out.append(
            Problem(
                "rollout.routing_replay",
                f"the {rollout_backend} rollout backend does not answer the routed experts of its tokens",
                True,
                "false"
                + _others(
                    ROLLOUT_BACKENDS, "rollout.backend", lambda s: s.routed_experts, but=rollout_backend
                ),
            )
        )
    if expert_parallel > spec.expert_parallel:
        why = (
            f"expert_parallel {expert_parallel} has not run on GPUs: {spec.expert_parallel_untested} has not run"
            if spec.expert_parallel_untested
            else f"the {engine} engine holds every expert on each rank"
        )
        out.append(
            Problem(
                "models.actor.expert_parallel",
                f"the actor role runs the {engine} engine at expert_parallel ≤ {spec.expert_parallel}: {why}",
                expert_parallel,
                f"expected ≤ {spec.expert_parallel}",
            )
        )
    return out
