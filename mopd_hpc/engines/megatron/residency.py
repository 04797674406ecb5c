"""Offload/onload of a megatron-core model between GPU and host, its own component (issue 8).

Two shapes:
- a trained actor: Megatron `DistributedDataParallel` (params and grads live in flat `_ParamAndGradBuffer`s,
  parameters are views into them) plus a `MegatronOptimizer`. Offload order is **optimizer state first, then
  the DDP buffers**: the reverse fails with "CUDA error: invalid argument" (measured on an H200 with
  megatron-core 0.19.2, algo_awex.md §4.3). Onload is the mirror: buffers back, then optimizer state.
  Parts move separately (`offload(("optimizer",))`, `onload(("weights",))`: AWEX's colocate protocol
  releases the optimizer, keeps the weights for its copy, then releases them), keeping that order: offloading
  the weights offloads the optimizer first, onloading the optimizer onloads the weights first.
  The DDP buffers use `_ParamAndGradBuffer.offload_to_cpu/reload_from_cpu` (params into a pinned host copy
  kept across offloads; grads dropped and re-zeroed: offload happens between steps, when no gradient is
  pending). The optimizer state (fp32 main params, Adam moments) is mirrored into pinned host tensors
  allocated on the first offload and reused: each tensor's GPU storage is resized to 0 and back, so the
  optimizer keeps the same tensor objects. (megatron's `MegatronOptimizer.offload_to_cpu` copies every
  tensor with `.cpu()` into fresh pageable memory: with it one AWEX colocate sync of a 1.7B actor took
  12.4 s on the H200, most of it moving ~20 GB of optimizer state at a few GB/s, three times, because the
  parts did not move separately.) A state tensor that shares storage with a DDP buffer (an fp32 model's
  optimizer holds the model's own parameters) moves with the buffer, not twice.
- a teacher (forward only, no DDP wrapper, no optimizer): the generic `engines.memory.residency.Residency`.

The AWEX publisher composes a residency (it releases the trainer's weights around a colocated write);
teachers depend on residency alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mopd_hpc.engines.memory.residency import Residency
from mopd_hpc.engines.protocol import ResidencyReport

log = logging.getLogger("mopd_hpc.engines.megatron.residency")


PARTS: tuple[str, ...] = ("optimizer", "weights")


def _buffers(ddp: Any) -> list[Any]:
    return list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))


def _torch_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a MegatronOptimizer (a ChainedOptimizer holds several)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained:
        return [inner for child in chained for inner in _torch_optimizers(child)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every CUDA tensor of the optimizer's state: the params its groups step (fp32 main params under mixed
    precision) and each param's state tensors (Adam's exp_avg, exp_avg_sq), each once."""
    seen: set[int] = set()
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                for t in (p, *opt.state.get(p, {}).values()):
                    if isinstance(t, torch.Tensor) and id(t) not in seen:
                        seen.add(id(t))
                        yield t


def _check_parts(parts: Iterable[str]) -> set[str]:
    chosen = set(parts)
    if not chosen or chosen - set(PARTS):
        raise ValueError(f"parts={sorted(chosen)}: expected a non-empty subset of {PARTS}")
    return chosen


class DDPResidency:
    """Residency of a Megatron DDP model and its optimizer (module docstring: optimizer first on offload).

    Args:
        ddp: a megatron `DistributedDataParallel` (the `buffers` it holds move).
        optimizer: its `MegatronOptimizer` (ChainedOptimizer forwards to its children), or None.
        device: the compute device.
    """

    def __init__(self, ddp: Any, optimizer: Any, device: torch.device) -> None:
        self.ddp, self.optimizer, self.device = ddp, optimizer, device
        self.resident = {part: True for part in PARTS}
        self._mirrors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (tensor, pinned host copy)

    @property
    def on_device(self) -> bool:
        """True when every part (optimizer state and weights) is on the device."""
        return all(self.resident.values())

    def _buffer_storages(self) -> set[int]:
        return {
            t.untyped_storage().data_ptr()
            for buf in _buffers(self.ddp)
            for t in (buf.param_data, buf.grad_data)
            if t is not None and t.untyped_storage().size()
        }

    def _buffer_bytes(self) -> int:
        total = 0
        for buf in _buffers(self.ddp):
            for t in (buf.param_data, buf.grad_data):
                if t is not None:
                    total += t.untyped_storage().size()
        return total

    def _offload_optimizer(self) -> int:
        """Optimizer state into pinned host mirrors (allocated once), GPU storage resized to 0; bytes moved."""
        in_buffers, moved, current = self._buffer_storages(), 0, {}
        for t in optimizer_tensors(self.optimizer):
            storage = t.untyped_storage()
            if not t.is_cuda or storage.size() == 0 or storage.data_ptr() in in_buffers:
                continue
            if storage.size() != t.numel() * t.element_size() or not t.is_contiguous():
                raise RuntimeError(
                    f"optimizer state tensor {tuple(t.shape)} does not own its storage; cannot offload it in place"
                )
            entry = self._mirrors.get(id(t))
            if entry is None or entry[0] is not t:  # a tensor seen for the first time (or a new state)
                entry = (t, torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
            current[id(t)] = entry
            entry[1].copy_(t, non_blocking=True)
            moved += storage.size()
        self._mirrors = current  # tensors the optimizer dropped are not kept alive
        torch.cuda.synchronize(self.device)  # the host copies are complete before the storage goes
        for t, _ in current.values():
            t.untyped_storage().resize_(0)
        return moved

    def _onload_optimizer(self) -> int:
        moved = 0
        for t, host in self._mirrors.values():
            if t.untyped_storage().size() == 0:
                t.untyped_storage().resize_(host.numel() * host.element_size())
                t.copy_(host, non_blocking=True)
                moved += host.numel() * host.element_size()
        return moved

    def offload(self, parts: Iterable[str] = PARTS) -> ResidencyReport:
        """Move `parts` to the host (idempotent); "weights" takes the optimizer state first.

        Raises:
            ValueError: a part other than "optimizer" and "weights".
        """
        chosen = _check_parts(parts)
        if "weights" in chosen:
            chosen.add("optimizer")  # first: after the buffers it fails (CUDA invalid argument)
        todo = [part for part in PARTS if part in chosen and self.resident[part]]
        if not todo:
            return self._report("offload", 0, f"{'+'.join(sorted(chosen))} already offloaded (no-op)")
        before = torch.cuda.memory_allocated(self.device)
        moved = 0
        if "optimizer" in todo:
            moved += self._offload_optimizer() if self.optimizer is not None else 0
            self.resident["optimizer"] = False
        if "weights" in todo:
            moved += self._buffer_bytes()
            for buf in _buffers(self.ddp):
                buf.offload_to_cpu(move_params=True, move_grads=True)
            self.resident["weights"] = False
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        freed = before - torch.cuda.memory_allocated(self.device)
        return self._report(
            "offload", max(moved, freed), f"{'+'.join(todo)}: freed {freed} bytes on {self.device}"
        )

    def onload(self, parts: Iterable[str] = PARTS) -> ResidencyReport:
        """Move `parts` back to the device (idempotent); "optimizer" brings the weights back first (grads
        re-zeroed).

        Raises:
            ValueError: a part other than "optimizer" and "weights".
        """
        chosen = _check_parts(parts)
        if "optimizer" in chosen:
            chosen.add("weights")
        todo = [part for part in reversed(PARTS) if part in chosen and not self.resident[part]]
        if not todo:
            return self._report(
                "onload", 0, f"{'+'.join(sorted(chosen))} already resident on {self.device} (no-op)"
            )
        before = torch.cuda.memory_allocated(self.device)
        if "weights" in todo:
            for buf in _buffers(self.ddp):
                buf.reload_from_cpu(move_params=True, move_grads=True)
            self.resident["weights"] = True
        if "optimizer" in todo:
            self._onload_optimizer()
            self.resident["optimizer"] = True
        torch.cuda.synchronize(self.device)
        moved = torch.cuda.memory_allocated(self.device) - before
        return self._report(
            "onload", moved, f"{'+'.join(todo)}: moved {moved} bytes from cpu to {self.device}"
        )

    def _report(self, action: str, moved: int, message: str) -> ResidencyReport:
        log.info("%s: %s", action, message)
        return ResidencyReport(action, moved > 0, moved, str(self.device), message)


def scoring_residency(model: torch.nn.Module, device: torch.device) -> Residency:
    """A forward-only (teacher) model's residency: parameters only, no optimizer, no DDP buffers."""
    return Residency(model, device)
