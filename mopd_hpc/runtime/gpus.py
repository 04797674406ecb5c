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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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


#: Where the NVIDIA driver lists the host's GPUs, one directory per PCI device with an `information` file.
NVIDIA_PROC_DIR = Path("/proc/driver/nvidia/gpus")
_UUID_LINE_RE = re.compile(r"^GPU UUID:\s*(\S+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """The GPUs a guard may hand out: each device with the names it answers to, and where they came from.

    `devices[i]` is the tuple of tokens that name device i (its index and, when known, its UUID).
    """

    devices: tuple[tuple[str, ...], ...]
    source: str

    def device_of(self, token: str) -> int | None:
        """The device `token` names, or None."""
        return next((i for i, names in enumerate(self.devices) if token in names), None)

    def describe(self) -> str:
        names = ", ".join(repr(names[-1]) for names in self.devices) or "none"
        return f"{len(self.devices)} GPU(s) ({names}; from {self.source})"


def node_gpus(env: Mapping[str, str], proc_dir: Path = NVIDIA_PROC_DIR) -> NodeGpus:
    """The node's GPUs as the guard sees them: the tokens of its own CUDA_VISIBLE_DEVICES when set (Slurm
    sets it to the job's GPUs on the node; a MIG node lists MIG ids there), else every GPU the NVIDIA driver
    lists under `proc_dir`, named by index (in PCI order) and by UUID; none when neither exists (a CPU node).

    Raises:
        GpuTokenError: CUDA_VISIBLE_DEVICES is malformed.
    """
    if "CUDA_VISIBLE_DEVICES" in env:
        tokens = parse_visible_devices(env["CUDA_VISIBLE_DEVICES"])
        return NodeGpus(tuple((t,) for t in tokens), "the guard's CUDA_VISIBLE_DEVICES")
    try:
        entries = sorted(p for p in proc_dir.iterdir() if p.is_dir())
    except OSError:
        return NodeGpus((), f"{proc_dir} (absent: no NVIDIA driver)")
    devices = []
    for i, entry in enumerate(entries):
        try:
            found = _UUID_LINE_RE.search((entry / "information").read_text(errors="replace"))
        except OSError:
            found = None
        devices.append((str(i),) + ((found.group(1),) if found else ()))
    return NodeGpus(tuple(devices), str(proc_dir))


def gpus_refusal(gpus: Sequence[str], node: NodeGpus) -> str | None:
    """Why a spawn may not be given `gpus` on `node` (a sentence naming the token and the node's GPUs), or
    None: each token must be a valid token (`token_kind`: `"../x"` is not), name one of the node's devices,
    and name a device no other token names (so never more tokens than the node has GPUs)."""
    for token in gpus:
        try:
            token_kind(token)
        except GpuTokenError as exc:
            return f"gpus: {exc}"
    if len(gpus) > len(node.devices):
        return f"gpus lists {len(gpus)} GPU(s), but this node has {node.describe()}"
    seen: dict[int, str] = {}
    for token in gpus:
        device = node.device_of(token)
        if device is None:
            return f"gpus: {token!r} is not a GPU of this node, which has {node.describe()}"
        if device in seen:
            return f"gpus: {token!r} and {seen[device]!r} name the same GPU"
        seen[device] = token
    return None
