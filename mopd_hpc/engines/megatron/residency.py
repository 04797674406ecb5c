"""Offload/onload of a megatron-core model between GPU and host, its own component (issue 8).

Two shapes:
- a trained actor: Megatron `DistributedDataParallel` (params and grads live in flat `_ParamAndGradBuffer`s,
  parameters are views into them) plus a `MegatronOptimizer`. Offload order is **optimizer state first, then
  the DDP buffers**: the reverse fails with "CUDA error: invalid argument" (measured on an H200 with
  megatron-core 0.19.2, algo_awex.md §4.3). Onload is the mirror: buffers back, then optimizer state.
  Uses the native `MegatronOptimizer.offload_to_cpu/restore_from_cpu` and
  `_ParamAndGradBuffer.offload_to_cpu/reload_from_cpu` (grads are dropped and re-zeroed: offload happens
  between steps, when no gradient is pending).
- a teacher (forward only, no DDP wrapper, no optimizer): the generic `engines.residency.Residency`.

The AWEX publisher composes a residency (it releases the trainer's weights around a colocated write);
teachers depend on residency alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mopd_hpc.engines.protocol import ResidencyReport
from mopd_hpc.engines.residency import Residency

log = logging.getLogger("mopd_hpc.engines.megatron.residency")


def _buffers(ddp: Any) -> list[Any]:
    return list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))


class DDPResidency:
    """Residency of a Megatron DDP model and its optimizer (module docstring: optimizer first on offload).

    Args:
        ddp: a megatron `DistributedDataParallel` (the `buffers` it holds move).
        optimizer: its `MegatronOptimizer` (ChainedOptimizer forwards to its children), or None.
        device: the compute device.
    """

    def __init__(self, ddp: Any, optimizer: Any, device: torch.device) -> None:
        self.ddp, self.optimizer, self.device = ddp, optimizer, device
        self.on_device = True

    def _buffer_bytes(self) -> int:
        total = 0
        for buf in _buffers(self.ddp):
            for t in (buf.param_data, buf.grad_data):
                if t is not None:
                    total += t.untyped_storage().size()
        return total

    def offload(self) -> ResidencyReport:
        """Optimizer state to host, then the DDP param and grad buffers (idempotent)."""
        if not self.on_device:
            return self._report("offload", 0, "already offloaded (no-op)")
        before = torch.cuda.memory_allocated(self.device)
        if self.optimizer is not None:
            self.optimizer.offload_to_cpu()  # first: after the buffers it fails (CUDA invalid argument)
        moved = self._buffer_bytes()
        for buf in _buffers(self.ddp):
            buf.offload_to_cpu(move_params=True, move_grads=True)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.on_device = False
        freed = before - torch.cuda.memory_allocated(self.device)
        return self._report("offload", max(moved, freed), f"freed {freed} bytes on {self.device}")

    def onload(self) -> ResidencyReport:
        """DDP buffers back (grads re-zeroed), then optimizer state (idempotent)."""
        if self.on_device:
            return self._report("onload", 0, f"already resident on {self.device} (no-op)")
        before = torch.cuda.memory_allocated(self.device)
        for buf in _buffers(self.ddp):
            buf.reload_from_cpu(move_params=True, move_grads=True)
        if self.optimizer is not None:
            self.optimizer.restore_from_cpu()
        torch.cuda.synchronize(self.device)
        self.on_device = True
        moved = torch.cuda.memory_allocated(self.device) - before
        return self._report("onload", moved, f"moved {moved} bytes from cpu to {self.device}")

    def _report(self, action: str, moved: int, message: str) -> ResidencyReport:
        log.info("%s: %s", action, message)
        return ResidencyReport(action, moved > 0, moved, str(self.device), message)


def scoring_residency(model: torch.nn.Module, device: torch.device) -> Residency:
    """A forward-only (teacher) model's residency: parameters only, no optimizer, no DDP buffers."""
    return Residency(model, device)
