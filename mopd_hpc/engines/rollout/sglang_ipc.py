"""The ipc weight sync into a colocated SGLang engine: the actor's shared buffers (`engines/weight_sync/ipc.py`)
handed to SGLang's own weight-update API as references, never opened in the rollout role's process.

    actor (IpcSync)                      rollout role (sglang_server.py)          SGLang's TP workers
    fill the shared buffers, POST        /update_weights_from_ipc:                 deserialize (SafeUnpickler),
    IpcUpdateRequest {buffers,    ─────► `named_refs(req)`: (HF name, IpcTensorRef) open each buffer once
    tensors, weight_version}             Engine.update_weights_from_tensor(  ─────► (torch caches the storage),
                                           named_tensors, load_format=None,        model.load_weights(named)
                                           flush_cache=True)

SGLang 0.5.17 (`srt/entrypoints/engine.py` Engine.update_weights_from_tensor) pickles `named_tensors` with
`MultiprocessingSerializer` (torch's ForkingPickler) once per TP rank; each rank unpickles its copy with
`SafeUnpickler` (modules torch.*, functools.*, sglang.srt.utils.* ... only) and loads the tensors with the
model's own `load_weights` (HF names; q/k/v and gate/up stacked by it; a tied lm_head skipped by it).
A CUDA tensor pickles as torch's `rebuild_cuda_tensor(...)` with its CUDA IPC handle; an `IpcTensorRef`
pickles as exactly that call for its slot of the actor's buffer (`ipc.cuda_rebuild_args`): the TP workers
open the actor's memory directly, and the rollout role never maps it (torch cannot re-share memory it
opened by CUDA IPC: `cudaIpcGetMemHandle` refuses an imported pointer). SGLang's own patch of the reductions
(`monkey_patch_torch_reductions`: a device index or a GPU UUID) takes the device index we send. The device
index is the actor's (its CUDA_VISIBLE_DEVICES): the colocated engine's TP workers see the same devices, as
the hf server's IPC path assumes (`ipc.open_buffer`).

A "file" buffer (CPU: a /dev/shm file) pickles as `torch.as_strided(torch.from_file(path, shared=True, size,
dtype), shape, stride, offset)`, torch callables only: the CI path with a stand-in Engine (SGLang itself
runs on GPUs only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.engines.weight_sync.ipc import BufferHandle, IpcUpdateRequest, cuda_rebuild_args


@dataclass(frozen=True, slots=True)
class _FileBuffer:
    """A whole CPU shared buffer: pickles as `torch.from_file(path, shared=True, size=numel, dtype=...)`.
    One object per buffer, so pickle's memo opens the file once per payload."""

    handle: BufferHandle

    def __reduce__(self) -> tuple[Any, ...]:
        h = self.handle
        return functools.partial(torch.from_file, dtype=getattr(torch, h.dtype)), (h.path, True, h.numel)


@dataclass(frozen=True, slots=True)
class IpcTensorRef:
    """One weight's slot of a shared buffer (`TensorSlot` in `handle`'s buffer), picklable as the tensor it
    names (module docstring). shape: the weight's; offset: elements from the buffer's start."""

    handle: BufferHandle
    shape: tuple[int, ...]
    offset: int
    buffer: _FileBuffer | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        if self.handle.kind == "cuda":
            from torch.multiprocessing import reductions

            # whichever function torch's reductions hold now (SGLang may have patched them): by name
            return reductions.rebuild_cuda_tensor, cuda_rebuild_args(self.handle, self.shape, self.offset)
        stride = torch.empty(self.shape, device="meta").stride()
        return torch.as_strided, (self.buffer, self.shape, stride, self.offset)


def named_refs(req: IpcUpdateRequest) -> list[tuple[str, IpcTensorRef]]:
    """(HF name, reference) for every weight of a validated request, in its order, a tied weight under its
    first name only (its second names the same slot: SGLang's model ties it itself, e.g. Qwen3's
    `load_weights` loads a tied lm_head from model.embed_tokens.weight and has no "lm_head.weight" to load)."""
    files = [_FileBuffer(h) if h.kind == "file" else None for h in req.buffers]
    seen: set[tuple[int, int, str, tuple[int, ...]]] = set()
    out = []
    for t in req.tensors:
        if (key := (t.buffer, t.offset, t.dtype, t.shape)) in seen:
            continue
        seen.add(key)
        out.append((t.name, IpcTensorRef(req.buffers[t.buffer], t.shape, t.offset, files[t.buffer])))
    return out
