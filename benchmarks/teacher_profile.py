"""Where the teacher phase's time goes (issue 35 item 3): the megatron scoring engine of the shipped config,
the sampled estimator (log-probs of the sampled tokens, no top-k), on one GPU, in one process.

    python benchmarks/teacher_profile.py --size 0.6b --rows 128 --new-tokens 128 --out $OUT/teacher_profile.json

The teacher role's parts, built as the job builds them: `teacher_serve.build_engine` (megatron, TP 1, bf16,
`max_batch_rows` from `roles/teacher.scoring_rows`' rule for the shape), a real `TeacherServer` served on
loopback, and the controller's `TeacherClient.score_tensors` (binary frames both ways). The rows are random
token ids of the step's shape (`--prompt-tokens` + `--new-tokens` each; 12 is the chain_sum prompts' mean).
Timed, each the median of `--repeats` after 2 warm-ups (seconds, CUDA synchronized):

    round_trip     client encode → HTTP → server decode → score → pack → HTTP → client decode (the phase's
                   work for one teacher, without the controller's aggregation)
    server_score   `TeacherServer._score`: the engine's score, the packed answer's one device→host copy,
                   the allocator's cache given back (`torch.cuda.empty_cache`, as the server does on CUDA)
    engine_score   `engine.score(batch, None, host=False)` alone (chunks of max_batch_rows rows)
    engine_score_after_empty_cache   the same after `torch.cuda.empty_cache()`: what giving the cache back
                   costs the next step's allocations

beside the phase's floor (`step_floors.phase_floors`: 2 · matmul params · tokens at the bf16 matmul peak
measured here). Then `torch.profiler` (CPU and CUDA) over 3 round trips: the key-averages tables, sorted by
self device time, device time and CPU time, written next to `--out` as a .txt file. Writes `--out` (JSON).
`--engine torch --device cpu --model DIR` runs the same glue on a CPU (tests/plan/test_gpu_step_floors.py), no floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_models import ensure_models  # noqa: E402
from results_file import commit_of, write_results  # noqa: E402
from step_floors import Device, ModelShape, StepTokens, phase_floors  # noqa: E402

TOKEN = "teacher-profile-token"
SCORING_BUDGET_BYTES = 4 << 30  # roles/teacher.py's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="0.6b", choices=("0.6b", "1.7b"))
    p.add_argument("--rows", type=int, default=128, help="prompts × samples of the step")
    p.add_argument("--prompt-tokens", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=64, help="data.max_prompt_tokens (chunk rule)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models-root", type=Path, default=REPO / ".cache" / "models")
    p.add_argument("--model", type=Path, default=None, help="a teacher checkpoint (default: the size's)")
    p.add_argument(
        "--engine", default="megatron", choices=("megatron", "torch"), help="torch: CPU glue check"
    )
    p.add_argument(
        "--device", default="cuda", help="cuda (the benchmark) or cpu (the glue, with --engine torch)"
    )
    p.add_argument("--commit", default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "teacher_profile.json")
    return p.parse_args(argv)


def chunk_rows(rows: int, tokens: int, vocab: int) -> int:
    """roles/teacher.py `scoring_rows`: all rows (at least 64) unless their float32 logits exceed 4 GiB."""
    return max(1, min(max(64, rows), SCORING_BUDGET_BYTES // (tokens * vocab * 4)))


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def timed(call: Callable[[], Awaitable[Any]], repeats: int, device: str) -> list[float]:
    for _ in range(2):
        await call()
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        await call()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


async def measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The timings, the answer's agreement with the engine, and the profiler's tables (module docstring)."""
    import torch

    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.serving import start_app
    from mopd_hpc.engines.teacher.client import TeacherClient
    from mopd_hpc.engines.teacher.http_app import TeacherServer
    from mopd_hpc.engines.teacher.process import TeacherArgs, build_engine
    from mopd_hpc.runtime.http_auth import protect

    teacher, cuda = str(model), args.device.startswith("cuda")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = chunk_rows(args.rows, args.max_prompt_tokens + args.new_tokens, vocab)
    engine = build_engine(
        TeacherArgs("teacher", teacher, "127.0.0.1", 0, "127.0.0.1", device=args.device,
                    dtype="bfloat16" if cuda else "float32", max_batch_rows=rows, engine=args.engine)
    )  # fmt: skip
    server = TeacherServer(engine, "teacher", teacher)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.rows, args.prompt_tokens + args.new_tokens), generator=g).tolist()
    starts = [args.prompt_tokens] * args.rows
    batch = TokenBatch.from_rows(ids, starts, 0)
    runner, port, _ = await start_app(protect(server.app(), TOKEN), "127.0.0.1", 0)
    try:
        async with TeacherClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:

            async def round_trip() -> Any:
                return await client.score_tensors(ids, starts, None)

            async def server_score() -> Any:
                return await asyncio.to_thread(server._score, batch, None)

            async def engine_score() -> Any:
                return engine.score(batch, None, host=False)

            async def after_empty_cache() -> Any:
                if cuda:
                    torch.cuda.empty_cache()
                sync(args.device)
                t0 = time.perf_counter()
                out = engine.score(batch, None, host=False)
                sync(args.device)
                after_empty_cache.seconds.append(time.perf_counter() - t0)  # type: ignore[attr-defined]
                return out

            after_empty_cache.seconds = []  # type: ignore[attr-defined]
            seconds = {
                "round_trip": await timed(round_trip, args.repeats, args.device),
                "server_score": await timed(server_score, args.repeats, args.device),
                "engine_score": await timed(engine_score, args.repeats, args.device),
            }
            await timed(after_empty_cache, args.repeats, args.device)
            seconds["engine_score_after_empty_cache"] = after_empty_cache.seconds[2:]  # type: ignore[attr-defined]
            answer = await round_trip()
            reference = engine.score(batch, None)[0]
            lengths = batch.response_lengths.tolist()
            packed = torch.cat([reference[b, :n] for b, n in enumerate(lengths)])
            agree = float((answer.logprobs - packed).abs().max())
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
            with profile(activities=activities) as prof:
                for _ in range(3):
                    await round_trip()
                sync(args.device)
    finally:
        await runner.cleanup()
    tables = {
        key: prof.key_averages().table(sort_by=key, row_limit=40)
        for key in ("self_device_time_total", "device_time_total", "cpu_time_total")
    }
    return {"max_batch_rows": rows, "seconds": seconds, "answer_vs_engine_max_abs": agree, "tables": tables}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(
            "teacher_profile: needs a CUDA GPU (or --engine torch --device cpu: the glue only)",
            file=sys.stderr,
        )
        return 2
    model = (
        args.model
        or ensure_models(
            args.models_root / f"gpu_step_roles_{args.size.replace('.', '_')}", args.size, timeout_s=None
        )
        / "teacher"
    )
    got = asyncio.run(measure(args, model))
    medians = {k: round(statistics.median(v), 5) for k, v in got["seconds"].items()}
    floor = None
    if cuda:
        from scoring_mfu import peak_bf16_tflops
        from weight_sync import copy_gbps

        device = Device(hbm_gbps=2 * copy_gbps(1 << 30), peak_tflops=peak_bf16_tflops())
        shape = ModelShape.from_hf_config(json.loads((model / "config.json").read_text()))
        tokens = StepTokens(
            args.rows, 1, args.new_tokens, args.rows * args.prompt_tokens, args.rows * args.new_tokens
        )
        floor = phase_floors(shape, shape, tokens, device)["teacher"]
    text_path = args.out.with_suffix(".txt")
    text_path.parent.mkdir(parents=True, exist_ok=True)
    text_path.write_text("\n\n".join(f"sorted by {k}\n{t}" for k, t in got["tables"].items()))
    result = {
        "benchmark": "teacher_profile", "commit": commit_of(args.commit), "engine": args.engine,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "size": args.size if args.model is None else str(args.model), "rows": args.rows,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "max_batch_rows": got["max_batch_rows"],
        "teacher_floor_s": None if floor is None else round(floor, 6),
        "seconds_median": medians, "seconds": {k: [round(x, 5) for x in v] for k, v in got["seconds"].items()},
        "floor_ratio": None if floor is None else {k: round(v / floor, 2) for k, v in medians.items()},
        "answer_vs_engine_max_abs": got["answer_vs_engine_max_abs"], "profile_tables": text_path.name,
    }  # fmt: skip
    if cuda:
        result |= {"hbm_gbps": round(device.hbm_gbps, 1), "peak_bf16_tflops": round(device.peak_tflops, 1)}
    write_results(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    print(next(iter(got["tables"].values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
