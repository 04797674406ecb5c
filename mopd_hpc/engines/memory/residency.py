"""Offload/onload of an engine's parameters, gradients and optimizer state between device and host.

On a GPU the tensors really move (parameters and their gradients through `Module.to`, which keeps the
Parameter objects, so the optimizer's state keys stay valid; optimizer state tensor by tensor, each back to
the device it came from — AdamW keeps its `step` counters on the CPU). On a CPU device there is nothing to
move: offload and onload are logged no-ops. Engines compose a `Residency`; they never move memory
themselves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mopd_hpc.engines.protocol import EngineError, ResidencyReport

log = logging.getLogger("mopd_hpc.engines.memory.residency")

HOST = torch.device("cpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Residency:
    """Where a model (and optionally its optimizer) lives: on `device` or offloaded to host memory.

    Args:
        model: the module whose parameters (and gradients) move.
        device: its compute device.
        optimizer: optional; its state tensors move with the parameters.
    """

    def __init__(
        self, model: torch.nn.Module, device: torch.device, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        self.model = model
        self.device = device
        self.optimizer = optimizer
        self.on_device = True
        self._state_devices: dict[tuple[int, str], torch.device] = {}

    def _model_bytes(self) -> int:
        total = 0
        for p in self.model.parameters():
            total += _nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0)
        return total

    def _move_optimizer_state(self, to_host: bool) -> int:
        if self.optimizer is None:
            return 0
        moved = 0
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                slot = (id(param), key)
                if to_host:
                    self._state_devices[slot] = value.device
                    target = HOST
                else:
                    target = self._state_devices.pop(slot, value.device)
                if value.device != target:
                    state[key] = value.to(target)
                    moved += _nbytes(value)
        return moved

    def offload(self) -> ResidencyReport:
        """Move parameters, gradients and optimizer state to host memory (idempotent)."""
        if self.device.type == "cpu":
            return self._report("offload", 0, "device is cpu: parameters stay in place (no-op)")
        if not self.on_device:
            return self._report("offload", 0, "already offloaded (no-op)")
        moved = self._model_bytes()
        self.model.to(HOST)
        moved += self._move_optimizer_state(to_host=True)
        self.on_device = False
        torch.cuda.empty_cache()
        return self._report("offload", moved, f"moved {moved} bytes from {self.device} to cpu")

    def onload(self) -> ResidencyReport:
        """Move everything back onto the compute device (idempotent)."""
        if self.device.type == "cpu":
            self.on_device = True
            return self._report("onload", 0, "device is cpu: parameters stay in place (no-op)")
        if self.on_device:
            return self._report("onload", 0, f"already resident on {self.device} (no-op)")
        self.model.to(self.device)
        moved = self._model_bytes() + self._move_optimizer_state(to_host=False)
        self.on_device = True
        return self._report("onload", moved, f"moved {moved} bytes from cpu to {self.device}")

    def _report(self, action: str, moved: int, message: str) -> ResidencyReport:
        log.info("%s: %s", action, message)
        return ResidencyReport(action, moved > 0, moved, str(self.device), message)


class RequiresResident:
    """Mixin of an engine whose calls need its weights on the device: `_require_resident(what)` raises
    EngineError("<what>: <OFFLOADED>; onload() first") while `self.residency` (a `Residency`, or megatron's
    `DDPResidency`: anything with `on_device`) is offloaded. `OFFLOADED` names what is offloaded."""

    residency: Any
    OFFLOADED = "the actor is offloaded"

    def _require_resident(self, what: str) -> None:
        if not self.residency.on_device:
            raise EngineError(f"{what}: {self.OFFLOADED}; onload() first")
