"""The checkpoint half of the torch actor: `TorchCheckpointState`, the base class of `engine.TorchTrainEngine`
that holds its save and load methods (`state_dict`, `load_state_dict`, `save_pretrained`) and the residency
guard every engine method starts with. It reads the attributes the engine's `__init__` sets (`model`,
`optimizer`, `scheduler`, `residency`, `path`, `steps`); it builds nothing itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.engines.memory.residency import RequiresResident, Residency
from mopd_hpc.engines.torch.hf_model import TOKENIZER_FILES


class TorchCheckpointState(RequiresResident):
    """Save and load of the torch actor's state (module docstring); `TorchTrainEngine` is its subclass."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LambdaLR (engines/lr_schedule.py)
    residency: Residency
    path: str
    steps: int

    def state_dict(self) -> dict[str, Any]:
        """{"model": model state_dict, "optimizer": AdamW state_dict, "scheduler": its lr schedule's state,
        "steps": int}."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._require_resident("load_state_dict")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the student as an HF checkpoint (config.json, safetensors) plus the source's tokenizer
        files, so the directory can be served and scored as is."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out))
        for name in TOKENIZER_FILES:
            src = Path(self.path) / name
            if src.is_file() and not (out / name).exists():
                shutil.copyfile(src, out / name)
