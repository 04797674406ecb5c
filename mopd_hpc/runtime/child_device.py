"""The device a guard child computes on: one record, from the GPUs the guard gave it and the plan's base GPU.

A guard child sees the GPUs of its `ChildSpec` (CUDA_VISIBLE_DEVICES, set by the guard) and computes on
`ChildSpec.device_index` of them: the actor's device, a rollout engine's first GPU (SGLang's base_gpu_id), a
teacher's device. The plan passes it as MOPD_BASE_GPU_ID only when it is not the first visible GPU
(`runtime/plan.py` child_environment); without it the child computes on its first visible GPU — the plan's
rule ("None = its only or first device"). `RankTopology.local_device_index` is the rule for a Slurm task
nobody told (one GPU → 0; every GPU of the node → its local rank); a guard child is told, and its local rank
counts the children of its role on the node, not GPUs (a separated rollout engine of tensor-parallel size 2,
the second on its node, sees its own two GPUs and starts at the first, while its local rank is 1), so the
plan's record decides here.

`ChildDevice.from_env(env)` reads CUDA_VISIBLE_DEVICES (tokens kept as strings, `runtime/gpus.py`),
MOPD_BASE_GPU_ID and, on Slurm, the step's global GPU ids for the physical identity (`gpus.physical_gpus`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.gpus import physical_gpus
from mopd_hpc.runtime.topology_env import TopologyError, read_int, read_slurm_gpus, read_visible_tokens


@dataclass(frozen=True, slots=True)
class ChildDevice:
    """Where one child computes. Build with `ChildDevice.from_env(env)`; `ChildDevice()` is the CPU.

    Attributes:
        index: the CUDA device ordinal, into the child's visible GPUs; None on the CPU.
        token: its CUDA_VISIBLE_DEVICES token ("3", "GPU-<uuid>", "MIG-<uuid>"); None on the CPU.
        physical: its best-known physical id (`gpus.physical_gpus`); None on the CPU.
    """

    index: int | None = None
    token: str | None = None
    physical: str | None = None

    @property
    def is_cuda(self) -> bool:
        return self.index is not None

    @property
    def torch_name(self) -> str:
        """The torch device string: `"cuda:<index>"`, or `"cpu"`."""
        return "cpu" if self.index is None else f"cuda:{self.index}"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ChildDevice:
        """The device of the child whose environment is `env` (module docstring).

        Raises:
            TopologyError: CUDA_VISIBLE_DEVICES is malformed, or MOPD_BASE_GPU_ID is not an integer naming
                one of the visible GPUs (the message names the variable and its value).
        """
        tokens = read_visible_tokens(env)
        base = read_int(env, child_env.BASE_GPU_ID)
        if not tokens:
            return cls()
        index = 0 if base is None else base
        if index >= len(tokens):
            raise TopologyError(
                f"{child_env.BASE_GPU_ID}={base} is not among the {len(tokens)} GPUs this child sees "
                f"(CUDA_VISIBLE_DEVICES={','.join(tokens)!r}); expected an ordinal below {len(tokens)}"
            )
        slurm = env.get(child_env.BACKEND) != "local"
        physical = physical_gpus(tokens, read_slurm_gpus(env) if slurm else None)
        return cls(index=index, token=tokens[index], physical=physical[index])
