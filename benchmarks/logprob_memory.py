"""Peak extra memory and time of token log-probs: naive vs chunked vs fused Triton.

    python benchmarks/logprob_memory.py                  # GPU: T = 32,768, V = 151,936, bf16 logits
    python benchmarks/logprob_memory.py --small          # CPU (or GPU) at small sizes
    python benchmarks/logprob_memory.py --tune           # also sweep the Triton block/warps

Forward and forward + backward are measured separately. "Peak extra" is the peak of allocated device
memory during the call minus what was allocated before it (logits, index, upstream gradient); the
gradient w.r.t. the logits (an [N, V] tensor in the logits' dtype) counts, except for the in-place
variant that writes it into the logits' storage. The device-to-device copy bandwidth is measured in the
same run and gives the floor: forward reads the logits once, forward + backward reads them twice and
writes the gradient once. Prints a table; writes JSON (default benchmarks/results/logprob_memory.json
on GPU, logprob_memory_small_cpu.json with --small on CPU). CPU runs report time only (no allocator
statistics there).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mopd_hpc.atomic import atomic_write_json  # noqa: E402
from mopd_hpc.mopd.logprobs import naive_token_logprobs, token_logprobs, triton_available  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9


class Timer:
    """Wall time per call in ms: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def peak_extra_gb(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / GB


def copy_bandwidth_gbps(device: torch.device, timer: Timer, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), repeats=10)
    return 2 * nbytes / (ms / 1e3) / GB


def methods(on_gpu: bool) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "naive": naive_token_logprobs,
        "chunked": lambda x, i: token_logprobs(x, i, backend="chunked"),
    }
    if on_gpu and triton_available():
        out["triton"] = lambda x, i: token_logprobs(x, i, backend="triton")
        out["triton_inplace"] = lambda x, i: token_logprobs(x, i, backend="triton", inplace_backward=True)
    return out


def tune(logits: torch.Tensor, index: torch.Tensor, timer: Timer, repeats: int) -> list[dict[str, object]]:
    from mopd_hpc.mopd import logprobs_triton as kt

    rows = []
    _, lse = kt.logprob_forward(logits, index)
    grad_out = torch.ones(logits.shape[0], device=logits.device)
    grad = torch.empty_like(logits)
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16, 32):
            try:
                fwd = timer(
                    lambda b=block, w=warps: kt.logprob_forward(logits, index, block=b, num_warps=w), repeats
                )
                bwd = timer(
                    lambda b=block, w=warps: kt.logprob_backward(
                        logits, index, lse, grad_out, grad, block=b, num_warps=w
                    ),
                    repeats,
                )
            except Exception as exc:  # a config the compiler rejects (too many registers, …)
                rows.append({"block": block, "num_warps": warps, "error": type(exc).__name__})
                continue
            rows.append({"block": block, "num_warps": warps, "forward_ms": fwd, "backward_ms": bwd})
            print(f"tune block={block:6d} warps={warps:2d} fwd {fwd:7.3f} ms  bwd {bwd:7.3f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="T = 512, V = 32,768 (runs on CPU)")
    parser.add_argument("--tokens", type=int, default=None, help="T, tokens (rows of logits)")
    parser.add_argument("--vocab", type=int, default=151_936, help="V, vocabulary size")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--tune", action="store_true", help="sweep the Triton block size and warps")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    tokens = args.tokens or (512 if args.small else 32_768)
    vocab = 32_768 if args.small and args.vocab == 151_936 else args.vocab
    if not on_gpu and not args.small and args.tokens is None:
        parser.error("no CUDA device: use --small (or --tokens) on CPU")
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (8 * torch.randn(tokens, vocab, generator=gen, device=device)).to(torch.bfloat16)
    index = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    grad_out = torch.randn(tokens, generator=gen, device=device)
    logits_gb = logits.numel() * logits.element_size() / GB

    bandwidth = copy_bandwidth_gbps(device, timer, nbytes=min(4 * 2**30, int(logits_gb * GB)))
    floor_ms = {"forward": logits_gb / bandwidth * 1e3, "forward+backward": 3 * logits_gb / bandwidth * 1e3}
    print(
        f"device {torch.cuda.get_device_name() if on_gpu else platform.processor() or 'cpu'}; "
        f"T={tokens} V={vocab} bf16 logits {logits_gb:.2f} GB; copy bandwidth {bandwidth:.0f} GB/s",
        flush=True,
    )

    check_rows = slice(0, min(tokens, 1024))
    reference = naive_token_logprobs(logits[check_rows], index[check_rows])

    def slice_grad(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = logits[check_rows].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(fn(x * 1, index[check_rows]), x, grad_out[check_rows])
        return grad.float()

    reference_grad = slice_grad(naive_token_logprobs)
    results = []
    for name, fn in methods(on_gpu).items():
        x = logits.detach().requires_grad_(True)
        err = (fn(logits[check_rows], index[check_rows]) - reference).abs().max().item()
        grad_err = (slice_grad(fn) - reference_grad).abs().max().item()

        def forward(fn=fn) -> torch.Tensor:
            with torch.no_grad():
                return fn(logits, index)

        def forward_backward(fn=fn, x=x) -> torch.Tensor:
            (grad,) = torch.autograd.grad(fn(x, index), x, grad_out)
            return grad

        for mode, call in (("forward", forward), ("forward+backward", forward_backward)):
            if name == "triton_inplace" and mode == "forward":
                continue  # identical to triton
            mem = peak_extra_gb(call, device)
            ms = timer(call, repeats=args.repeats)
            results.append(
                {
                    "method": name,
                    "mode": mode,
                    "time_ms": ms,
                    "peak_extra_GB": mem,
                    "max_abs_err": err,
                    "max_abs_grad_err": grad_err,
                }
            )
            print(
                f"{name:15s} {mode:17s} {ms:9.3f} ms  peak extra "
                f"{'n/a' if mem is None else f'{mem:8.3f} GB'}  max|err| {err:.2e}",
                flush=True,
            )
        del x

    tuning = (
        tune(logits, index, timer, repeats=args.repeats) if args.tune and "triton" in methods(on_gpu) else []
    )
    by = {(r["method"], r["mode"]): r for r in results}
    goal = {}
    for method, mode in (
        ("triton", "forward"),
        ("triton_inplace", "forward+backward"),
        ("triton", "forward+backward"),
    ):
        if (method, mode) in by and on_gpu:
            naive, mine = by[("naive", mode)], by[(method, mode)]
            goal[f"{method} {mode}"] = {
                "peak_fraction_of_naive": mine["peak_extra_GB"] / naive["peak_extra_GB"],
                "speedup_over_naive": naive["time_ms"] / mine["time_ms"],
                "times_floor": mine["time_ms"] / floor_ms[mode],
            }
    report = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "triton_available": triton_available(),
        "tokens": tokens,
        "vocab": vocab,
        "logits_dtype": "bfloat16",
        "logits_GB": logits_gb,
        "copy_bandwidth_GBps": bandwidth,
        "floor_ms": floor_ms,
        "results": results,
        "goal": goal,
        "tune": tuning,
    }
    print(
        "\n| method | mode | time ms | x floor | peak extra GB | max abs err | max abs grad err |\n|---|---|---|---|---|---|---|"
    )
    for r in results:
        mem = "n/a" if r["peak_extra_GB"] is None else f"{r['peak_extra_GB']:.3f}"
        print(
            f"| {r['method']} | {r['mode']} | {r['time_ms']:.3f} | {r['time_ms'] / floor_ms[r['mode']]:.1f} "
            f"| {mem} | {r['max_abs_err']:.1e} | {r['max_abs_grad_err']:.1e} |"
        )
    for key, g in goal.items():
        print(
            f"goal {key}: peak {g['peak_fraction_of_naive']:.4f} of naive (<= 1/16 = 0.0625), "
            f"{g['speedup_over_naive']:.1f}x faster than naive, {g['times_floor']:.2f}x the floor"
        )
    out = args.out or RESULTS / (
        "logprob_memory.json" if on_gpu and not args.small else f"logprob_memory_small_{device.type}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
