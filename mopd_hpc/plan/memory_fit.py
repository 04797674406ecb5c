"""Whether the memory plan fits the GPUs, and where it does not, the way out solved from the plan (issue 31 item 3).

A GPU's memory is known from its group's `cluster.<group>.gpu_memory_gb`, else its `gpu_type`
(`config/cluster.py` GPU_TYPE_GIB), else the `capacity_gib` the caller gives (`mopd-submit --check` with the
local backend: this machine's GPUs, `launch/local_gpus.py`); where none is known nothing is checked (the caller
says so in one line). A GPU's need is the residency plan's measure (`residency_plan.gpu_bytes`): after the
residency decision, its largest phase with the teachers that stay resident, plus one CUDA context per child.

A plan over a known memory is refused (`memory_refusals`): the GPU, its phase and need, the child and its
largest holding in that phase, then every way out that makes the whole job fit on its own, each solved on the
plan (the other fields as configured), the one that shrinks the largest holding first:
- `rollout.graph_rows ≤ N` (hf backend): the largest N (rows one engine decodes together; its static KV cache,
  sampling buffers and CUDA-graph pool scale with it) with which it fits;
- `models.actor.micro_batch_tokens ≤ M`: the largest budget of whole rows (max_prompt_tokens +
  max_new_tokens positions each, as the engine cuts micro-batches) with which it fits;
- `models.actor.activation_checkpointing: true`, when not set and enough;
- teachers on GPUs of their own: the GPUs fit without the teachers' holdings (the field that places them
  there is named when this config has it).
The solvers bisect: each holding grows with N and M, so fitting is monotone in them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mopd_hpc.engines.rollout.graph_shape import graph_rows
from mopd_hpc.plan.memory_plan import GIB, ConfigReader, GpuMemory, read_model_config
from mopd_hpc.plan.residency_plan import gpu_bytes, planned_residency
from mopd_hpc.runtime.plan import JobPlan

#: Holdings of a rollout engine that scale with its graph rows; of an actor, with its micro-batch.
ROLLOUT_ROWS = ("KV cache", "sampling buffers", "CUDA-graph pool")
ACTIVATIONS = ("activations",)


@dataclass(frozen=True, slots=True)
class Overflow:
    """One GPU over its memory: `need` bytes in `phase` (residency_plan.gpu_bytes) against `capacity_gib`;
    `largest`: (bytes, child label, holding) of the largest holding in that phase."""

    gpu: GpuMemory
    need: int
    phase: str
    largest: tuple[int, str, str]

    def where(self) -> str:
        return f"node {self.gpu.node} GPU {self.gpu.gpu}"


def _kept(gpu: GpuMemory, offload: frozenset[str]) -> frozenset[str]:
    return frozenset(c.teacher for c in gpu.children if c.teacher and c.teacher not in offload)


def _largest(gpu: GpuMemory, phase: str, kept: frozenset[str]) -> tuple[int, str, str]:
    """(bytes, child, what) of the largest holding held in `phase` (a resident teacher's weights included)."""
    held = [
        (h.bytes, c.label, h.what)
        for c in gpu.children
        for h in c.holdings
        if h.phase in (None, phase) or (c.teacher in kept and h.what == "weights")
    ]
    return max(held) if held else (0, "-", "-")


def overflows(
    cfg: Any, plan: JobPlan, read: ConfigReader = read_model_config, capacity_gib: float | None = None
) -> tuple[Overflow, ...]:
    """The GPUs of `cfg`'s job `plan` whose need exceeds their known memory, the largest need first; () when
    all fit or none is known. A GPU with a child not planned is held to what is planned of it (a lower bound). `capacity_gib`: one GPU's memory where a group gives none (GiB)."""
    decision, gpus = planned_residency(cfg, plan, read, capacity_gib=capacity_gib)
    out = []
    for gpu in gpus:
        if gpu.capacity_gib is None or not any(c.holdings for c in gpu.children):
            continue  # memory unknown, or nothing planned (no config.json readable here): nothing to hold
        kept = _kept(gpu, decision.offload)
        need, phase = gpu_bytes(gpu, kept)
        if need > gpu.capacity_gib * GIB:
            out.append(Overflow(gpu, need, phase, _largest(gpu, phase, kept)))
    return tuple(sorted(out, key=lambda o: -o.need))


def capacity_known(cfg: Any, capacity_gib: float | None = None) -> bool:
    """Whether every group with GPUs has a known GPU memory (its fields, else `capacity_gib`)."""
    groups = [g for g in cfg.cluster.groups().values() if g.gpus_per_node]
    return all(g.capacity_gib is not None or capacity_gib is not None for g in groups)


def _bisect(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in [lo, hi] with fits(n), fits monotone decreasing in n; None when not even lo fits."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _with_rollout(cfg: Any, **update: Any) -> Any:
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=update)})


def _with_actor(cfg: Any, **update: Any) -> Any:
    actor = cfg.models.actor.model_copy(update=update)
    return cfg.model_copy(update={"models": cfg.models.model_copy(update={"actor": actor})})


def _addressed(overflow: Overflow, names: tuple[str, ...], role: str) -> int:
    """Bytes of the largest holding named `names` of a `role` child on the overflowing GPU."""
    sizes = [
        h.bytes
        for c in overflow.gpu.children
        if c.label.startswith(role)
        for h in c.holdings
        if h.what.startswith(names)
    ]
    return max(sizes, default=0)


def _teachers_apart(overs: tuple[Overflow, ...]) -> bool:
    """Whether every overflowing GPU fits without its teacher children."""
    for o in overs:
        rest = tuple(c for c in o.gpu.children if c.teacher is None)
        gpu = GpuMemory(o.gpu.group, o.gpu.node, o.gpu.gpu, rest, o.gpu.capacity_gib)
        if gpu_bytes(gpu, frozenset())[0] > o.gpu.capacity_gib * GIB:
            return False
    return True


def ways_out(
    cfg: Any, plan: JobPlan, read: ConfigReader, capacity_gib: float | None, overs: tuple[Overflow, ...]
) -> list[str]:
    """Each change that alone makes every GPU of the job fit (module docstring), the one that shrinks the
    largest holding on the fullest GPU first."""
    cache: dict[str, Mapping[str, Any] | None] = {}

    def cached(path: str) -> Mapping[str, Any] | None:
        if path not in cache:
            cache[path] = read(path)
        return cache[path]

    def fits(changed: Any) -> bool:
        return not overflows(changed, plan, cached, capacity_gib)

    worst = overs[0]
    found: list[tuple[int, str]] = []
    roles = {c.label.split(" ")[0] for o in overs for c in o.gpu.children if c.holdings}
    if cfg.rollout.backend == "hf" and "rollout" in roles:
        rows = graph_rows(
            cfg.data.batch_size,
            cfg.data.samples_per_prompt,
            cfg.rollout.engines.count,
            cfg.rollout.graph_rows,
        )
        n = _bisect(1, rows - 1, lambda n: fits(_with_rollout(cfg, graph_rows=n)))
        if n is not None:
            found.append(
                (_addressed(worst, ROLLOUT_ROWS, "rollout"), f"rollout.graph_rows ≤ {n} (now {rows})")
            )
    if "actor" in roles:
        actor = cfg.models.actor
        length = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
        shard = cfg.data.batch_size * cfg.data.samples_per_prompt
        k = _bisect(1, shard, lambda k: fits(_with_actor(cfg, micro_batch_tokens=k * length)))
        now = "null" if actor.micro_batch_tokens is None else f"{actor.micro_batch_tokens:,}"
        limit = shard if actor.micro_batch_tokens is None else actor.micro_batch_tokens // length
        if k is not None and k < limit:  # a budget below what the plan holds now
            found.append(
                (
                    _addressed(worst, ACTIVATIONS, "actor"),
                    f"models.actor.micro_batch_tokens ≤ {k * length:,} ({k} rows of {length}; now {now})",
                )
            )
        if not actor.activation_checkpointing and fits(_with_actor(cfg, activation_checkpointing=True)):
            found.append(
                (_addressed(worst, ACTIVATIONS, "actor"), "models.actor.activation_checkpointing: true")
            )
    if "teacher" in roles and _teachers_apart(overs):
        field = "teacher_placement" in type(cfg.cluster).model_fields
        how = (
            "cluster.teacher_placement: own_gpus (teachers on GPUs of their own)"
            if field
            else ("teachers on GPUs of their own")
        )
        found.append((_addressed(worst, ("weights", "scoring buffers"), "teacher"), how))
    return [text for _, text in sorted(found, key=lambda f: -f[0])]


def _capacity_source(gpu: GpuMemory, cfg: Any, given: str) -> str:
    group = cfg.cluster.groups()[gpu.group]
    if group.capacity_field == "gpu_type":
        return f"cluster.{gpu.group}.gpu_type ({group.gpu_type}: {gpu.capacity_gib:g} GiB)"
    if group.capacity_field:
        return f"cluster.{gpu.group}.gpu_memory_gb ({gpu.capacity_gib:g} GiB)"
    return f"{given} ({gpu.capacity_gib:g} GiB)"


def memory_refusals(
    cfg: Any,
    plan: JobPlan,
    read: ConfigReader = read_model_config,
    capacity_gib: float | None = None,
    capacity_source: str = "this machine's GPU",
) -> list[str]:
    """[] when every GPU whose memory is known fits; else one refusal (module docstring): the fullest GPU, its
    phase and need, the child and holding that is largest, the other GPUs over, and the ways out.

    Args:
        capacity_gib, capacity_source: one GPU's memory where a group gives none (GiB), and what gave it.
    """
    overs = overflows(cfg, plan, read, capacity_gib)
    if not overs:
        return []
    worst = overs[0]
    size, child, what = worst.largest
    others = f"; {len(overs) - 1} other GPU(s) over too" if len(overs) > 1 else ""
    head = (
        f"{_capacity_source(worst.gpu, cfg, capacity_source)}: the memory plan of cluster.{worst.gpu.group} "
        f"{worst.where()} needs {worst.need / GIB:.1f} GiB in the {worst.phase} phase, more than the GPU has "
        f"(largest holding: {child}'s {what}, {size / GIB:.1f} GiB){others}"
    )
    found = ways_out(cfg, plan, read, capacity_gib, overs)
    if found:
        return [f"{head}; it fits with " + ", or ".join(found)]
    return [
        f"{head}; no one change of rollout.graph_rows, models.actor.micro_batch_tokens, activation checkpointing "
        "or the teachers' GPUs fits it: more GPUs (tensor_parallel, rollout.engines.count), a smaller step "
        "(data.batch_size, max_prompt_tokens, max_new_tokens), or two of those changes"
    ]
