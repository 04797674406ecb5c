"""Full MOPD steps on two GPUs (issue 8): actor (megatron-core) on GPU 0; rollout (HF server) and teacher on GPU 1.

    python benchmarks/gpu_step.py                        # writes benchmarks/results/gpu_step.json
    python benchmarks/gpu_step.py --make-models DIR      # only write random Qwen3-1.7B-shape student/teacher
                                                         # checkpoints (+ a char tokenizer) for
                                                         # configs/qwen3_8gpu_colocated.yaml, then exit
                                                         # (benchmarks/gpu_models.py)

Each step runs the phases of DESIGN.md §3 with the real parts: ROLLOUT (POST /generate with log-probs: μ),
TEACHER (the teacher's HF SDPA scoring engine on GPU 1), TRAIN (MegatronTrainEngine.train_step with the MOPD
loss: truncate correction, token-mean), SYNC (TorchBroadcastSender over NCCL, GPU 0 → the server on GPU 1).
Reports seconds per phase per step and peak GPU memory per phase (actor's GPU). Weights are random, so the
numbers are about the machinery's cost, not learning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_models import SHAPES, make_checkpoint, make_models  # noqa: E402
from results_file import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


async def run(args: argparse.Namespace, tmp: Path) -> dict:
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.engines.megatron.build import build_from_hf
    from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
    from mopd_hpc.engines.megatron.parallel import initialize_parallel
    from mopd_hpc.engines.rollout.client import RolloutClient
    from mopd_hpc.engines.rollout.protocol import SamplingParams
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.engines.weight_sync.torch import TorchBroadcastSender
    from mopd_hpc.mopd.targets import TeacherTargets
    from mopd_hpc.runtime.http_auth import standalone_token

    shape = SHAPES[args.size]
    student, teacher_dir = tmp / "student", tmp / "teacher"
    make_checkpoint(shape, student, seed=0)
    make_checkpoint(shape, teacher_dir, seed=1)
    torch.cuda.empty_cache()
    ready = tmp / "ready.json"
    token, token_file = standalone_token(tmp / "token", None)  # the server requires it on every route
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "mopd_hpc.engines.rollout.hf_server", "--model", str(student), "--port",
         str(args.base_port), "--device", "cuda", "--dtype", "bfloat16", "--ready-file", str(ready),
         "--max-batch-rows", str(args.prompts * args.samples), "--token-file", str(token_file)],
        env=env,
    )  # fmt: skip
    try:
        device = initialize_parallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=args.base_port + 1,
                                     tensor_parallel=1, device_index=0)  # fmt: skip
        config = json.loads((student / "config.json").read_text())
        model, mshape = build_from_hf(student, config, "bfloat16", device)
        loss = LossConfig()
        actor = MegatronTrainEngine(model, mshape, config, loss, OptimizerConfig(lr=1e-6), device, "bfloat16")
        teacher = TorchScoringEngine.from_pretrained(
            teacher_dir, dtype="bfloat16", device="cuda:1", max_batch_rows=16
        )
        while not ready.exists():
            if server.poll() is not None:
                raise RuntimeError(f"rollout server exited with {server.returncode}")
            await asyncio.sleep(0.5)
        url = json.loads(ready.read_text())["url"]
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.samples, ignore_eos=True
        )
        g = torch.Generator().manual_seed(0)
        steps = []
        async with RolloutClient(url, token=token) as client:
            sender = TorchBroadcastSender("127.0.0.1", args.base_port + 2, 2, backend="nccl", device="cuda:0")
            await sender.init_group([client])
            for step in range(args.steps):
                phases, mem = {}, {}
                prompts = [
                    torch.randint(0, shape["vocab_size"], (args.prompt_len,), generator=g).tolist()
                    for _ in range(args.prompts)
                ]

                def mark(name: str, t0: float, phases: dict = phases, mem: dict = mem) -> None:
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)
                    phases[name] = round(time.perf_counter() - t0, 3)
                    mem[name] = round(torch.cuda.max_memory_allocated(0) / 2**30, 2)
                    torch.cuda.reset_peak_memory_stats(0)

                t0 = time.perf_counter()
                samples = await client.generate(prompts, sampling, return_logprob=True)
                mark("rollout", t0)
                t0 = time.perf_counter()
                tokens = TokenBatch.from_samples(
                    [s.prompt_ids for s in samples], [s.output_ids for s in samples], pad_id=0
                )
                behavior = tokens.pad_response_values([s.behavior_logprobs for s in samples])
                with torch.cuda.device(1):  # Triton kernels launch on the current device
                    teacher_lp = teacher.logprobs(tokens)
                targets = TeacherTargets(teacher_lp, torch.ones_like(teacher_lp))
                mark("teacher", t0)
                t0 = time.perf_counter()
                stats = actor.train_step(TrainBatch.create(tokens, behavior, targets=targets))
                mark("train", t0)
                t0 = time.perf_counter()
                await sender.send(
                    [(n, t) for n, t in actor.named_weights() if n != "lm_head.weight"], [client]
                )
                mark("sync", t0)
                row = {"step": step, "seconds": phases, "peak_gib_gpu0": mem, "loss": stats["loss"],
                       "tokens": stats["tokens"], "total_s": round(sum(phases.values()), 3)}  # fmt: skip
                steps.append(row)
                print(json.dumps(row), flush=True)
            await sender.destroy([client])
        return {"size": args.size, "prompts": args.prompts, "samples_per_prompt": args.samples,
                "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "steps": steps}  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-models", type=Path, default=None, help="write student/ and teacher/ here and exit")
    p.add_argument(
        "--size", default=None, choices=sorted(SHAPES), help="default: 1.7b for --make-models, else 0.6b"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--base-port", type=int, default=29640)
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_step.json")
    args = p.parse_args(argv)
    if args.make_models is not None:
        size = args.size or "1.7b"
        make_models(args.make_models, size)  # benchmarks/gpu_models.py
        print(f"wrote {args.make_models}/student and /teacher ({size} shape, random weights)")
        return 0
    args.size = args.size or "0.6b"
    if torch.cuda.device_count() < 2:
        print("gpu_step: needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    later = result["steps"][1:] or result["steps"]
    result["median_seconds"] = {
        k: statistics.median(s["seconds"][k] for s in later) for k in later[0]["seconds"]
    }
    print(f"\nmedian seconds per phase (steps after the first): {result['median_seconds']}")
    result |= {"benchmark": "gpu_step", "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
