"""Colocated weight sync by shared buffers (weight_sync.backend: ipc): the actor and the rollout engine on one
node (and, on GPU, the same devices) share the weights' memory instead of sending them over a group.

As slime and verl hand weights to a colocated SGLang (CUDA IPC), with one difference: the buffers persist.

    actor (rank 0)                                         rollout server (POST /update_weights_from_ipc)
    SharedBuffers.allocate(layout, device)  once           BufferMap.views(request)
      one flat buffer per dtype (more if > bucket_bytes)      maps each buffer on first sight (cached by id)
    fill(named tensors)  per sync: copy into the buffers   load_named_tensors(views, weight_version)
    POST IpcUpdateRequest {buffers, tensors, version}        (under the engine's lock), then answers

Handles (`BufferHandle`, JSON): on CUDA the fields of torch's CUDA IPC reduction
(`torch.multiprocessing.reductions.reduce_tensor` → `rebuild_cuda_tensor`; cudaIpcGetMemHandle, opened by
any process of the node that sees the device); on CPU a file under /dev/shm mapped by both sides
(`torch.from_file(shared=True)`). No pickle crosses the boundary: the handle is bytes (hex) and integers.
The sender owns the memory (files are unlinked by `close`); the receiver keeps its mapping until the buffer
id changes. Memory: the buffers stay allocated on the actor's device (one copy of the HF weights; the memory plan
counts them: `plan/memory_plan.py` ipc_buffer_bytes).

Tied weights are stored once: a name whose tensor is the same view of the same storage as an earlier name's
(the torch engine's state_dict gives a tied `lm_head.weight` that is `model.embed_tokens.weight`) is an alias
(`tied_aliases`): its slot is the earlier name's slot, `fill` copies it once, and the receiver still gets both
names (two views of the same elements).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.engines.request_fields import (
    RolloutRequestError,
    bool_field,
    fail,
    int_field,
    json_object,
    reject_unknown,
    str_field,
)
from mopd_hpc.engines.weight_sync.requests import DTYPE_NAMES

#: Largest buffer, in bytes: a dtype's tensors beyond it go to another buffer (bucket) of that dtype.
DEFAULT_BUCKET_BYTES = 4 << 30
#: Where CPU buffers are created (a tmpfs: the mapping is memory, not disk).
SHM_DIR = "/dev/shm"
HANDLE_KINDS = ("cuda", "file")


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one HF weight lies: buffer index, element offset in it, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: int
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "buffer": self.buffer,
                "offset": self.offset}  # fmt: skip

    @classmethod
    def from_json(cls, body: Any) -> TensorSlot:
        body = json_object("tensors[]", body)
        reject_unknown("tensors[]", body, ("name", "dtype", "shape", "buffer", "offset"))
        shape = body.get("shape")
        if not isinstance(shape, list):
            raise fail("tensors[].shape", shape, "a list of dimension sizes")
        dtype = body.get("dtype")
        if dtype not in DTYPE_NAMES:
            raise fail("tensors[].dtype", dtype, f"one of {list(DTYPE_NAMES)}")
        return cls(
            name=str_field("tensors[].name", body.get("name")),
            dtype=dtype,
            shape=tuple(int_field("tensors[].shape[]", d, 0) for d in shape),
            buffer=int_field("tensors[].buffer", body.get("buffer"), 0),
            offset=int_field("tensors[].offset", body.get("offset"), 0),
        )


@dataclass(frozen=True, slots=True)
class BufferHandle:
    """How another process maps one shared buffer: `kind` "file" (path) or "cuda" (torch's CUDA IPC fields,
    bytes as hex). buffer_id is unique per allocation: a receiver maps each id once."""

    buffer_id: str
    kind: str
    dtype: str
    numel: int
    path: str = ""
    device: int = 0
    handle: str = ""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: str = ""
    ref_counter_offset: int = 0
    event_handle: str = ""
    event_sync_required: bool = False
    tensor_offset: int = 0

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_json(cls, body: Any) -> BufferHandle:
        body = json_object("buffers[]", body)
        reject_unknown("buffers[]", body, cls.__slots__)
        kind, dtype = body.get("kind"), body.get("dtype")
        if kind not in HANDLE_KINDS:
            raise fail("buffers[].kind", kind, f"one of {list(HANDLE_KINDS)}")
        if dtype not in DTYPE_NAMES:
            raise fail("buffers[].dtype", dtype, f"one of {list(DTYPE_NAMES)}")
        ints = ("device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset", "tensor_offset")
        strs = ("path", "handle", "ref_counter_handle", "event_handle")
        out = cls(
            buffer_id=str_field("buffers[].buffer_id", body.get("buffer_id")),
            kind=kind,
            dtype=dtype,
            numel=int_field("buffers[].numel", body.get("numel"), 1),
            event_sync_required=bool_field("buffers[].event_sync_required", body.get("event_sync_required", False)),
            **{k: int_field(f"buffers[].{k}", body.get(k, 0), 0) for k in ints},
            **{k: _str(f"buffers[].{k}", body.get(k, "")) for k in strs},
        )  # fmt: skip
        if kind == "file" and not out.path.startswith(SHM_DIR + "/"):
            raise fail("buffers[].path", out.path, f"a file under {SHM_DIR}/ (the actor's shared buffer)")
        if kind == "cuda" and not out.handle:
            raise fail("buffers[].handle", out.handle, "the hex CUDA IPC handle")
        return out


def _str(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise fail(field, value, "a string")
    return value


@dataclass(frozen=True, slots=True)
class IpcUpdateRequest:
    """Body of POST /update_weights_from_ipc: the buffers (handles), where each weight lies, the version."""

    buffers: tuple[BufferHandle, ...]
    tensors: tuple[TensorSlot, ...]
    weight_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "buffers": [b.to_json() for b in self.buffers],
            "tensors": [t.to_json() for t in self.tensors],
        }
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        return out

    @classmethod
    def from_json(cls, body: Any) -> IpcUpdateRequest:
        """Validated request; raises RolloutRequestError (HTTP 400) naming the field, or the tensor whose
        slot falls outside its buffer or whose dtype is not its buffer's."""
        body = json_object("body", body)
        reject_unknown("/update_weights_from_ipc body", body, ("buffers", "tensors", "weight_version"))
        for field in ("buffers", "tensors"):
            if not isinstance(body.get(field), list) or not body[field]:
                raise fail(field, body.get(field), "a non-empty list")
        buffers = tuple(BufferHandle.from_json(b) for b in body["buffers"])
        tensors = tuple(TensorSlot.from_json(t) for t in body["tensors"])
        for t in tensors:
            if t.buffer >= len(buffers):
                raise RolloutRequestError(f"weight {t.name!r}: buffer {t.buffer} of {len(buffers)} buffers")
            b = buffers[t.buffer]
            if t.dtype != b.dtype or t.offset + t.numel > b.numel:
                raise RolloutRequestError(
                    f"weight {t.name!r}: {t.dtype} elements [{t.offset}, {t.offset + t.numel}) do not lie in "
                    f"buffer {t.buffer} ({b.dtype}, {b.numel} elements)"
                )
        version = body.get("weight_version")
        return cls(buffers, tensors, None if version is None else str_field("weight_version", str(version)))


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype}: expected one of {list(DTYPE_NAMES)}")
    return name


def tied_aliases(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Name → the earlier name it aliases, for every tensor that is the same view (storage, offset, shape,
    strides, dtype) as an earlier one: a tied weight under its second name. Empty tensors alias nothing."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, t in items:
        if t.numel() == 0:
            continue
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def plan_layout(
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    aliases: Mapping[str, str] | None = None,
) -> tuple[list[TensorSlot], list[tuple[str, int]]]:
    """Slots of (name, dtype, shape) specs, in order, and the buffers' (dtype name, numel): one buffer per
    dtype, a new one of that dtype when the next tensor would pass `bucket_bytes` (a tensor larger than
    the limit gets a buffer of its own). A name in `aliases` (→ an earlier name of the same dtype and shape,
    `tied_aliases`) takes that name's slot and no space.

    Raises:
        ValueError: an alias of a name not laid out before it, or of another dtype or shape.
    """
    aliases = aliases or {}
    slots: list[TensorSlot] = []
    buffers: list[tuple[str, int]] = []
    open_of: dict[str, int] = {}  # dtype name → index of its buffer being filled
    placed: dict[str, TensorSlot] = {}
    for name, dtype, shape in specs:
        if name in aliases:
            target = placed.get(aliases[name])
            if target is None or target.dtype != dtype_name(dtype) or target.shape != tuple(shape):
                raise ValueError(
                    f"aliases[{name!r}]={aliases[name]!r}: expected an earlier weight of dtype "
                    f"{dtype_name(dtype)} and shape {tuple(shape)}"
                )
            slots.append(dataclasses.replace(target, name=name))
            continue
        dname, size = dtype_name(dtype), torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        i = open_of.get(dname)
        if i is None or (buffers[i][1] + numel) * size > bucket_bytes and buffers[i][1] > 0:
            i = open_of[dname] = len(buffers)
            buffers.append((dname, 0))
        slots.append(TensorSlot(name, dname, tuple(shape), i, buffers[i][1]))
        placed[name] = slots[-1]
        buffers[i] = (dname, buffers[i][1] + numel)
    return slots, buffers


class SharedBuffers:
    """The actor's side: persistent flat buffers and their handles. Build with `allocate`."""

    def __init__(self, slots: list[TensorSlot], tensors: list[torch.Tensor], handles: list[BufferHandle],
                 paths: list[str], aliases: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self.slots, self.tensors, self.handles, self.paths = slots, tensors, handles, paths
        self.aliases = dict(aliases or {})
        self._index = {s.name: s for s in slots}

    @classmethod
    def allocate(
        cls,
        specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        device: torch.device | str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        shm_dir: str = SHM_DIR,
        aliases: Mapping[str, str] | None = None,
    ) -> SharedBuffers:
        """Buffers for `specs` on `device` (CUDA: CUDA IPC; CPU: a file under shm_dir, unlinked by close);
        `aliases` (`tied_aliases`) share their target's slot."""
        device = torch.device(device)
        slots, layout = plan_layout(specs, bucket_bytes, aliases)
        tag = uuid.uuid4().hex[:12]
        tensors, handles, paths = [], [], []
        for i, (dname, numel) in enumerate(layout):
            dtype, buffer_id = getattr(torch, dname), f"{tag}-{i}"
            if device.type == "cuda":
                t = torch.empty(numel, dtype=dtype, device=device)
                handles.append(_cuda_handle(t, buffer_id, dname))
            else:
                path = str(Path(shm_dir) / f"mopd_weights_{os.getpid()}_{buffer_id}")
                t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
                paths.append(path)
                handles.append(BufferHandle(buffer_id, "file", dname, numel, path=path))
            tensors.append(t)
        return cls(slots, tensors, handles, paths, aliases)

    def matches(self, items: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """True when `items` have this layout's names, dtypes and shapes, in order, and tie the same names."""
        return (
            len(items) == len(self.slots)
            and all(
                s.name == n and s.dtype == dtype_name(t.dtype) and s.shape == tuple(t.shape)
                for s, (n, t) in zip(self.slots, items, strict=True)
            )
            and tied_aliases(items) == self.aliases
        )

    @torch.no_grad()
    def fill(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every (HF name, tensor) into its slot, an alias's not again (it is its target's), in one
        multi-tensor copy (`torch._foreach_copy_`: on CUDA a few fused kernels, not one per tensor); on CUDA
        waits for the copies (the reader's stream is another process's)."""
        slots, sources = [], []
        for name, t in items:
            if name in self.aliases:
                continue
            s = self._index[name]
            slots.append(self.tensors[s.buffer][s.offset : s.offset + s.numel])
            sources.append(t.detach().reshape(-1))
        if slots:
            torch._foreach_copy_(slots, sources)
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.synchronize(self.tensors[0].device)

    def request(self, weight_version: str | None) -> IpcUpdateRequest:
        return IpcUpdateRequest(tuple(self.handles), tuple(self.slots), weight_version)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def close(self) -> None:
        """Drop the buffers and unlink the CPU files (a reader's mapping stays valid until it drops it)."""
        self.tensors = []
        for path in self.paths:
            Path(path).unlink(missing_ok=True)
        self.paths = []


def _cuda_handle(t: torch.Tensor, buffer_id: str, dname: str) -> BufferHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, _, _, tensor_offset, _, _, device, handle, size_b, offset_b, _, rc_handle, rc_offset, ev, ev_sync) = (
        args
    )
    return BufferHandle(
        buffer_id, "cuda", dname, t.numel(), device=int(device), handle=bytes(handle).hex(),
        storage_size_bytes=int(size_b), storage_offset_bytes=int(offset_b),
        ref_counter_handle=bytes(rc_handle).hex(), ref_counter_offset=int(rc_offset),
        event_handle=bytes(ev).hex() if ev else "", event_sync_required=bool(ev_sync),
        tensor_offset=int(tensor_offset),
    )  # fmt: skip


def open_buffer(h: BufferHandle) -> torch.Tensor:
    """Map a buffer of another process (1-D, h.numel elements of h.dtype)."""
    dtype = getattr(torch, h.dtype)
    if h.kind == "file":
        if not os.path.exists(h.path):
            raise RolloutRequestError(f"buffers[].path={h.path!r}: no such shared buffer on this node")
        return torch.from_file(h.path, shared=True, size=h.numel, dtype=dtype)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*cuda_rebuild_args(h, (h.numel,), 0))


def cuda_rebuild_args(h: BufferHandle, shape: Sequence[int], offset: int) -> tuple[Any, ...]:
    """The arguments of torch's `rebuild_cuda_tensor` (torch.multiprocessing.reductions, the order
    `reduce_tensor` gives them) for a contiguous tensor of `shape` at element `offset` of buffer `h`: what
    a CUDA tensor pickled by `ForkingPickler` carries, so any process of the node opens it (once per
    handle: torch caches the storage)."""
    stride, step = [], 1
    for d in reversed(shape):
        stride.insert(0, step)
        step *= d
    return (
        torch.Tensor, torch.Size(shape), tuple(stride), h.tensor_offset + offset, torch.storage.TypedStorage,
        getattr(torch, h.dtype), h.device, bytes.fromhex(h.handle), h.storage_size_bytes,
        h.storage_offset_bytes, False, bytes.fromhex(h.ref_counter_handle), h.ref_counter_offset,
        bytes.fromhex(h.event_handle) if h.event_handle else None, h.event_sync_required,
    )  # fmt: skip


class BufferMap:
    """The rollout server's side: each buffer id is mapped once and kept (`opened` counts the mappings)."""

    def __init__(self) -> None:
        self.mapped: dict[str, torch.Tensor] = {}
        self.opened = 0

    def views(self, req: IpcUpdateRequest) -> dict[str, torch.Tensor]:
        """HF name → a view of its slot in the mapped buffer (no copy). Buffers no longer named are dropped."""
        buffers = []
        for h in req.buffers:
            if h.buffer_id not in self.mapped:
                self.mapped[h.buffer_id] = open_buffer(h)
                self.opened += 1
            buffers.append(self.mapped[h.buffer_id])
        for stale in set(self.mapped) - {h.buffer_id for h in req.buffers}:
            del self.mapped[stale]
        return {t.name: buffers[t.buffer][t.offset : t.offset + t.numel].view(t.shape) for t in req.tensors}
