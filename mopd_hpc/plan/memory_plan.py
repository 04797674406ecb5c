"""The memory plan before anything starts (issue 21 item 2): per GPU of the job plan, what each child on it
will hold, estimated from the config and each model's config.json (`engines/memory/estimates.py`'s arithmetic).

Each child's holdings are either resident through the step, or held in one phase only:
- actor (train engine, per rank): weights, optimizer state and (megatron) the fp32 grad buffer, resident;
  torch's gradients and the activations of one micro-batch in `train`: whole rows of max_prompt_tokens +
  max_new_tokens positions within `micro_batch_tokens`; null: with the GPU's memory known (the group's
  `capacity_gib`: `gpu_memory_gb` or `gpu_type`'s, else the `capacity_gib` given: detected in the job, or this
  machine's GPU at --check), the budget the engine derives at each step
  (`memory.estimates.default_micro_batch_tokens` of what the train phase leaves free: the GPU less every
  child's train-phase holdings and `CUDA_CONTEXT_BYTES` per child), else the rank's whole shard
  (batch_size·samples_per_prompt/dp rows); with a KL penalty (rl_coefficient > 0, kl_coefficient > 0) its
  reference model's weights and scoring buffers, as a teacher of the actor's engine, dtype and tensor_parallel
  would hold them, in `teacher` (`engines/reference.py`: onloaded only while it scores);
- teacher (scoring): its scoring buffers in `teacher` (released after each score), its weights in `teacher`
  too when it is offloaded between phases, resident when it stays (`resident_teachers`; which teachers stay
  is `plan/residency_plan.py`'s decision from this plan); buffers: the rows the teacher role scores at a time
  (`TEACHER_ROWS`, fewer when their float32 logits exceed `SCORING_BUDGET_BYTES`), the logits
  the engine keeps for them (torch: response positions in the model dtype, plus a float32 log-softmax for
  top-k; megatron: every position's logits and a float32 log-softmax of the response positions);
- rollout engine (the actor's model): weights, resident; hf: the static KV cache of its largest batch
  (`engines/rollout/graph_shape.py`: graph_rows × graph_length slots, every batch padded to it on CUDA; at
  most `rollout.graph_rows` rows),
  held in every phase with `rollout.compile_decode` (the compiled decoder's CUDA graphs hold its addresses:
  `HFRolloutEngine.release_cache`), in `rollout` only without, and the sampling buffers, in `rollout`;
  with `rollout.compile_decode`, also the CUDA-graph pool of the compiled decode step (one step's logits
  and activations, `GRAPH_POOL_BYTES` per row and vocabulary entry), held in every phase;
  sglang: weights and KV pool are the static `rollout.mem_fraction_static` of the GPU (known only with
  `cluster.<group>.gpu_memory_gb`), resident when separated, in `rollout` only when colocated (released at
  the end of the rollout: trainer/rollout_memory.py);
- with `weight_sync.backend: ipc`, actor rank 0 (the sync's source) also holds the shared buffer of the HF
  weights (`engines/weight_sync/ipc.py`), resident from the first sync on: `ipc_buffer_bytes`.
A GPU's plan is its largest phase: Σ resident + Σ held in that phase (phases rollout, teacher, train). A child
is planned on the GPUs it computes on (`ChildSpec.compute_gpus`: a colocated child sees all of its node's); one
over several GPUs (a rollout engine's tensor parallelism) puts 1/its GPUs on each. A model whose config.json
cannot be read here (a Slurm path that exists on the cluster only) is left out, with a note; `--dry-run` then
names each such file once, with the children it concerns.

`--dry-run` prints the plan (`format_memory_plan`); `--check` and every submit refuse a plan over the GPU's
memory where it is known (`plan/memory_fit.py`). The figures are what torch's caching allocator
reserves per child (`memory/<child>/<phase>/reserved_gib`); the CUDA context of each process is not in them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.engines.memory.estimates import (
    MemoryModelError,
    ModelShape,
    default_micro_batch_tokens,
    dtype_bytes,
    micro_batch_bytes,
    train_state,
)
from mopd_hpc.engines.rollout.graph_shape import graph_length, graph_rows
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.plan import ChildSpec, JobPlan

GIB = float(2**30)
#: Rows a teacher scores at a time at most (`engines/teacher/process.py` TeacherArgs.max_batch_rows' default);
#: the job's teacher role takes fewer when their float32 logits exceed `SCORING_BUDGET_BYTES`
#: (`roles/teacher.py` scoring_rows: the same rule).
TEACHER_ROWS = 64
SCORING_BUDGET_BYTES = 4 << 30
PHASES = ("rollout", "teacher", "train")
#: Bytes per row and vocabulary entry of one decode step's sampling (`engines/rollout/sampling.py`): float32
#: log-probs, their exp and cumsum, and top-p's sorted values with int64 indices.
SAMPLING_BYTES = 24
#: Bytes per graph row and vocabulary entry of the compiled decode step's CUDA-graph pool, which stays between
#: batches: measured on an H200 (0.6b shape, 256 rows), the rollout engine held 0.85 GiB beyond its weights
#: and KV cache at 320 slots and 2.26 GiB at 1,088: 7.3 B per row and vocabulary entry (0.26 GiB) plus
#: transformers' repeat_kv copies of one layer's K/V (~7.7 KB per row and slot), which the grouped attention
#: (`engines/rollout/grouped_attention.py`) no longer makes; rounded up to 8.
GRAPH_POOL_BYTES = 8
#: What one process's CUDA context (and the libraries' workspaces) takes on its GPU outside torch's allocator.
CUDA_CONTEXT_BYTES = 512 * 2**20

ConfigReader = Callable[[str], Mapping[str, Any] | None]


@dataclass(frozen=True, slots=True)
class Holding:
    """`what` a child holds, `bytes` of it, in `phase` only (None: resident through the step)."""

    what: str
    bytes: int
    phase: str | None = None


@dataclass(frozen=True, slots=True)
class ChildMemory:
    """One child's share of one GPU: its label (as the rank map's role and index), holdings and a note."""

    label: str
    holdings: tuple[Holding, ...]
    note: str = ""
    teacher: str | None = None  # the teacher id of a teacher child
    child: str = ""  # the rank map's role and index ("teacher 3"; `label` names a teacher by its id)
    unread: str = ""  # the config.json that is not readable here (then no holdings)

    def holding(self, what: str) -> Holding | None:
        """The holding whose `what` starts with `what` (e.g. "weights"), or None."""
        return next((h for h in self.holdings if h.what.startswith(what)), None)

    def in_phase(self, phase: str) -> int:
        """Bytes held during `phase`: the resident holdings plus that phase's."""
        return sum(h.bytes for h in self.holdings if h.phase in (None, phase))


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU: its group, node and ordinal, the children on it, its memory in GiB (`capacity_gib`: the group's
    `gpu_memory_gb` or `gpu_type`'s, else the one given to `memory_plan`; None when unknown)."""

    group: str
    node: int
    gpu: str
    children: tuple[ChildMemory, ...]
    capacity_gib: float | None

    def peak(self) -> tuple[int, str]:
        """(bytes, phase) of the largest phase (module docstring)."""
        best = max(PHASES, key=lambda ph: sum(c.in_phase(ph) for c in self.children))
        return sum(c.in_phase(best) for c in self.children), best


def read_model_config(path: str) -> Mapping[str, Any] | None:
    """`path/config.json` as a dict, or None when it cannot be read here."""
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _shape(path: str, read: ConfigReader) -> tuple[ModelShape | None, str, str]:
    """(shape, note, the config.json path when it is not readable here, else "")."""
    config = read(path)
    if config is None:
        return None, f"{path}/config.json not readable here: not planned", f"{path}/config.json"
    try:
        return ModelShape.from_hf_config(config), "", ""
    except MemoryModelError as err:
        return None, f"{path}: {err}: not planned", ""


def ipc_buffer_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of the ipc weight sync's shared buffers on actor rank 0's GPU (`engines/weight_sync/ipc.py`
    `plan_layout`: every tensor of the engine's `named_weights()` end to end in its dtype, the actor's; the
    4 GiB buckets split it, they add nothing): the HF weights (`ModelShape.params`), a tied LM head once with
    either engine (the torch engine's state_dict names the embedding twice, and the buffer holds the alias in
    the embedding's slot: `tied_aliases`; megatron's converter leaves `lm_head.weight` out when tied and drops
    the padded vocabulary rows).

    Raises:
        MemoryModelError: an unknown dtype.
    """
    return shape.params * dtype_bytes(dtype)


def _actor(
    cfg: Any, shape: ModelShape, parallel: ActorParallel, rank: int, free: int | None = None
) -> tuple[Holding, ...]:
    """Actor `rank`'s holdings; `free`: bytes the train phase leaves free for activations (null budget only)."""
    actor = cfg.models.actor
    state = train_state(shape, actor.dtype, actor.engine, parallel.tp, parallel.dp, actor.expert_parallel)
    rows = -(-cfg.data.batch_size * cfg.data.samples_per_prompt // parallel.dp)
    length = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    shard = rows * length
    budget = actor.micro_batch_tokens
    if budget is None and free is not None:
        ckpt = actor.activation_checkpointing
        budget = default_micro_batch_tokens(shape, actor.dtype, actor.engine, free, ckpt, parallel.tp)
    positions = min(shard, max(length, (budget or shard) // length * length))  # whole rows a micro-batch
    response = positions * cfg.rollout.sampling.max_new_tokens // length
    act = micro_batch_bytes(
        shape, actor.dtype, actor.engine, positions, response, actor.activation_checkpointing, parallel.tp
    )
    grads_phase = "train" if actor.engine == "torch" else None
    reference: tuple[Holding, ...] = ()
    if cfg.loss.rl_coefficient > 0 and cfg.loss.kl_coefficient > 0:  # scored by the rank itself
        reference = tuple(
            Holding(f"reference model {h.what}", h.bytes, "teacher")
            for h in _teacher(cfg, actor, shape, resident=False)  # offloaded between its uses
        )
    ipc: tuple[Holding, ...] = ()
    if cfg.weight_sync.backend == "ipc" and rank == 0:  # the sync's source: its buffer persists
        ipc = (Holding("ipc weight-sync buffer", ipc_buffer_bytes(shape, actor.dtype)),)
    return (
        Holding("weights", state.weights),
        Holding("gradients", state.gradients, grads_phase),
        Holding("optimizer", state.optimizer),
        *ipc,
        Holding(f"activations ({positions:,} positions a micro-batch)", act, "train"),
        *reference,
    )


def _teacher(cfg: Any, teacher: Any, shape: ModelShape, resident: bool) -> tuple[Holding, ...]:
    b = dtype_bytes(teacher.dtype)
    tp = teacher.tensor_parallel
    prompt, new = cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens
    step_rows = max(TEACHER_ROWS, cfg.data.batch_size * cfg.data.samples_per_prompt)
    rows = max(1, min(step_rows, SCORING_BUDGET_BYTES // ((prompt + new) * shape.vocab * 4)))
    topk = cfg.loss.estimator == "topk"
    if teacher.engine == "megatron":
        buffers = rows * shape.vocab * ((prompt + new) * b + new * 4) // tp
    else:
        buffers = rows * new * shape.vocab * (b + (4 if topk else 0))
    return (
        Holding("weights", shape.params * b // tp, None if resident else "teacher"),
        Holding(f"scoring buffers ({rows} rows)", buffers, "teacher"),
    )


def _rollout(cfg: Any, shape: ModelShape, capacity_gib: float | None, share: int) -> tuple[Holding, ...]:
    b = dtype_bytes(cfg.models.actor.dtype)
    weights = Holding("weights", shape.params * b // share)
    if cfg.rollout.backend == "sglang":
        # colocated: released when the step leaves ROLLOUT (trainer/rollout_memory.py); resumed for the
        # weight sync (its weights only: less than the rollout phase's) and the next rollout
        phase = "rollout" if cfg.rollout.mode == "colocated" else None
        weights = Holding("weights", weights.bytes, phase)
        if capacity_gib is None:
            return (weights,)
        fraction = cfg.rollout.sglang_mem_fraction
        pool = int(fraction * capacity_gib * GIB) - weights.bytes
        label = f"KV pool (mem_fraction_static {fraction})"
        return weights, Holding(label, max(0, pool), phase)
    rows = graph_rows(
        cfg.data.batch_size, cfg.data.samples_per_prompt, cfg.rollout.engines.count, cfg.rollout.graph_rows
    )
    length = graph_length(cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens)
    kv = rows * length * shape.layers * 2 * shape.kv_heads * shape.head_dim * b // share
    held = None if cfg.rollout.compile_decode else "rollout"  # eager: released after each batch
    holdings = [
        weights,
        Holding(f"KV cache ({rows} rows × {length} slots)", kv, held),
        Holding("sampling buffers", rows * shape.vocab * SAMPLING_BYTES // share, "rollout"),
    ]
    if cfg.rollout.compile_decode:
        holdings.append(Holding("CUDA-graph pool", rows * shape.vocab * GRAPH_POOL_BYTES // share))
    return tuple(holdings)


def _child(
    cfg: Any,
    child: ChildSpec,
    parallel: ActorParallel,
    capacity: float | None,
    read: ConfigReader,
    resident_teachers: frozenset[str],
) -> ChildMemory:
    label = f"{child.role} {child.index}"
    if child.role == "actor":
        shape, note, unread = _shape(cfg.models.actor.path, read)
        if shape and cfg.models.actor.micro_batch_tokens is None and capacity is None:
            note = "micro_batch_tokens null: the whole shard; on a GPU the run caps it by the free memory"
        holdings = _actor(cfg, shape, parallel, child.index) if shape else ()
        return ChildMemory(label, holdings, note, child=label, unread=unread)
    if child.role == "teacher":
        teacher = cfg.models.teacher(dict(child.env)[child_env.TEACHER_ID])
        shape, note, unread = _shape(teacher.path, read)
        resident = teacher.id in resident_teachers
        holdings = _teacher(cfg, teacher, shape, resident) if shape else ()
        return ChildMemory(f"teacher {teacher.id}", holdings, note, teacher.id, label, unread)
    if child.role == "rollout":
        shape, note, unread = _shape(cfg.models.actor.path, read)
        share = len(child.compute_gpus(cfg.rollout.engines.tensor_parallel))
        holdings = _rollout(cfg, shape, capacity, share) if shape else ()
        return ChildMemory(label, holdings, note, child=label, unread=unread)
    return ChildMemory(label, (), f"role {child.role!r}: not planned", child=label)


def memory_plan(
    cfg: Any,
    plan: JobPlan,
    read: ConfigReader = read_model_config,
    *,
    capacity_gib: float | None = None,
    resident_teachers: frozenset[str] = frozenset(),
) -> tuple[GpuMemory, ...]:
    """Every GPU of `plan` (a `plan.placement.place_children(cfg)`) with its children's holdings
    (module docstring); () for a job without GPUs.

    Args:
        read: a model directory's config.json (None when absent).
        capacity_gib: one GPU's memory where a group has no `gpu_memory_gb` or `gpu_type` (what the job
            detected, or this machine's GPU at --check), GiB.
        resident_teachers: ids of the teachers whose weights stay on the GPU between phases.
    """
    groups = list(cfg.cluster.groups().items())
    parallel = ActorParallel.from_config(cfg)
    per_gpu: dict[tuple[int, int, str], list[tuple[ChildSpec, ChildMemory]]] = {}
    for child in plan.children:
        if not child.gpus:
            continue
        capacity = groups[child.het_group][1].capacity_gib or capacity_gib
        memory = _child(cfg, child, parallel, capacity, read, resident_teachers)
        for gpu in child.compute_gpus(cfg.rollout.engines.tensor_parallel):
            per_gpu.setdefault((child.het_group, child.node_index, gpu), []).append((child, memory))
    out = []
    for (g, node, gpu), pairs in sorted(per_gpu.items(), key=lambda kv: (kv[0][0], kv[0][1], int(kv[0][2]))):
        capacity = groups[g][1].capacity_gib or capacity_gib
        children = [memory for _, memory in pairs]
        if capacity is not None and cfg.models.actor.micro_batch_tokens is None:
            children = [_derived_budget(cfg, spec, memory, children, parallel, capacity, read)
                        for spec, memory in pairs]  # fmt: skip
        out.append(GpuMemory(groups[g][0], node, gpu, tuple(children), capacity))
    return tuple(out)


def _derived_budget(
    cfg: Any,
    spec: ChildSpec,
    memory: ChildMemory,
    children: list[ChildMemory],
    parallel: ActorParallel,
    capacity: float,
    read: ConfigReader,
) -> ChildMemory:
    """An actor child's holdings with the micro-batch budget the engine derives when micro_batch_tokens is
    null: from what the train phase leaves free on this GPU (module docstring)."""
    if spec.role != "actor" or not memory.holdings:
        return memory
    others = sum(c.in_phase("train") for c in children if c is not memory)
    own = sum(h.bytes for h in memory.holdings if not h.what.startswith("activations"))
    free = int(capacity * GIB) - others - own - CUDA_CONTEXT_BYTES * len(children)
    shape, _, _ = _shape(cfg.models.actor.path, read)
    assert shape is not None  # holdings exist, so the shape was read
    holdings = _actor(cfg, shape, parallel, spec.index, max(0, free))
    return ChildMemory(memory.label, holdings, memory.note, memory.teacher, memory.child, memory.unread)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_memory_plan(gpus: tuple[GpuMemory, ...]) -> list[str]:
    """The plan as `# ` lines for --dry-run: per GPU its largest phase (and the group's memory), then per
    child each holding in GiB (a phase-only holding marks its phase). A child that is not planned is not
    listed per GPU: each reason is printed once with the children it concerns (`_unplanned_lines`), a GPU
    where nothing is planned is left out, and a plan where nothing is planned is that one line."""
    if not gpus:
        return ["# memory plan: no GPU in this job"]
    planned = [gpu for gpu in gpus if any(c.holdings for c in gpu.children)]
    out = ["# memory plan per GPU (estimates, GiB; engines/memory/estimates.py):"] if planned else []
    for gpu in planned:
        peak, phase = gpu.peak()
        cap = f" of {gpu.capacity_gib:g}" if gpu.capacity_gib is not None else ""
        left_out = sum(1 for c in gpu.children if not c.holdings)
        without = (
            f"; without {left_out} {'child' if left_out == 1 else 'children'} not planned" if left_out else ""
        )
        out.append(
            f"#   cluster.{gpu.group} node {gpu.node} GPU {gpu.gpu}: {_gib(peak)}{cap} at most (in {phase}{without})"
        )
        for child in gpu.children:
            if not child.holdings:
                continue
            items = "; ".join(
                f"{h.what} {_gib(h.bytes)}" + (f" ({h.phase})" if h.phase else "") for h in child.holdings
            )
            out.append(f"#     {child.label}: {items}" + (f" [{child.note}]" if child.note else ""))
    return out + _unplanned_lines(gpus, whole=not planned)


def _children(keys: list[tuple[str, str]]) -> str:
    """'actor ×8, rollout ×8' of (child key, label) pairs: per role its count, or the label of a role's only
    child ('teacher gsm8k')."""
    by_role: dict[str, list[str]] = {}
    for key, label in dict.fromkeys(keys):
        by_role.setdefault(key.split(" ")[0], []).append(label)
    return ", ".join(
        labels[0] if len(labels) == 1 else f"{role} ×{len(labels)}" for role, labels in by_role.items()
    )


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _unplanned_lines(gpus: tuple[GpuMemory, ...], whole: bool) -> list[str]:
    """The children not planned, once each over all GPUs: the config.json files not readable here in one
    line (each file with the children that read it), then one line per other reason; `whole`: nothing on any
    GPU is planned."""
    unread: dict[str, list[tuple[str, str]]] = {}
    other: dict[str, list[tuple[str, str]]] = {}
    for gpu in gpus:
        for c in gpu.children:
            if not c.holdings:
                (unread.setdefault(c.unread, []) if c.unread else other.setdefault(c.note, [])).append(
                    (c.child or c.label, c.label)
                )
    head = "# memory plan: not planned — " if whole else "# memory plan: left out — "
    out = []
    if unread:
        files = _and([f"{path} ({_children(keys)})" for path, keys in unread.items()])
        verb, they = ("is", "it is") if len(unread) == 1 else ("are", "they are")
        out.append(
            f"{head}{files} {verb} not readable here; it is made where {they}: in the job, or with --local"
        )
    for note, keys in other.items():
        out.append(f"{head}{_children(keys)}: {note}")
    return out
