"""Fused Triton kernels for token log-probs: one pass over each row of logits, online logsumexp.

Imported lazily by `mopd_hpc.mopd.logprobs` (Triton is absent on CPU-only installs): importing this
module raises ImportError there. One program per row of the [N, V] logits:

- forward: running (max m, sum s) over blocks of the row, lse = m + log s, out = x[index] − lse;
  reads the row once, writes two float32 per row (out, lse).
- backward: ∂out/∂x_v = 1[v = index] − softmax(x)_v, so grad_v = g·(1[v = index] − exp(x_v − lse));
  reads the row once and writes the gradient once, in the logits' dtype, optionally into the logits'
  own storage (`grad` may alias `logits`: each element is read before it is written, by one program).

Shape legend: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements per block of a row and warps per program, forward and backward: the fastest of a sweep of
#: block 1024-16384 x warps 4-32 on one H200 at T = 32,768, V = 151,936, bf16
#: (benchmarks/results/logprob_memory_tune_run1.json; the backward is flat across configs).
FWD_BLOCK, FWD_NUM_WARPS = 8192, 4
BWD_BLOCK, BWD_NUM_WARPS = 4096, 8


@triton.jit
def _logprob_fwd_kernel(logits_ptr, index_ptr, out_ptr, lse_ptr, stride_row, n_vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m = float("-inf")
    s = 0.0
    for start in range(0, n_vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    idx = tl.load(index_ptr + row).to(tl.int64)
    x_t = tl.load(base + idx).to(tl.float32)
    tl.store(out_ptr + row, x_t - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logprob_bwd_kernel(
    logits_ptr,
    grad_ptr,
    index_ptr,
    lse_ptr,
    gout_ptr,
    stride_row,
    grad_stride_row,
    n_vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    gbase = grad_ptr + row * grad_stride_row
    g = tl.load(gout_ptr + row).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    idx = tl.load(index_ptr + row).to(tl.int64)
    for start in range(0, n_vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n_vocab
        x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
        grad = tl.where(offs == idx, g, 0.0) - g * tl.exp(x - lse)
        tl.store(gbase + offs, grad.to(grad_ptr.dtype.element_ty), mask=valid)


def logprob_forward(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    block: int = FWD_BLOCK,
    num_warps: int = FWD_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N] float32, lse [N] float32) for logits [N, V] (unit stride along V) and index [N] int64."""
    n_rows, n_vocab = logits.shape
    out = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _logprob_fwd_kernel[(n_rows,)](
            logits, index, out, lse, logits.stride(0), n_vocab, BLOCK=block, num_warps=num_warps
        )
    return out, lse


def logprob_backward(
    logits: torch.Tensor,
    index: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad: torch.Tensor,
    *,
    block: int = BWD_BLOCK,
    num_warps: int = BWD_NUM_WARPS,
) -> torch.Tensor:
    """Write ∂L/∂logits into `grad` ([N, V], may be `logits` itself) from grad_out [N]; return `grad`."""
    n_rows, n_vocab = logits.shape
    if n_rows:
        _logprob_bwd_kernel[(n_rows,)](
            logits,
            grad,
            index,
            lse,
            grad_out.contiguous(),
            logits.stride(0),
            grad.stride(0),
            n_vocab,
            BLOCK=block,
            num_warps=num_warps,
        )
    return grad
