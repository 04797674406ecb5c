"""Token log-probs from logits: chunked (CPU/GPU) and Triton (GPU) against the naive float32 reference,
in value and gradient, within 1e-5 absolute."""

from __future__ import annotations

import pytest
import torch

from mopd_hpc.mopd.logprobs import LogprobError, naive_token_logprobs, token_logprobs, triton_available

ATOL = 1e-5
HAS_TRITON_GPU = torch.cuda.is_available() and triton_available()


def case(n: int, vocab: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0, scale: float = 4.0):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (scale * torch.randn(n, vocab, generator=gen, device=device)).to(dtype)
    index = torch.randint(0, vocab, (n,), generator=gen, device=device)
    grad_out = torch.randn(n, generator=gen, device=device)
    return logits, index, grad_out


def value_and_grad(fn, logits: torch.Tensor, index: torch.Tensor, grad_out: torch.Tensor):
    x = logits.clone().requires_grad_(True)
    out = fn(x, index)
    (out * grad_out.reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


def check_against_naive(logits, index, grad_out, grad_atol=ATOL, **kw) -> None:
    want, want_grad = value_and_grad(naive_token_logprobs, logits, index, grad_out)
    got, got_grad = value_and_grad(lambda x, i: token_logprobs(x, i, **kw), logits, index, grad_out)
    assert got.dtype == torch.float32 and got.shape == index.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert got_grad.dtype == logits.dtype
    torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=grad_atol, rtol=0)


@pytest.mark.parametrize("chunk_bytes", [4096 * 4 * 7, 2**27], ids=["many_chunks", "one_chunk"])
def test_chunked_matches_naive_v4096(chunk_bytes: int) -> None:
    logits, index, grad_out = case(64, 4096, torch.float32)
    check_against_naive(logits, index, grad_out, backend="chunked", chunk_bytes=chunk_bytes)


def test_chunked_matches_naive_at_qwen_vocab() -> None:
    logits, index, grad_out = case(6, 151_936, torch.float32, seed=1, scale=8.0)
    check_against_naive(logits, index, grad_out, backend="chunked", chunk_bytes=151_936 * 4 * 4)


def test_chunked_bf16_logits() -> None:
    logits, index, grad_out = case(32, 4096, torch.bfloat16, seed=2)
    # Values to 1e-5; the gradient is bf16, so it matches to one bf16 rounding of the same float32 value.
    want, want_grad = value_and_grad(naive_token_logprobs, logits, index, grad_out)
    got, got_grad = value_and_grad(
        lambda x, i: token_logprobs(x, i, backend="chunked"), logits, index, grad_out
    )
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=ATOL, rtol=2**-8)


def test_batched_shapes_and_k_indices() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 300, generator=gen)
    index = torch.randint(0, 300, (2, 5, 4), generator=gen)
    grad_out = torch.randn(2, 5, 4, generator=gen)
    check_against_naive(logits, index, grad_out, backend="chunked", chunk_bytes=300 * 4 * 3)
    check_against_naive(logits, index[..., 0], grad_out[..., 0], backend="auto")


def test_inplace_backward_writes_the_gradient_into_the_logits() -> None:
    logits, index, grad_out = case(16, 512, torch.float32, seed=4)
    _, want_grad = value_and_grad(naive_token_logprobs, logits, index, grad_out)
    hidden = logits.clone().requires_grad_(True)
    produced = hidden * 1.0  # a non-leaf whose values are not needed by its own backward
    out = token_logprobs(produced, index, backend="chunked", inplace_backward=True)
    (out * grad_out).sum().backward()
    torch.testing.assert_close(hidden.grad, want_grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(produced.detach(), want_grad, atol=ATOL, rtol=0)  # storage reused


def test_errors_name_the_problem() -> None:
    logits = torch.randn(3, 10)
    with pytest.raises(LogprobError, match=r"expected \[0, 10\)"):
        token_logprobs(logits, torch.tensor([0, 10, 2]))
    with pytest.raises(LogprobError, match="index has shape"):
        token_logprobs(logits, torch.tensor([0, 1]))
    with pytest.raises(LogprobError, match="backend 'triton' needs a CUDA tensor"):
        token_logprobs(logits, torch.tensor([0, 1, 2]), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON_GPU, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_naive_at_qwen_vocab(dtype: torch.dtype) -> None:
    logits, index, grad_out = case(512, 151_936, dtype, device="cuda", seed=5, scale=8.0)
    grad_rtol = 0 if dtype == torch.float32 else 2**-8
    want, want_grad = value_and_grad(naive_token_logprobs, logits, index, grad_out)
    got, got_grad = value_and_grad(
        lambda x, i: token_logprobs(x, i, backend="triton"), logits, index, grad_out
    )
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=ATOL, rtol=grad_rtol)
    _, chunked_grad = value_and_grad(
        lambda x, i: token_logprobs(x, i, backend="chunked"), logits, index, grad_out
    )
    torch.testing.assert_close(chunked_grad.float(), want_grad.float(), atol=ATOL, rtol=grad_rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON_GPU, reason="needs CUDA and Triton")
def test_triton_inplace_and_odd_vocab() -> None:
    logits, index, grad_out = case(300, 50_001, torch.float32, device="cuda", seed=6)
    _, want_grad = value_and_grad(naive_token_logprobs, logits, index, grad_out)
    hidden = logits.clone().requires_grad_(True)
    produced = hidden * 1.0
    out = token_logprobs(produced, index, backend="triton", inplace_backward=True)
    (out * grad_out).sum().backward()
    torch.testing.assert_close(hidden.grad, want_grad, atol=ATOL, rtol=0)
