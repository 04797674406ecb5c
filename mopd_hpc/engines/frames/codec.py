"""Tensors between processes: one binary frame of named tensors plus a small JSON `meta` (DESIGN.md §7).

A frame is byte-for-byte a safetensors file (https://huggingface.co/docs/safetensors/index, "Format"), so
`safetensors.torch.load(frame)` reads what `encode` writes and `decode` reads what `safetensors.torch.save`
writes:

    [8 bytes]   N: the header length, little-endian uint64
    [N bytes]   the header, UTF-8 JSON: {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
                ..., "__metadata__": {"mopd.meta": "<meta as JSON text>"}}, space-padded so that the data
                starts at a multiple of 8
    [the rest]  the data: each tensor's raw little-endian bytes, C order, back to back (offsets relative to
                the data's start; no holes, no overlap, nothing after the last tensor)

Tensors are laid out largest element first (8-byte, then 4-, 2-, 1-byte dtypes), so each one starts aligned
to its element size and `decode` returns views into the body (`torch.frombuffer`, no copy). `encode` copies
each value once, from the caller's tensors into one buffer (a `Packed` tensor: its parts, concatenated and
cast on the way, with no intermediate). A server streams a frame instead (`layout(...).chunks()`): a tensor
already in the frame's bytes (contiguous CPU parts of its dtype) goes to the socket as views of the caller's
memory, with no copy; any other (cast, on a GPU, non-finite values to replace) is copied piece by piece into
small reused buffers. `meta` carries the control fields (ids,
versions, counts): JSON values, not tensors.

The HTTP content type of a frame is `CONTENT_TYPE`; `over_http.py` reads and writes frames on aiohttp.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mopd_hpc.engines.frames.buffer_pool import BufferPool

#: The HTTP Content-Type (and Accept value) of a frame.
CONTENT_TYPE = "application/x-mopd-tensors"
#: The largest frame `decode` (and the HTTP readers) accept by default, in bytes: 4 GiB.
DEFAULT_MAX_BODY_BYTES = 4 << 30
#: The largest header accepted, in bytes (names, shapes and the control `meta`).
MAX_HEADER_BYTES = 64 << 20
#: The `__metadata__` key that holds `meta` as JSON text (safetensors metadata values are strings).
META_KEY = "mopd.meta"

#: Dtypes a frame may carry, by their safetensors names.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(ValueError):
    """A frame cannot be written or read: too large, truncated, a bad header, a dtype not allowed, or a
    tensor missing or of the wrong dtype/shape. The message names what is wrong and what was expected."""


@dataclass(frozen=True, slots=True)
class Packed:
    """A tensor written as `parts` concatenated along dim 0 and cast to `dtype`, without building the
    concatenation (e.g. the real rows of a padded [B, T, K] batch: parts = [x[b, :n_b]], shape [Σ n_b, K]).
    `nonfinite`: the value NaN and ±inf become on the way (None: kept as they are).

    Raises:
        WireError: no parts, 0-d parts, or parts whose trailing dims differ.
    """

    parts: tuple[torch.Tensor, ...]
    dtype: torch.dtype
    nonfinite: float | None = None

    def __post_init__(self) -> None:
        shapes = [list(p.shape) for p in self.parts]
        if not self.parts or self.parts[0].dim() == 0 or len({tuple(s[1:]) for s in shapes}) != 1:
            raise WireError(f"Packed parts of shapes {shapes}: expected >= 1 part, same trailing dims")

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(int(p.shape[0]) for p in self.parts), *self.parts[0].shape[1:])


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame: `tensors` (name → CPU tensor, views into the body) and the control `meta`."""

    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def tensor(self, name: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
        """Tensor `name`, checked to have one of `dtypes` and `ndim` dimensions.

        Raises:
            WireError: the frame has no tensor `name`, or it has another dtype or rank.
        """
        if name not in self.tensors:
            raise WireError(f"frame has no tensor {name!r} (has {sorted(self.tensors)}); expected one")
        t = self.tensors[name]
        if t.dtype not in dtypes or t.dim() != ndim:
            want = " or ".join(_NAMES[d] for d in dtypes)
            raise WireError(
                f"tensor {name!r} is {_NAMES[t.dtype]} of shape {list(t.shape)}; expected {want} with {ndim} dims"
            )
        return t

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data in the frame (the header excluded)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _check_host() -> None:
    if sys.byteorder != "little":
        raise WireError("this host is big-endian; frames hold little-endian data (no big-endian support)")


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a layout: its flat parts (1-d views, concatenated on the wire) and byte range."""

    dtype: torch.dtype
    parts: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]  # element index of each part in the concatenation
    numel: int
    begin: int  # byte offset in the frame (header included)
    nonfinite: float | None

    def fill(self, dst: torch.Tensor, first: int) -> None:
        """dst (1-d, this dtype) ← elements [first, first + len(dst)) of the concatenation."""
        k = bisect.bisect_right(self.starts, first) - 1
        done, n = 0, dst.numel()
        while done < n:
            part, at = self.parts[k], first + done - self.starts[k]
            take = min(n - done, part.numel() - at)
            dst[done : done + take].copy_(part[at : at + take])
            done += take
            k += 1
        if self.nonfinite is not None and not math.isfinite(float(dst.sum())):  # one pass, no temporary
            dst.nan_to_num_(nan=self.nonfinite, posinf=self.nonfinite, neginf=self.nonfinite)

    def as_is(self) -> bool:
        """True when the frame's bytes of this tensor are its parts' own bytes: every part a contiguous
        CPU tensor of the frame's dtype, and free of non-finite values when `nonfinite` asks to replace
        them (a sum is non-finite when any term is: one read pass, no temporary). Then `chunks` sends
        views of the parts, with no copy."""
        for p in self.parts:
            if p.device.type != "cpu" or p.dtype != self.dtype or not p.is_contiguous():
                return False
        if self.nonfinite is not None:
            return all(math.isfinite(float(p.sum())) for p in self.parts if p.numel())
        return True


@dataclass(frozen=True, slots=True)
class FrameLayout:
    """Where each tensor goes in a frame, before any data is copied. Build with `layout`; then `encode()`
    (the whole frame in one buffer) or `chunks()` (the frame piece by piece, to stream it)."""

    head: bytes  # the length field and the padded header JSON
    entries: tuple[_Entry, ...]
    size: int  # bytes of the whole frame

    def encode(self) -> memoryview:
        """The frame in one new buffer (not zero-filled: every byte is written), a writable memoryview."""
        buffer = torch.empty(self.size, dtype=torch.uint8)
        out = memoryview(buffer.numpy())
        out[: len(self.head)] = self.head
        for e in self.entries:
            if e.numel:
                e.fill(buffer[e.begin : e.begin + e.numel * e.dtype.itemsize].view(e.dtype), 0)
        return out

    def chunks(self, chunk_bytes: int = 1 << 20, pool: BufferPool | None = None) -> Iterator[memoryview]:
        """The frame as consecutive pieces of <= chunk_bytes (at least one element): `batches` flattened."""
        for batch in self.batches(chunk_bytes, pool):
            yield from batch

    def batches(
        self, chunk_bytes: int = 1 << 20, pool: BufferPool | None = None
    ) -> Iterator[list[memoryview]]:
        """The frame as consecutive pieces, in batches that each cost one step of work: the header; then,
        per tensor, either all of its pieces at once as read-only views of the caller's tensors (no copy:
        `_Entry.as_is`, contiguous CPU parts of the frame's dtype, finite where non-finite values are
        replaced; do not modify them until the frame is sent), or one piece at a time, each copied (cast,
        packed, non-finite values replaced) into a buffer lent by `pool` (reused once the piece is dropped;
        a new pool of 2 when None), so a transport may hold pieces until they are sent. Pieces hold
        <= chunk_bytes (at least one element). A streaming writer runs each `next` off its event loop."""
        pool = BufferPool(keep=2) if pool is None else pool
        yield [memoryview(self.head)]
        for e in self.entries:
            if e.as_is():
                views = []
                for part in e.parts:
                    if part.numel():
                        raw = memoryview(part.view(torch.uint8).numpy()).toreadonly()
                        views += [raw[at : at + chunk_bytes] for at in range(0, raw.nbytes, chunk_bytes)]
                yield views
                continue
            step = max(1, chunk_bytes // e.dtype.itemsize)
            for first in range(0, e.numel, step):
                n = min(step, e.numel - first)
                piece = pool.lend(n * e.dtype.itemsize)
                e.fill(torch.frombuffer(piece, dtype=e.dtype), first)
                yield [piece]


def layout(
    tensors: Mapping[str, torch.Tensor | Packed], meta: Mapping[str, Any] | None = None
) -> FrameLayout:
    """The layout of one frame of `tensors` (any device, any strides) and `meta` (module docstring).

    Args:
        tensors: name → tensor (or `Packed`) of a dtype in `DTYPES`; names are non-empty and not
            "__metadata__".
        meta: JSON-serializable control fields (default {}).
    Raises:
        WireError: a dtype not in `DTYPES`, a bad name, or `meta` not JSON-serializable.
    """
    _check_host()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise WireError(f"tensor name {name!r}: expected a non-empty string other than '__metadata__'")
        if not isinstance(t, torch.Tensor | Packed):
            raise WireError(f"tensor {name!r} is {type(t).__name__}; expected a torch.Tensor")
        if t.dtype not in _NAMES:
            raise WireError(f"tensor {name!r} has dtype {t.dtype}; expected one of {sorted(DTYPES)}")
    try:
        meta_text = json.dumps(dict(meta or {}), separators=(",", ":"))  # ±Infinity/NaN as Python writes them
    except (TypeError, ValueError) as err:
        raise WireError(
            f"meta is not JSON-serializable ({err}); expected str/int/float/bool/None/lists/dicts"
        ) from None
    order = sorted(tensors, key=lambda n: -tensors[n].dtype.itemsize)  # stable: keeps the caller's order
    header: dict[str, Any] = {"__metadata__": {META_KEY: meta_text}}
    flat: list[tuple[torch.Tensor | Packed, tuple[torch.Tensor, ...]]] = []
    offset = 0
    for name in order:
        t = tensors[name]
        parts = tuple(p.reshape(-1) for p in (t.parts if isinstance(t, Packed) else (t,)))
        size = sum(p.numel() for p in parts) * t.dtype.itemsize
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        flat.append((t, parts))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    start = 8 + len(head)
    entries = []
    for name, (t, parts) in zip(order, flat, strict=True):
        starts = tuple(itertools.accumulate((p.numel() for p in parts[:-1]), initial=0))
        entries.append(
            _Entry(
                dtype=t.dtype,
                parts=parts,
                starts=starts,
                numel=sum(p.numel() for p in parts),
                begin=start + header[name]["data_offsets"][0],
                nonfinite=t.nonfinite if isinstance(t, Packed) else None,
            )
        )
    return FrameLayout(len(head).to_bytes(8, "little") + head, tuple(entries), start + offset)


def encode(tensors: Mapping[str, torch.Tensor | Packed], meta: Mapping[str, Any] | None = None) -> memoryview:
    """One frame of `tensors` and `meta` in one buffer (`layout(...).encode()`): each value copied once,
    straight into the frame. Returns a writable byte memoryview (send it as an HTTP body; `decode` reads it
    without a copy). Raises WireError as `layout`."""
    return layout(tensors, meta).encode()


def decode(body: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Frame:
    """Read one frame. A writable body (bytearray) is not copied: the tensors are views into it; a
    read-only one (bytes) is copied once first.

    Raises:
        WireError: the body is larger than `max_bytes`, truncated, has a malformed header, a dtype not in
            `DTYPES`, offsets that do not tile the data, or bytes after the last tensor.
    """
    _check_host()
    view = memoryview(body)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = view.nbytes
    if size > max_bytes:
        raise WireError(
            f"frame is {size} bytes; max_body_bytes is {max_bytes}: send fewer rows per request, or raise "
            "max_body_bytes on the reading side"
        )
    if size < 8:
        raise WireError(f"truncated frame: {size} bytes; expected at least 8 (the header length)")
    head_len = int.from_bytes(view[:8], "little")
    if head_len > MAX_HEADER_BYTES:
        raise WireError(f"bad frame header: length {head_len} bytes; expected at most {MAX_HEADER_BYTES}")
    if 8 + head_len > size:
        raise WireError(
            f"truncated frame: the header is {head_len} bytes but only {size - 8} follow the length field"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"bad frame header: not UTF-8 JSON ({err})") from None
    if not isinstance(header, dict):
        raise WireError(f"bad frame header: a JSON {type(header).__name__}; expected an object")
    meta = _meta(header.pop("__metadata__", None))
    if view.readonly:
        body = bytearray(view)  # torch tensors must not alias read-only memory
    start, data_len = 8 + head_len, size - 8 - head_len
    specs = {name: _spec(name, entry, data_len) for name, entry in header.items()}
    _check_tiling(specs, data_len)
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in specs.items():
        count = (end - begin) // dtype.itemsize
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif (start + begin) % dtype.itemsize:  # a foreign writer's unaligned layout: copy that tensor
            raw = torch.frombuffer(body, dtype=torch.uint8, count=end - begin, offset=start + begin)
            tensors[name] = raw.clone().view(dtype).view(shape)
        else:
            tensors[name] = torch.frombuffer(body, dtype=dtype, count=count, offset=start + begin).view(shape)
    return Frame(tensors, meta)


def _meta(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError(f"bad frame header: __metadata__ is {metadata!r:.80}; expected an object of strings")
    text = metadata.get(META_KEY)
    if text is None:
        return {}
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise WireError(f"bad frame header: __metadata__[{META_KEY!r}] is not JSON ({err})") from None
    if not isinstance(meta, dict):
        raise WireError(f"bad frame header: meta is a JSON {type(meta).__name__}; expected an object")
    return meta


def _spec(name: str, entry: Any, data_len: int) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise WireError(
            f"bad frame header: tensor {name!r} is {entry!r:.120}; expected dtype, shape, data_offsets"
        )
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise WireError(
            f"tensor {name!r}: dtype {entry['dtype']!r} not allowed; expected one of {sorted(DTYPES)}"
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError(f"bad frame header: tensor {name!r} shape {shape!r}; expected a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise WireError(f"bad frame header: tensor {name!r} data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
        raise WireError(
            f"bad frame header: tensor {name!r} data_offsets {offsets} for {entry['dtype']} {shape}; "
            f"expected end - begin = {numel * dtype.itemsize} bytes"
        )
    if end > data_len:
        raise WireError(
            f"truncated frame: tensor {name!r} needs data bytes [{begin}, {end}) but the frame holds {data_len}"
        )
    return dtype, shape, begin, end


def _check_tiling(specs: Mapping[str, tuple[torch.dtype, list[int], int, int]], data_len: int) -> None:
    """The tensors' byte ranges cover [0, data_len) exactly: no hole, no overlap, nothing after the end."""
    pos = 0
    for name, (_, _, begin, end) in sorted(specs.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != pos:
            what = "overlaps the tensor before it" if begin < pos else f"leaves a hole at [{pos}, {begin})"
            raise WireError(f"bad frame: tensor {name!r} at data bytes [{begin}, {end}) {what}")
        pos = end
    if pos != data_len:
        raise WireError(f"bad frame: {data_len - pos} bytes after the last tensor (data is {data_len} bytes)")
