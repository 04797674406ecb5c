"""HF rollout decoding (issue 22): the loop decoder vs the static one (vs the static one with a compiled decode
forward), on a random-weight Qwen3 shape, through `HFRolloutEngine.generate` as the rollout server runs it.

    python benchmarks/hf_decode.py --size 0.6b --runs 128x128,256x1024          # GPU (bf16); writes
                                                                              # benchmarks/results/hf_decode.json
    python benchmarks/hf_decode.py --size decode-tiny --device cpu --runs 8x16,16x32   # a CPU check

The shapes and the checkpoint are `benchmarks/gpu_models.py`'s (SHAPES; make_checkpoint, seed 0, in the run's
dtype). Each run is ROWS×NEW: ROWS rows of random prompts of --prompt-len tokens, temperature 1, distinct
seeds, ignore_eos (every row decodes NEW tokens). Each decoder first decodes the same batch for 8 steps (then
aborted: a warm-up of the same shapes, so a compiled forward is captured before the timing); a compiled
decoder decodes it whole, so that the graph of every attention span is compiled and captured before.

Decoders: loop, static (eager, attending over the written slots), compiled (the static decoder's step in CUDA
graphs attending over `--spans` spans of the cache, `graph_shape.attention_span`, issue 35) and
compiled_full (the same over all cache slots at every step: the compiled step before issue 35).

`--profile STEPS` also runs each decoder under torch.profiler for STEPS decoding steps of the last run's batch
(after its timing) and records, per decoder, the wall time, the time the device was busy in kernels (CUDA;
`busy_fraction` = kernel time / wall time: far below 1 means the step waits on the host, launches or syncs)
and the top ops by self time on the device (CUDA) or on the host (CPU): where a decode step's time goes.

The decode floor is the time to read, once per step, the weights and the KV cache of the real tokens from
device memory:
    floor = Σ_t (weight bytes + ROWS·(P + t)·kv bytes per token) / bandwidth,   t = 0 .. NEW−1
kv bytes per token = layers · 2 · kv_heads · head_dim · dtype bytes; the bandwidth is measured in the same run
(the best of a few copies of a 1/4 GiB (CPU) or 4 GiB (GPU) buffer: 2 · bytes / seconds). `x_floor` is the
measured time over the floor (1 = at the floor). The prefill is inside the measured time and not in the floor.
A compiled decoder's entry records its attention spans and the peak GiB reserved on the device while it ran
(`peak_reserved_gib`: with the graph pools of every span). Each run records the model's attention implementation (`attention`: the static decoders switch an SDPA model
to `engines/rollout/grouped_attention.py`; the engines share one model, so every row of a run shows it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_models import SHAPES, make_checkpoint  # noqa: E402  (one home for the random Qwen3 checkpoints)
from results_file import write_results  # noqa: E402

from mopd_hpc.engines.rollout.graph_shape import SPANS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class OpenGate:
    """Lets every step run (or the first `steps` only: a warm-up of the measured shapes)."""

    def __init__(self, steps: int | None = None) -> None:
        self.left = steps

    def between_steps(self) -> bool:
        if self.left is None:
            return True
        self.left -= 1
        return self.left >= 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device copy (read + write), the best of 5."""
    n = (4 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n / best


def floor_seconds(engine, rows: int, prompt_len: int, new: int, bw: float) -> float:
    cfg = engine.model.config
    weight = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # tied weights once
    per_tok = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * engine.dtype.itemsize
    kv = rows * per_tok * (new * prompt_len + new * (new - 1) / 2)
    return (new * weight + kv) / bw


def requests(rows: int, prompt_len: int, new: int, vocab: int):
    from mopd_hpc.engines.rollout.protocol import SamplingParams
    from mopd_hpc.engines.rollout.rows import RowRequest

    g = torch.Generator().manual_seed(rows * 7919 + new)
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)
    return [
        RowRequest(tuple(torch.randint(0, vocab, (prompt_len,), generator=g).tolist()), sampling, seed=i, return_logprob=True)
        for i in range(rows)
    ]  # fmt: skip


def time_decoder(engine, rows: int, prompt_len: int, new: int) -> tuple[float, int, float]:
    """(seconds, tokens, warm-up seconds) of one batch; the warm-up includes any compilation."""
    batch = requests(rows, prompt_len, new, engine.vocab_size)
    t0 = time.perf_counter()
    # warm-up: the same shapes (cache, masks), 8 steps then abort; compiled: every step (each span's graph)
    engine.generate(batch, OpenGate(steps=None if engine.compile_decode else 8))
    sync(engine.device)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = engine.generate(batch, OpenGate())
    sync(engine.device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in results)
    assert tokens == rows * new, (tokens, rows * new)
    return seconds, tokens, warm


def profile_decoder(engine, rows: int, prompt_len: int, new: int, steps: int, top: int = 12) -> dict:
    """One decode of `steps` steps (then aborted) under torch.profiler: {"steps", "wall_s", "kernel_s",
    "busy_fraction", "top": [{"op", "calls", "self_s"}, ...]} — self time on the device where there is one
    (kernel_s: the sum of every op's self device time), else on the host (kernel_s None)."""
    from torch.profiler import ProfilerActivity, profile

    batch = requests(rows, prompt_len, new, engine.vocab_size)
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    engine.generate(batch, OpenGate(steps=steps))  # the same shapes once outside the profiler
    sync(engine.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        engine.generate(batch, OpenGate(steps=steps))
        sync(engine.device)
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    self_us = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    ranked = sorted((e for e in averages if self_us(e) > 0), key=self_us, reverse=True)
    # "## Call CompiledFxGraph ..." ranges repeat their kernels' device time: counted once, through the kernels
    kernel = (
        sum(e.self_device_time_total for e in averages if not e.key.startswith("## ")) / 1e6 if cuda else None
    )
    return {
        "steps": steps,
        "wall_s": round(wall, 4),
        "kernel_s": None if kernel is None else round(kernel, 4),
        "busy_fraction": None if kernel is None else round(kernel / wall, 3),
        "top": [{"op": e.key, "calls": e.count, "self_s": round(self_us(e) / 1e6, 5)} for e in ranked[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="0.6b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--runs", default="128x128,256x1024", help="ROWSxNEW,... ")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument(
        "--decoders",
        default="loop,static,compiled",
        help="of loop, static, compiled, compiled_full (cuda only)",
    )
    p.add_argument("--spans", type=int, default=SPANS, help="the compiled decoder's attention spans")
    p.add_argument(
        "--max-loop-tokens",
        type=int,
        default=1 << 30,
        help="skip the loop decoder on runs of more ROWS×NEW tokens (it is the slow one)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--profile", type=int, default=0, help="profile STEPS decode steps per decoder (0: off)")
    p.add_argument("--out", type=Path, default=RESULTS / "hf_decode.json")
    args = p.parse_args(argv)  # fmt: skip
    from mopd_hpc.engines.rollout.hf_engine import DTYPES, HFRolloutEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    decoders = [d for d in args.decoders.split(",") if d]
    for compiled in ("compiled", "compiled_full"):
        if device.type != "cuda" and compiled in decoders:
            decoders.remove(compiled)
            print(f"hf_decode: {compiled} is CUDA-only; skipped")
    runs = [tuple(int(x) for x in r.split("x")) for r in args.runs.split(",")]
    bw = bandwidth(device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{args.size} {dtype_name}, copy bandwidth {bw / 1e9:.1f} GB/s")  # fmt: skip
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "model"
        make_checkpoint(SHAPES[args.size], ckpt, seed=0, dtype=DTYPES[dtype_name])
        first = HFRolloutEngine.load(str(ckpt), str(device), dtype_name, decoder="loop")
        engines = {  # one model, shared (the runs are sequential)
            d: HFRolloutEngine(
                first.model, str(ckpt), first.device, first.dtype,
                decoder="static" if d.startswith("compiled") else d, compile_decode=d.startswith("compiled"),
                attention_spans={"compiled": args.spans, "compiled_full": 1}.get(d),
            )
            for d in decoders
        }  # fmt: skip
        for rows, new in runs:
            floor = floor_seconds(next(iter(engines.values())), rows, args.prompt_len, new, bw)
            for d, engine in engines.items():
                if d == "loop" and rows * new > args.max_loop_tokens:
                    continue
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                seconds, tokens, warm = time_decoder(engine, rows, args.prompt_len, new)
                entry = {
                    "decoder": d, "rows": rows, "new_tokens": new, "prompt_len": args.prompt_len,
                    "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
                    "floor_s": round(floor, 5), "x_floor": round(seconds / floor, 2),
                    "warmup_s": round(warm, 3), "attention": engine.model.config._attn_implementation,
                }  # fmt: skip
                if engine.compile_decode:
                    entry["compiled_active"] = engine.compile_active
                    entry["attention_spans"] = engine.attention_spans
                    # the KV cache and the CUDA-graph pool (one graph per span) of this decoder, and any
                    # earlier decoder's still held by torch's caching allocator
                    entry["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
                table.append(entry)
                print(f"{d:>9} {rows:>5}x{new:<5} {seconds:9.3f} s {tokens / seconds:12.1f} tok/s "
                      f"floor {floor:8.4f} s  x{seconds / floor:8.1f}  (warm-up {warm:.1f} s, "
                      f"attention {entry['attention']})", flush=True)  # fmt: skip
        profiles = {}
        if args.profile and runs:
            rows, new = runs[-1]
            for d, engine in engines.items():
                profiles[d] = {
                    "rows": rows,
                    **profile_decoder(engine, rows, args.prompt_len, new, args.profile),
                }
                prof = profiles[d]
                busy = "" if prof["busy_fraction"] is None else f", device busy {prof['busy_fraction']:.0%}"
                print(f"profile {d} {rows}x{args.profile} steps: {prof['wall_s']:.3f} s{busy}")
                for op in prof["top"]:
                    print(f"    {op['self_s']:9.4f} s {op['calls']:>7}  {op['op'][:90]}")
    result = {
        "benchmark": "hf_decode",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": args.size,
        "dtype": dtype_name,
        "bandwidth_GBps": round(bw / 1e9, 1),
        "runs": table,
        "profiles": profiles,
    }
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
