"""Teacher scoring MFU (issue 8): forward-only, Qwen3 shapes of ~0.6B and ~1.7B, batch 4 × 4096 tokens, bf16.

    python benchmarks/scoring_mfu.py                 # GPU; writes benchmarks/results/scoring_mfu.json
    python benchmarks/scoring_mfu.py --sizes 0.6b --seq 1024 --repeats 3   # quicker

Paths: HF transformers (`attn_implementation="sdpa"`), and megatron-core GPTModel (world 1, TP 1) with the
local layer spec, unfused (megatron's DotProductAttention) and fused (our SDPACoreAttention,
mopd_hpc/engines/megatron/model.py). Weights are random (the FLOPs do not depend on them).

FLOPs of one forward (issue 8's definition, 2 per multiply-add):
    B·S·2·N_linear  +  L·B·2·S²·H·d
N_linear = every linear weight (q, k, v, o, gate, up, down per layer, and the lm_head); attention counts
QKᵀ and AV over S/2 keys on average (causal): 2·(2·S·(S/2)·H·d) per layer and sequence.
`mfu` = achieved FLOP/s / the bf16 matmul peak measured in the same run (8192³ bf16 matmuls).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_models import SHAPES  # noqa: E402  (Qwen3-0.6B / 1.7B shapes)
from results_file import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def cuda_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn() in ms, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def peak_bf16_tflops(n: int = 8192, repeats: int = 20) -> float:
    """Measured bf16 matmul throughput (TFLOP/s) on the current GPU: median of `repeats` n³ matmuls."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(lambda: torch.mm(a, b), repeats, warmup=5)
    return 2 * n**3 / (ms / 1e3) / 1e12


def forward_flops(shape: dict, batch: int, seq: int) -> float:
    """FLOPs of one forward pass (module docstring)."""
    h, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hq = shape["num_attention_heads"] * shape["head_dim"]
    hkv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * hq + 2 * h * hkv + hq * h + 3 * h * f
    n_linear = L * per_layer + shape["vocab_size"] * h
    return batch * seq * 2 * n_linear + L * batch * 2 * seq * seq * hq


def hf_forward(shape: dict, batch: int, seq: int) -> Callable[[], object]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**shape, max_position_embeddings=max(seq, 4096), attn_implementation="sdpa")
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device="cuda")

    @torch.inference_mode()
    def run() -> object:
        return model(input_ids=ids, use_cache=False).logits

    return run


def init_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def megatron_forward(shape: dict, batch: int, seq: int, fused: bool) -> Callable[[], object]:
    from mopd_hpc.engines.megatron.convert import Qwen3Shape
    from mopd_hpc.engines.megatron.model import build_gpt_model

    init_megatron()
    s = Qwen3Shape.from_hf_config(shape)
    model = build_gpt_model(s, "bfloat16", 1, max_sequence_length=max(seq, 4096), fused_attention=fused)
    model = model.cuda().eval()
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(batch, seq)

    @torch.inference_mode()
    def run() -> object:
        if fused:
            return model(ids, pos, None)
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda").triu(1)  # True = masked
        return model(ids, pos, mask)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.6b,1.7b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--paths", default="hf_sdpa,megatron_sdpa,megatron_local")
    p.add_argument("--out", type=Path, default=RESULTS / "scoring_mfu.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scoring_mfu: needs a CUDA GPU", file=sys.stderr)
        return 2
    peak = peak_bf16_tflops()
    print(f"measured bf16 matmul peak: {peak:.1f} TFLOP/s on {torch.cuda.get_device_name()}")
    rows = []
    for size in args.sizes.split(","):
        shape = SHAPES[size]
        flops = forward_flops(shape, args.batch, args.seq)
        for path in args.paths.split(","):
            started = time.perf_counter()
            try:
                if path == "hf_sdpa":
                    fn = hf_forward(shape, args.batch, args.seq)
                else:
                    fn = megatron_forward(shape, args.batch, args.seq, fused=path == "megatron_sdpa")
                ms = cuda_ms(fn, args.repeats)
                tflops = flops / (ms / 1e3) / 1e12
                row = {"size": size, "path": path, "ms": round(ms, 2), "tflops": round(tflops, 1),
                       "mfu": round(tflops / peak, 4), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - report the failure in the table, keep measuring
                row = {"size": size, "path": path, "error": f"{type(exc).__name__}: {exc}"[:300]}
            row["setup_s"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            fn = None  # noqa: F841
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(f"\n{'size':6} {'path':16} {'ms':>9} {'TFLOP/s':>8} {'MFU':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:6} {r['path']:16} error: {r['error'][:80]}")
        else:
            print(f"{r['size']:6} {r['path']:16} {r['ms']:9.1f} {r['tflops']:8.1f} {r['mfu']:6.1%}")
    result = {"benchmark": "scoring_mfu", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "peak_bf16_tflops": round(peak, 1), "batch": args.batch, "seq": args.seq, "rows": rows}  # fmt: skip
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
