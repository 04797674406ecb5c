"""The record types of what the job's engines and roles can run (their rows are config/capabilities.py's):
`ActorEngineSpec` (an actor engine), `TeacherEngineSpec` (a teacher engine), `RolloutBackendSpec` (a rollout
backend), `WeightSyncSpec` (a weight-sync backend), `ModelFamilySpec` (a checkpoint family). Each attribute
is documented here; the verified / unverified / unsupported rule is config/capabilities.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        expert_parallel: the largest expert-parallel size that has run (beyond it: unverified where
            `"expert_parallel"` is in `unverified`, its GPU test `expert_parallel_untested`; else unsupported).
        expert_parallel_untested: the GPU test of a larger expert-parallel size that has not run.
        unverified: the limits (`"tensor_parallel"`, `"data_parallel_gpu"`, `"expert_parallel"`) whose code goes
            beyond them,
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
    #: It moves a mixture-of-experts actor's experts (each under its checkpoint name, or transformers' fused
    #: tensors) into the rollout's (engines/expert_names.py); launch/moe_check.py refuses the others.
    experts: bool = True
    #: (rollout.mode, the GPU test that has not moved a mixture-of-experts actor's experts with it in that
    #: mode); a mode not named has run one. There the refusal of launch/moe_check.py is unverified (written
    #: and tested on CPU; allow_unverified lets it through).
    experts_untested: tuple[tuple[str, str], ...] = ()
    #: The actor checkpoint families (config.json `architectures[0]`) it converts; None: every declared family.
    #: launch/moe_check.py refuses the others.
    architectures: tuple[str, ...] | None = None

    def experts_untested_in(self, mode: str) -> str:
        """The GPU test that has not moved experts in rollout.mode `mode` ('' when one has)."""
        return dict(self.experts_untested).get(mode, "")


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
