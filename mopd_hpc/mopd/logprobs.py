"""Token log-probs from logits without materializing a float32 [N, V] copy.

    log p(v | row) = x_v − logsumexp(x)          x = one row of logits, in float32 arithmetic

equal to `torch.log_softmax(logits.float(), -1).gather(-1, index)` within 1e-5 absolute, in value and in
gradient (tests/mopd/test_mopd_logprobs.py, V up to 151,936). Backends:

- `triton`: one fused pass per row (online logsumexp) forward, one pass backward
  (`logprobs_triton`); CUDA tensors, one index per position. Triton is imported lazily.
- `chunked`: an autograd.Function over blocks of rows whose forward keeps only the per-row logsumexp
  and whose backward recomputes softmax per block; extra memory is one float32 block (`chunk_bytes`).
- `naive`: the reference above (materializes float32 [N, V] twice); for tests and benchmarks.
- `auto`: triton where it applies, else chunked.

With `inplace_backward=True` the gradient w.r.t. the logits is written into the logits' own storage
(saving an [N, V] buffer, as Liger-Kernel's fused cross-entropy does): only valid when nothing else
needs the logits' values after this backward (true for logits = hidden @ W_lm^T).

Shape legend: N rows (positions), V vocabulary, K indices per position.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

Backend = Literal["auto", "naive", "chunked", "triton"]

#: Bytes of the float32 block the chunked backend materializes at a time (rows = chunk_bytes // (4·V)).
DEFAULT_CHUNK_BYTES = 128 * 2**20


class LogprobError(ValueError):
    """Bad logits/index shapes or values, or a backend that cannot run here."""


@functools.cache
def triton_available() -> bool:
    """True when the Triton kernels import (Triton installed); the result is cached."""
    try:
        import mopd_hpc.mopd.logprobs_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _rows_per_chunk(n_vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * max(1, n_vocab)))


class _ChunkedLogprobs(torch.autograd.Function):
    """logits [N, V] (any float dtype), index [N, K] int64 → float32 [N, K]."""

    @staticmethod
    def forward(ctx, logits, index, chunk_bytes, inplace_backward):  # type: ignore[override]
        n_rows, n_vocab = logits.shape
        out = torch.empty(index.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        step = _rows_per_chunk(n_vocab, chunk_bytes)
        for start in range(0, n_rows, step):
            block = logits[start : start + step].float()
            block_lse = torch.logsumexp(block, dim=-1)
            out[start : start + step] = block.gather(1, index[start : start + step]) - block_lse[:, None]
            lse[start : start + step] = block_lse
        ctx.save_for_backward(logits, index, lse)
        ctx.chunk_bytes = chunk_bytes
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, index, lse = ctx.saved_tensors
        n_rows, n_vocab = logits.shape
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        grad_out = grad_out.float()
        step = _rows_per_chunk(n_vocab, ctx.chunk_bytes)
        for start in range(0, n_rows, step):
            stop = start + step
            probs = torch.exp(logits[start:stop].float() - lse[start:stop, None])
            block_grad = probs.mul_(-grad_out[start:stop].sum(dim=-1, keepdim=True))
            block_grad.scatter_add_(1, index[start:stop], grad_out[start:stop])
            grad[start:stop] = block_grad
        return grad, None, None, None


class _TritonLogprobs(torch.autograd.Function):
    """logits [N, V] CUDA (unit stride along V), index [N] int64 → float32 [N]."""

    @staticmethod
    def forward(ctx, logits, index, inplace_backward):  # type: ignore[override]
        from mopd_hpc.mopd import logprobs_triton

        out, lse = logprobs_triton.logprob_forward(logits, index)
        ctx.save_for_backward(logits, index, lse)
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        from mopd_hpc.mopd import logprobs_triton

        logits, index, lse = ctx.saved_tensors
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        return logprobs_triton.logprob_backward(logits, index, lse, grad_out.float(), grad), None, None


def naive_token_logprobs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The reference: `torch.log_softmax(logits.float(), -1).gather(-1, index)` (float64 stays float64)."""
    single = index.dim() == logits.dim() - 1
    idx = index.unsqueeze(-1) if single else index
    out = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).gather(
        -1, idx
    )
    return out.squeeze(-1) if single else out


def token_logprobs(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    backend: Backend = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """log softmax(logits)[index] in float32, without a float32 [N, V] copy of the logits.

    Args:
        logits: [..., V], float32/bfloat16/float16 (float64 is computed by `naive` exactly).
        index: [...] int (one token per position, e.g. the sampled tokens y_t) or [..., K] (K tokens per
            position, e.g. a teacher's top-k); values in [0, V).
        backend: "auto" (triton on CUDA with one index per position when Triton imports, else chunked),
            "triton", "chunked" or "naive".
        chunk_bytes: float32 block size of the chunked backend, in bytes.
        inplace_backward: write the logits' gradient into the logits' storage (see module docstring).

    Returns:
        float32 tensor (float64 for float64 logits) of `index`'s shape; differentiable w.r.t. `logits`.

    Raises:
        LogprobError: shapes disagree, an index is out of [0, V), or "triton" was asked for where it
            cannot run (no CUDA tensor, Triton missing, or K > 1).
    """
    if logits.dim() < 1 or not logits.is_floating_point():
        raise LogprobError(
            f"logits has shape {list(logits.shape)} dtype {logits.dtype}; expected float [..., V]"
        )
    n_vocab = logits.shape[-1]
    single = index.dim() == logits.dim() - 1
    if not (single and index.shape == logits.shape[:-1]) and not (
        index.dim() == logits.dim() and index.shape[:-1] == logits.shape[:-1]
    ):
        raise LogprobError(
            f"index has shape {list(index.shape)}; expected {list(logits.shape[:-1])} or "
            f"{list(logits.shape[:-1])} + [K] for logits {list(logits.shape)}"
        )
    if index.numel():
        low, high = torch.stack(torch.aminmax(index)).tolist()  # one host sync for both bounds
        if low < 0 or high >= n_vocab:
            raise LogprobError(f"index holds values in [{low}, {high}]; expected [0, {n_vocab})")
    if backend == "naive" or logits.dtype == torch.float64:
        return naive_token_logprobs(logits, index)
    can_triton = logits.is_cuda and single and triton_available()
    if backend == "triton" and not can_triton:
        raise LogprobError(
            f"backend 'triton' needs a CUDA tensor (got {logits.device}), one index per position "
            f"(got index {list(index.shape)}) and Triton (available: {triton_available()})"
        )
    if backend not in ("auto", "triton", "chunked"):
        raise LogprobError(f"backend is {backend!r}; expected 'auto', 'naive', 'chunked' or 'triton'")

    lead = logits.shape[:-1]
    logits2d = logits.reshape(-1, n_vocab)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    if backend == "triton" or (backend == "auto" and can_triton):
        out = _TritonLogprobs.apply(logits2d, index.reshape(-1).long().contiguous(), inplace_backward)
        return out.reshape(lead)
    idx2d = index.reshape(-1, 1 if single else index.shape[-1]).long()
    out = _ChunkedLogprobs.apply(logits2d, idx2d, chunk_bytes, inplace_backward)
    return out.reshape(index.shape)
