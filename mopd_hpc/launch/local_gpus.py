"""The GPUs a local job (cluster.backend: local, shape colocated) runs on: the first `gpus_per_node` of this
machine's GPUs, checked before anything starts.

This machine's GPUs: the tokens of `CUDA_VISIBLE_DEVICES` when it is set (indices, GPU-/MIG- UUIDs, kept as
strings: `runtime.gpus`), else one index per line of `nvidia-smi -L` ("GPU 0: NVIDIA H200 (UUID: …)"),
else none. The guard gets `CUDA_VISIBLE_DEVICES` = the chosen tokens ("" for a CPU job, so that a CPU
config stays on the CPU on a GPU machine), and places its children on them as a Slurm node's guard does.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from mopd_hpc.runtime.gpus import GpuTokenError, parse_visible_devices


class LocalGpuError(ValueError):
    """The config asks for more GPUs than this machine shows, or CUDA_VISIBLE_DEVICES is malformed."""


def nvidia_smi_gpus() -> tuple[str, ...] | None:
    """Indices of the GPUs `nvidia-smi -L` lists ("0", "1", …); () when it fails; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        listing = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    return tuple(str(i) for i in range(count))


def machine_gpus(
    environ: Mapping[str, str], list_gpus: Callable[[], Sequence[str] | None] = nvidia_smi_gpus
) -> tuple[str, ...]:
    """This machine's GPU tokens (module docstring).

    Raises:
        LocalGpuError: CUDA_VISIBLE_DEVICES is set but malformed.
    """
    if "CUDA_VISIBLE_DEVICES" in environ:
        try:
            return parse_visible_devices(environ["CUDA_VISIBLE_DEVICES"])
        except GpuTokenError as exc:
            raise LocalGpuError(str(exc)) from None
    return tuple(list_gpus() or ())


def local_gpu_tokens(
    environ: Mapping[str, str],
    wanted: int,
    field: str = "cluster.group.gpus_per_node",
    list_gpus: Callable[[], Sequence[str] | None] = nvidia_smi_gpus,
) -> tuple[str, ...]:
    """The first `wanted` of this machine's GPU tokens; () when `wanted` is 0 (nothing is probed).

    Raises:
        LocalGpuError: fewer GPUs than `wanted` (the message names `field`, both counts and where the
            machine's list came from), or a malformed CUDA_VISIBLE_DEVICES.
    """
    if wanted <= 0:
        return ()
    if "CUDA_VISIBLE_DEVICES" in environ:
        have = machine_gpus(environ, list_gpus)
        source = f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
    else:
        listed = list_gpus()
        have = tuple(listed or ())
        source = "nvidia-smi not found" if listed is None else "nvidia-smi -L"
    if len(have) < wanted:
        shows = f"{len(have)} ({source})" if have else f"no GPU ({source})"
        raise LocalGpuError(
            f"{field}: the config asks for {wanted} GPU(s), this machine shows {shows}; run it where {wanted} "
            f"GPU(s) are visible (CUDA_VISIBLE_DEVICES), or submit it to a Slurm cluster (cluster.backend: slurm, "
            "without --local)"
        )
    return tuple(have[:wanted])
