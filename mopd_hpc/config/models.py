"""The `models:` section: the actor (student), the teachers, the tokenizer they all share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mopd_hpc.config.base import Section
from mopd_hpc.config.problems import Problem, join_path, raise_if_any
from mopd_hpc.config.types import Dtype, Engine, Identifier, NonEmptyStr


class OptimizerConfig(Section):
    """AdamW of the actor, and its learning-rate schedule over the run's `steps`.

    lr(s) for step s = 1..steps (megatron-core's `OptimizerParamScheduler` on the megatron engine,
    transformers' schedules on the torch engine: the same values, engines/lr_schedule.py): linear warm-up
    from 0 to lr over the first round(warmup_ratio·steps) steps, then `constant` (lr), `cosine` (half a
    cosine period from lr down to min_lr_ratio·lr, reached just after the last step) or `linear` (a straight
    line from lr down to min_lr_ratio·lr, reached just after the last step).
    """

    lr: float = Field(gt=0, allow_inf_nan=False, description="Peak learning rate (after the warm-up).")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="After the warm-up: 'constant' lr, or 'cosine' / 'linear' decay to min_lr_ratio·lr at the "
        "last step (megatron: megatron-core's OptimizerParamScheduler).",
    )
    warmup_ratio: float = Field(
        0.0, ge=0, lt=1, allow_inf_nan=False, description="Linear warm-up, as a fraction of the run's steps."
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="'cosine' / 'linear': the final lr as a fraction of lr.",
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="AdamW decoupled weight decay (dimensionless); megatron skips 1-D parameters (norms) and "
        "biases, as megatron-core's standard parameter groups do.",
    )
    grad_clip: float | None = Field(
        1.0, gt=0, allow_inf_nan=False, description="Max global gradient L2 norm; null = no clipping."
    )


class ActorConfig(Section):
    """The student being trained (π_θ)."""

    id: Identifier = Field(
        description="Name of the actor: a label in mopd-submit's summary line (children, logs and metrics are "
        "named by role and rank)."
    )
    path: NonEmptyStr = Field(description="HF model id or local checkpoint directory (config.json, weights).")
    dtype: Dtype = Field("bfloat16", description="Parameter and compute dtype of the train engine.")
    engine: Engine = Field("torch", description="'torch' (transformers, CPU/GPU) or 'megatron' (GPU only).")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size, in GPUs (within one node).")
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline-parallel size, in stages (megatron only).")
    expert_parallel: int = Field(
        1,
        ge=1,
        description="Expert-parallel size of a mixture-of-experts actor, in GPUs: each MoE layer's experts split "
        "over that many ranks of the data-parallel group (megatron-core's EP group; the dense parts stay data "
        "parallel); 1 = every expert on each rank. > 1 (megatron engine): written, run on CPU only, so refused "
        "as unverified (allow_unverified lets it through, with a warning) until "
        "tests/engines/test_megatron_ep_gpu.py runs on 2 GPUs; refused where it cannot run: not dividing the "
        "data-parallel size or the expert count, a dense actor, the torch engine, tensor_parallel > 1, "
        "loss.kl_coefficient > 0, weight_sync.backend awex.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds an actor rank waits in a collective (gradient all-reduce, drain gather, barrier) "
        "for the other ranks, and the longest rank 0's heartbeat may stand still; a hung rank ends the job "
        "after this. Rank 0's evaluation and checkpoint saves do not count against it. It also bounds the "
        "collectives of a tensor-parallel teacher replica (leader and followers, roles/teacher_replica.py).",
    )
    optimizer: OptimizerConfig = Field(description="AdamW settings.")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of one train micro-batch: rows × padded positions (prompt + response) per "
        "forward/backward, gradients accumulated over the step's micro-batches (the loss is normalized over "
        "the whole step); null = on CPU each rank's whole shard in one micro-batch, on a GPU a budget derived "
        "at each step from the free GPU memory and the model's shape.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward instead of keeping them "
        "(torch: gradient checkpointing; megatron: full recompute, one layer per unit).",
    )

    @model_validator(mode="after")
    def _check(self) -> ActorConfig:
        if self.engine == "torch" and self.pipeline_parallel > 1:
            raise_if_any(
                [
                    Problem(
                        "pipeline_parallel",
                        "the torch engine has no pipeline parallelism",
                        self.pipeline_parallel,
                        "use 1, or engine: megatron",
                    )
                ]
            )
        return self


class TeacherConfig(Section):
    """One teacher π_j: forward-only scoring of the student's rollouts."""

    id: Identifier = Field(description="Teacher id, used in `routes:` weights.")
    path: NonEmptyStr = Field(description="HF model id or local checkpoint directory.")
    engine: Engine = Field("torch", description="Scoring engine: 'torch' or 'megatron' (GPU only).")
    dtype: Dtype = Field("bfloat16", description="Dtype of the scoring forward pass.")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size, in GPUs (within one node).")
    replicas: int | None = Field(
        None,
        ge=1,
        description="Scoring servers of this teacher, each with its own endpoint; the rows of a step are split "
        "across them, balanced by tokens. null = derived: on GPUs the teachers' GPUs ÷ tensor_parallel (one "
        "replica per tensor-parallel group of them; the teachers' GPUs are the actor's, or their own: "
        "cluster.teacher_placement), on CPU 1. On GPUs a replica takes tensor_parallel of the teachers' GPUs "
        "(replicas·tensor_parallel at most their number).",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="Seconds the actor waits for one answer of this teacher's scoring servers (a step's /score "
        "of a replica's rows, the evaluation's greedy answers), connecting included; past it the step fails "
        "with an error naming the teacher, the replica and its URL, and the job ends (a stopped or hung "
        "server). Raise it for a large teacher on slow hardware; at most 86400 (a day).",
    )
    residency: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Where the teacher's weights are between its phases on a GPU: 'auto' stays resident when "
        "the memory plan of every GPU it is on fits with it there (the GPU's memory: "
        "cluster.<group>.gpu_memory_gb, else detected in the job), else offloaded at the drain and onloaded "
        "when scoring starts; 'always' stays resident; 'never' is offloaded at every drain. Its scoring "
        "buffers are released after each score either way (plan/residency_plan.py).",
    )


class TokenizerConfig(Section):
    """The tokenizer every model must share (checked by fingerprint before training, DESIGN.md §3)."""

    path: NonEmptyStr = Field(description="HF tokenizer id or directory; defaults to models.actor.path.")


class ModelsConfig(Section):
    """Actor, teachers and tokenizer."""

    actor: ActorConfig = Field(description="The student being trained.")
    teachers: list[TeacherConfig] = Field(
        min_length=1,
        description="Teachers; ids are referenced by `routes:`. Declared even when "
        "loss.distillation_coefficient is 0 (then none is loaded).",
    )
    tokenizer: TokenizerConfig = Field(description="Shared tokenizer; omitted = the actor's path.")

    @model_validator(mode="before")
    @classmethod
    def _default_tokenizer(cls, data: Any) -> Any:
        """Resolve the tokenizer to the actor's path when absent (the resolved config shows it)."""
        if isinstance(data, dict) and data.get("tokenizer") is None:
            actor = data.get("actor")
            path = actor.get("path") if isinstance(actor, dict) else getattr(actor, "path", None)
            if path is not None:
                data = {**data, "tokenizer": {"path": path}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelsConfig:
        problems = []
        seen: dict[str, str] = {self.actor.id: "actor.id"}
        for i, teacher in enumerate(self.teachers):
            here = join_path("teachers", i, "id")
            if teacher.id in seen:
                problems.append(
                    Problem(
                        here, "duplicate model id", teacher.id, f"already used by models.{seen[teacher.id]}"
                    )
                )
            else:
                seen[teacher.id] = here
        raise_if_any(problems)
        return self

    @property
    def teacher_ids(self) -> tuple[str, ...]:
        return tuple(t.id for t in self.teachers)

    def teacher(self, teacher_id: str) -> TeacherConfig:
        """The teacher with this id; KeyError names the known ids."""
        for t in self.teachers:
            if t.id == teacher_id:
                return t
        raise KeyError(f"unknown teacher {teacher_id!r} (known: {', '.join(self.teacher_ids)})")
