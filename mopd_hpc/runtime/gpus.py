"""GPU tokens of `CUDA_VISIBLE_DEVICES`, kept as strings: never `int()` a token.

A token is one of (CUDA programming guide, "CUDA Environment Variables"; Slurm gres.shtml):
- an index, `"3"` — relative to the devices the process can open; with Slurm's
  `ConstrainDevices=yes` it is renumbered from 0 inside the job;
- a GPU UUID, `"GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"`, or any unique prefix of one (`"GPU-8932f9"`);
- a MIG instance, `"MIG-<uuid>"` or the older `"MIG-GPU-<uuid>/<gi>/<ci>"`.
CUDA stops at the first invalid entry, so `"-1"` (or `"0,-1,2"` after the `0`) hides what follows.
Slurm without GPU gres once exported `NoDevFiles` (ray-project/ray#7014): no GPU.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

GpuKind = Literal["index", "uuid", "mig"]

#: Values of CUDA_VISIBLE_DEVICES that mean "no GPU".
NO_GPU_VALUES = frozenset({"", "NoDevFiles", "none", "None"})

_INDEX_RE = re.compile(r"^\d+$")
_NEGATIVE_RE = re.compile(r"^-\d+$")
_UUID_RE = re.compile(r"^GPU-[0-9a-fA-F][0-9a-fA-F-]*$")
_MIG_RE = re.compile(r"^MIG-(?:GPU-)?[0-9a-fA-F][0-9a-fA-F-]*(?:/\d+/\d+)?$")


class GpuTokenError(ValueError):
    """A CUDA_VISIBLE_DEVICES value that is not a list of indices, GPU UUIDs or MIG ids."""


def token_kind(token: str) -> GpuKind:
    """Classify one token: `"index"`, `"uuid"` (full or short `GPU-` UUID) or `"mig"`.

    Raises:
        GpuTokenError: the token is none of them; the message quotes it.
    """
    if _INDEX_RE.match(token):
        return "index"
    if _UUID_RE.match(token):
        return "uuid"
    if _MIG_RE.match(token):
        return "mig"
    raise GpuTokenError(
        f"GPU token {token!r} is not a device index, a 'GPU-<uuid>' (full or prefix) or a 'MIG-<uuid>' id"
    )


def parse_visible_devices(value: str | None, variable: str = "CUDA_VISIBLE_DEVICES") -> tuple[str, ...]:
    """Split a CUDA_VISIBLE_DEVICES value into its tokens, exactly as given (whitespace trimmed).

    Args:
        value: the variable's value; None (unset) and NO_GPU_VALUES give `()`.
        variable: the name quoted in errors.
    Returns:
        the visible tokens in CUDA order, e.g. `("3", "1")`; a negative index ends the list (CUDA rule).
    Raises:
        GpuTokenError: an empty item (`"0,,1"`), a token of no known kind, or a token given twice.
    """
    if value is None or value.strip() in NO_GPU_VALUES:
        return ()
    tokens: list[str] = []
    for raw in value.split(","):
        token = raw.strip()
        if _NEGATIVE_RE.match(token):
            break
        if not token:
            raise GpuTokenError(f"{variable}={value!r}: empty item; expected a comma-separated list of GPUs")
        try:
            token_kind(token)
        except GpuTokenError as exc:
            raise GpuTokenError(f"{variable}={value!r}: {exc}") from None
        if token in tokens:
            raise GpuTokenError(f"{variable}={value!r}: GPU {token!r} is listed twice")
        tokens.append(token)
    return tuple(tokens)


def physical_gpus(tokens: Sequence[str], slurm_gpus: Sequence[str] | None) -> tuple[str, ...]:
    """Best-known physical identity of each visible token, for spotting a GPU given twice on a host.

    UUID and MIG tokens are physical already. An index token is renumbered when Slurm confines
    devices (`ConstrainDevices=yes`: the job sees its GPUs as 0..k-1) and then maps through the
    step's global GPU ids (`SLURM_STEP_GPUS`, or `SLURM_JOB_GPUS` in a batch step), e.g. token
    `"0"` with `SLURM_STEP_GPUS=3` → `"3"`. Otherwise the index is taken as the host's index.

    Args:
        tokens: visible tokens, from `parse_visible_devices`.
        slurm_gpus: the global GPU ids Slurm gave this step on this node, or None when unknown.
    Returns:
        one physical id per token, as strings.
    """
    if not slurm_gpus:
        return tuple(tokens)
    indices = [t for t in tokens if token_kind(t) == "index"]
    renumbered = (
        len(indices) == len(tokens) == len(slurm_gpus)
        and list(tokens) == [str(i) for i in range(len(tokens))]
        and list(tokens) != list(slurm_gpus)
    )
    if renumbered:
        return tuple(slurm_gpus)
    return tuple(tokens)
