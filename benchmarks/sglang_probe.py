"""SGLang on one GPU, without the roles: does it start, generate, return μ, release and resume, take weights?

    python benchmarks/sglang_probe.py --out DIR [--size 0.6b] [--rows 8] [--new-tokens 32]

One in-process `sglang.Engine` over a random-weight Qwen3 checkpoint (`benchmarks/gpu_models.py`, seed 0),
`skip_tokenizer_init` (the trainer sends token ids). Stages, each timed and recorded in DIR/sglang_probe.json
as soon as it ends (a later failure keeps what ran):

  start      Engine(...) with the memory saver; on failure, again without it (the error is kept)
  generate   `rows` prompts of 16 random ids, `new_tokens` each, at T = 1.0 / 0.7 / greedy, with log-probs
  mu         SGLang's output log-probs against a direct bf16 HF forward of the same checkpoint over
             prompt + response: log_softmax(logits / T) at the sampled ids (max and mean |Δ| in nats), and
             against T = 1 log-probs (which of the two SGLang returns)
  release    free GPU memory (torch.cuda.mem_get_info, GiB) before the engine, with it, after
             release_memory_occupation(weights, kv_cache, cuda_graph), after resume
  update     update_weights_from_tensor with the seed-1 checkpoint's tensors (CUDA IPC); seconds; then greedy
             μ against the seed-1 model (the update took)

Needs a GPU, sglang (0.5.17 ran here first), transformers. Prints a table; exit 0 when every stage ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import SHAPES, make_checkpoint  # noqa: E402

TAGS = ["weights", "kv_cache", "cuda_graph"]


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30


def direct_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of a bf16 HF forward over prompt + output, at each output id (T = 0 → 1)."""
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0].tolist()


def diff(a: list[float], b: list[float]) -> dict:
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"max": max(d), "mean": sum(d) / len(d)}


class Probe:
    def __init__(self, out: Path) -> None:
        self.out, self.result = out, {"stages": {}}
        out.mkdir(parents=True, exist_ok=True)

    def record(self, stage: str, **fields) -> None:
        self.result["stages"][stage] = fields
        path = self.out / "sglang_probe.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(path.with_suffix(".tmp"), path)
        print(f"[{stage}] {json.dumps(fields, default=str)[:600]}", flush=True)


def start_engine(probe: Probe, model_dir: Path, args):
    import sglang

    base = dict(
        model_path=str(model_dir),
        skip_tokenizer_init=True,
        attention_backend=args.attention_backend,
        sampling_backend="pytorch",
        mem_fraction_static=args.mem_fraction,
        cuda_graph_max_bs_decode=args.rows * 2,
        disable_prefill_cuda_graph=True,
        random_seed=0,
        dtype="bfloat16",
        log_level="warning",
    )
    errors = []
    for saver in (True, False):
        t0 = time.perf_counter()
        try:
            engine = sglang.Engine(**base, enable_memory_saver=saver)
        except Exception as exc:  # noqa: BLE001 - recorded, then the next setting
            errors.append({"enable_memory_saver": saver, "error": repr(exc)[-2000:]})
            continue
        probe.record(
            "start",
            seconds=round(time.perf_counter() - t0, 2),
            enable_memory_saver=saver,
            sglang=sglang.__version__,
            kwargs=base,
            errors=errors,
        )
        return engine, saver
    probe.record("start", ok=False, errors=errors)
    return None, False


def generate(engine, prompts, temperature: float, new_tokens: int) -> tuple[list, float]:
    params = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}
    t0 = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return out, time.perf_counter() - t0


def mu_check(model, prompts, outs, temperature: float) -> dict:
    scaled, unscaled = [], []
    for prompt, item in zip(prompts, outs, strict=True):
        ids = [int(t) for t in item["output_ids"]]
        got = [float(t[0]) for t in item["meta_info"]["output_token_logprobs"]]
        scaled.append(diff(got, direct_logprobs(model, prompt, ids, temperature)))
        unscaled.append(diff(got, direct_logprobs(model, prompt, ids, 1.0)))
    return {
        "vs_T_scaled": {
            "max": max(d["max"] for d in scaled),
            "mean": sum(d["mean"] for d in scaled) / len(scaled),
        },
        "vs_T1": {
            "max": max(d["max"] for d in unscaled),
            "mean": sum(d["mean"] for d in unscaled) / len(unscaled),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mem-fraction", type=float, default=0.35)
    ap.add_argument("--attention-backend", default="triton")
    args = ap.parse_args(argv)
    probe = Probe(args.out)
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="sglang_probe_"))
    t0 = time.perf_counter()
    make_checkpoint(SHAPES[args.size], work / "student", seed=0)
    make_checkpoint(SHAPES[args.size], work / "other", seed=1)
    torch.cuda.empty_cache()
    probe.record("models", seconds=round(time.perf_counter() - t0, 2), size=args.size, free_gib=free_gib())
    free_before = free_gib()
    engine, saver = start_engine(probe, work / "student", args)
    if engine is None:
        return 1
    ok = True
    try:
        g = torch.Generator().manual_seed(0)
        vocab = SHAPES[args.size]["vocab_size"]
        prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(args.rows)]
        model = AutoModelForCausalLM.from_pretrained(work / "student", dtype=torch.bfloat16).cuda().eval()
        gens = {}
        for temperature in (1.0, 0.7, 0.0):
            outs, seconds = generate(engine, prompts, temperature, args.new_tokens)
            gens[temperature] = outs
            lens = [len(o["output_ids"]) for o in outs]
            probe.record(
                f"generate_T{temperature}",
                seconds=round(seconds, 3),
                tokens=sum(lens),
                meta_keys=sorted(outs[0]["meta_info"]),
                first_logprob_entry=outs[0]["meta_info"]["output_token_logprobs"][0],
                finish_reason=outs[0]["meta_info"].get("finish_reason"),
                weight_version=outs[0]["meta_info"].get("weight_version"),
            )
            probe.record(f"mu_T{temperature}", **mu_check(model, prompts, outs, temperature))
        with_engine = free_gib()
        if saver:
            t0 = time.perf_counter()
            engine.release_memory_occupation(tags=TAGS)
            released, release_s = free_gib(), time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.resume_memory_occupation(tags=TAGS)
            resumed, resume_s = free_gib(), time.perf_counter() - t0
            outs, _ = generate(engine, prompts, 0.0, args.new_tokens)
            same = [o["output_ids"] for o in outs] == [o["output_ids"] for o in gens[0.0]]
            after_resume = mu_check(model, prompts, outs, 0.0)
            probe.record(
                "release",
                free_gib_before_engine=free_before,
                free_gib_with_engine=with_engine,
                free_gib_released=released,
                free_gib_resumed=resumed,
                release_s=round(release_s, 3),
                resume_s=round(resume_s, 3),
                greedy_equal_after_resume=same,
                mu_after_resume=after_resume,
            )
        other = AutoModelForCausalLM.from_pretrained(work / "other", dtype=torch.bfloat16).cuda().eval()
        named = [(n, p.detach()) for n, p in other.named_parameters()]
        update_s = []
        for _ in range(3):  # the first pays the IPC set-up; the later ones are a sync's steady cost
            t0 = time.perf_counter()
            answer = engine.update_weights_from_tensor(named_tensors=named)
            update_s.append(round(time.perf_counter() - t0, 3))
        outs, _ = generate(engine, prompts, 0.0, args.new_tokens)
        probe.record(
            "update",
            seconds=update_s,
            answer=answer,
            tensors=len(named),
            bytes=sum(t.numel() * t.element_size() for _, t in named),
            mu_vs_new=mu_check(other, prompts, outs, 0.0),
            mu_vs_old=mu_check(model, prompts, outs, 0.0),
        )
    except Exception:  # noqa: BLE001 - the probe records what failed and where
        ok = False
        probe.record("error", traceback=traceback.format_exc()[-4000:])
    finally:
        t0 = time.perf_counter()
        engine.shutdown()
        probe.record("shutdown", seconds=round(time.perf_counter() - t0, 2))
    for stage, fields in probe.result["stages"].items():
        print(f"{stage:18s} {json.dumps(fields, default=str)[:160]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
