"""A counter-based uniform per (row seed, step): no generator state, one batched op for all rows.

The uniform of a row at decoding step t is a pure function of its seed and t, computed with 32-bit
integer arithmetic on int64 tensors (on any device, bit-identical on CPU and CUDA):

    lowbias32(x) = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >>15; x *= 0x846CA68B; x ^= x >> 16   (mod 2**32)
    G            = 0x9E3779B9 (the golden-ratio constant)
    key(seed)    = lowbias32(lo ^ lowbias32(hi ^ G))     (lo, hi: the 32-bit halves of seed mod 2**64)
    bits(seed,t) = lowbias32(lowbias32((key + t·G) mod 2**32) ^ key)
    u(seed,t)    = (bits >> 8) · 2**-24            float32 in [0, 1), 24 random bits (exact in float32)

lowbias32 is Chris Wellons' 32-bit integer hash (hash-prospector, bias 0.17). A row's draws thus depend only
on its seed and its step index, never on the batch it runs in or on how many engines serve the job.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_M1, _M2, GOLDEN = 0x7FEB352D, 0x846CA68B, 0x9E3779B9


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each element of an int64 tensor holding values in [0, 2**32); same shape, int64.

    The products wrap in int64 (two's complement), which keeps their low 32 bits exact.
    """
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def _lowbias32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def row_keys(seeds: list[int], device: torch.device) -> torch.Tensor:
    """key(seed) for each row (computed on the host, exact for any Python int): [B] int64 on `device`."""
    keys = []
    for seed in seeds:
        s = seed & 0xFFFFFFFFFFFFFFFF
        keys.append(_lowbias32_int((s & MASK32) ^ _lowbias32_int((s >> 32) ^ GOLDEN)))
    return torch.tensor(keys, dtype=torch.int64, device=device)


def uniforms(keys: torch.Tensor, step: int) -> torch.Tensor:
    """u(seed, step) for every row: [B] float32 in [0, 1) on the keys' device (no host sync)."""
    bits = lowbias32(lowbias32((keys + (step * GOLDEN) % (MASK32 + 1)) & MASK32) ^ keys)
    return (bits >> 8).to(torch.float32) * (2.0**-24)
