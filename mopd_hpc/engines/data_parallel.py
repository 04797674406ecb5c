"""Data parallelism of a train engine: which rank of which group this engine is, and the reductions a step
needs over that group (DESIGN.md §7).

A step's rows are split into one shard per data-parallel rank. Every rank runs the same step (SPMD) on its
shard; the loss is normalized by the count of the WHOLE step (`mopd.normalize.loss_denominator` of each
shard, summed here), so the ranks' losses and gradients sum to those of the step at DP = 1. The record is
engine-agnostic: the torch engine wraps its model in torch DDP over `group`; the megatron engine passes
megatron-core's data-parallel group (`megatron.parallel.megatron_data_parallel`: `parallel_state.
get_data_parallel_group()`, rank and size from `get_data_parallel_rank/world_size()`: the tensor-parallel ranks
of one replica hold the same rows, so counts are reduced over the DP group only) with its own DDP and
distributed optimizer. Megatron-core's DDP averages gradients over DP (scales them by 1/DP), so that engine
scales its loss by the DP size as the torch engine does (tests/engines/test_megatron_dp_cpu.py).

Statistics of a step are reduced by one rule (`all_reduce_stats`): SUMS (the loss and each term's loss, which
are already shares of the global loss, and token counts) are summed over ranks; MEANS (masked means over a
rank's loss tokens) are averaged weighted by each rank's loss-token count, Σ_r n_r·x_r / Σ_r n_r — exact for a
mean over the loss mask, approximate for a mean over a sub-mask (e.g. tokens with W > 0), which would need
its own count.

Collectives run on tensors of the caller's `device` (CPU for gloo, the rank's CUDA device for NCCL); at
size 1 every helper is a no-op that touches no torch.distributed state.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


class DataParallelError(ValueError):
    """A data-parallel record disagrees with itself or with torch.distributed, or ranks disagree on a step."""


@dataclass(frozen=True, slots=True)
class DataParallel:
    """This process's place in the data-parallel group.

    Attributes:
        rank: 0 ≤ rank < size, this process's rank IN `group` (not the global rank when group is a subgroup).
        size: ≥ 1 ranks in the group.
        group: a `torch.distributed.ProcessGroup`, or None for the default (WORLD) group. Never read at
            size 1.

    Raises:
        DataParallelError: rank or size not an int, size < 1, or rank outside [0, size).
    """

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        for name in ("rank", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise DataParallelError(f"DataParallel.{name} is {value!r}; expected an int")
        if self.size < 1:
            raise DataParallelError(f"DataParallel.size is {self.size}; expected >= 1")
        if not 0 <= self.rank < self.size:
            raise DataParallelError(
                f"DataParallel.rank is {self.rank} with size {self.size}; expected 0 <= rank < {self.size}"
            )

    @classmethod
    def single(cls) -> DataParallel:
        """One rank, no group: DP = 1 (no collective is ever issued)."""
        return cls(0, 1, None)

    @classmethod
    def from_group(cls, group: Any = None) -> DataParallel:
        """This process's rank and size in `group` (None: WORLD) of an initialized torch.distributed.

        Raises:
            DataParallelError: torch.distributed is not initialized.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise DataParallelError(
                "torch.distributed is not initialized; init_process_group before DataParallel.from_group"
            )
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def distributed(self) -> bool:
        """True when size > 1 (collectives run)."""
        return self.size > 1

    def check_initialized(self) -> None:
        """At size > 1, raise `DataParallelError` unless torch.distributed is initialized and `group` has
        this record's size and rank (a record built from another group or world, or before init)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            raise DataParallelError(
                f"DataParallel(rank={self.rank}, size={self.size}) but torch.distributed is not initialized; "
                "init_process_group on every rank first (or use DataParallel.single())"
            )
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (rank, size) != (self.rank, self.size):
            raise DataParallelError(
                f"DataParallel(rank={self.rank}, size={self.size}) but its process group has rank {rank} of "
                f"{size}; build the record with DataParallel.from_group(group)"
            )

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (any shape, any dtype the backend reduces) over the group, IN PLACE; returns it.
        A no-op at size 1. Every rank must call it with the same shape and dtype."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def check_same_keys(self, keys: list[str], device: torch.device) -> None:
        """Raise `DataParallelError` on every rank unless all ranks pass the same set of names (a CRC-32 of
        the sorted names, max and min over the group; one 2-element all-reduce). No-op at size 1."""
        if not self.distributed:
            return
        import torch.distributed as dist

        crc = zlib.crc32("\n".join(sorted(keys)).encode())
        probe = torch.tensor([crc, -crc], dtype=torch.int64, device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=self.group)
        if int(probe[0]) != -int(probe[1]):
            raise DataParallelError(
                f"rank {self.rank} of {self.size}: the ranks' step statistics differ in their names (this "
                f"rank has {sorted(keys)}); every rank must run the same loss terms and observe function"
            )

    def all_reduce_stats(
        self,
        means: Mapping[str, float],
        sums: Mapping[str, float],
        weight: float,
        device: torch.device | None = None,
    ) -> dict[str, float]:
        """Reduce a step's statistics over the group (module docstring's rule), in float64.

        Args:
            means: name → this rank's masked mean over its `weight` loss tokens.
            sums: name → this rank's additive share (its loss share, its token count).
            weight: this rank's loss-token count n_r (0 for an empty shard).
            device: where the collective's tensors live (CPU for gloo, the rank's GPU for NCCL).

        Returns:
            name → float: Σ_r n_r·x_r / Σ_r n_r for `means` (the plain mean over ranks when Σ_r n_r = 0),
            Σ_r x_r for `sums`. At size 1 the inputs, unchanged.

        Raises:
            DataParallelError: a name in both mappings, or the ranks' names differ (checked first, so a
                mismatch raises on every rank instead of hanging).
        """
        both = set(means) & set(sums)
        if both:
            raise DataParallelError(
                f"statistics {sorted(both)} are both means and sums; expected one of them"
            )
        if not self.distributed:
            return {**means, **sums}
        mean_keys, sum_keys = sorted(means), sorted(sums)
        self.check_same_keys([f"mean:{k}" for k in mean_keys] + [f"sum:{k}" for k in sum_keys], device)
        w = float(weight)
        packed = torch.tensor(
            [w * float(means[k]) for k in mean_keys]
            + [float(means[k]) for k in mean_keys]
            + [float(sums[k]) for k in sum_keys]
            + [w],
            dtype=torch.float64,
            device=device,
        )
        total = self.all_reduce_sum(packed).tolist()
        n = len(mean_keys)
        weight_sum = total[-1]
        out: dict[str, float] = {}
        for i, key in enumerate(mean_keys):
            out[key] = total[i] / weight_sum if weight_sum > 0 else total[n + i] / self.size
        for i, key in enumerate(sum_keys):
            out[key] = total[2 * n + i]
        return out
