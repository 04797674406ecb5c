"""The train/inference mismatch of a Qwen3-MoE student with and without rollout routing replay (issue 33 item 6).

    python benchmarks/moe_mismatch.py                                  # GPU, bf16: results/moe_mismatch.json
    python benchmarks/moe_mismatch.py --device cpu --dtype float32 --rows 4 --new-tokens 8   # a CPU check

A random Qwen3-MoE (`SHAPE`: 4 layers, 16 experts, top 4, vocabulary 8,192; routers drawn N(0, σ²) with
σ = --router-std, since transformers starts them at 0) is written once under a temporary directory. The
rollout engine (`HFRolloutEngine`, the loop decoder: the one that records routed experts) samples --rows
responses of --new-tokens tokens (temperature 1, ignore_eos) to random prompts of --prompt-len tokens, with
their log-probs log μ(y_t) and each token's routed experts per MoE layer. The actor (`TorchTrainEngine`, same
checkpoint, same dtype, same device) then computes log π_θ(y_t) of the same rows with the same weights:

- `no_replay`: its routers choose (the path of `rollout.routing_replay: false`);
- `replay`: the forward routes each response token to the experts the rollout chose (R3, `rollout.routing_replay:
  true`; engines/moe_routing.py);
- `megatron_no_replay` (GPU, megatron-core installed): the megatron scoring forward of the same checkpoint
  (the megatron actor's forward; it has no replay).

Per row of the result, over the response tokens: `logprob_mismatch` = mean |log π_θ − log μ| (the metric
`mopd/logprob_mismatch`), its max and 99th percentile, and the capped-ratio fraction = share of tokens whose
importance ratio r_t = π_θ/μ exceeds C (the `truncate` correction's `mopd/ratio_capped_frac`, `mopd/loss.py
importance_weights`) for C in CAPS (5.0 is the config default; 1.1 and 2.0 show where the mismatch sits), and
the share outside IcePop's [0.5, 2] (`mask`). With the same weights on both sides every difference is the
rounding of two kernels (a decode step over a KV cache vs one full forward) and the routing flips it causes.

Writes --out (default benchmarks/results/moe_mismatch.json) and, when the OUT environment variable is set (the
device machine's output folder), the same file under it. Runtime on an H100: ~40 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import commit_of, write_results  # noqa: E402

from mopd_hpc.config.loss import LossConfig  # noqa: E402
from mopd_hpc.config.models import OptimizerConfig  # noqa: E402
from mopd_hpc.engines.batch import TokenBatch, TrainBatch  # noqa: E402
from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from mopd_hpc.engines.rollout.protocol import SamplingParams  # noqa: E402
from mopd_hpc.engines.rollout.rows import RowRequest  # noqa: E402
from mopd_hpc.engines.torch.engine import TorchTrainEngine  # noqa: E402
from mopd_hpc.mopd.loss import importance_weights  # noqa: E402
from mopd_hpc.mopd.targets import aggregate_teacher_targets  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: The Qwen3-MoE shape (transformers Qwen3MoeConfig fields): ~40M parameters, 16 experts, 4 routed per token.
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
             num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096)  # fmt: skip
CAPS = (1.1, 2.0, 5.0)


class _Always:
    def between_steps(self) -> bool:
        return True


def make_moe(path: Path, router_std: float, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """SHAPE with random weights (float32 init under `seed`, routers N(0, router_std²)), saved at `path` in
    `dtype`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, router_std)
    model.to(dtype).save_pretrained(str(path))
    return path


def stats(lp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The mismatch figures of log π_θ `lp` against log μ `mu` ([B, T] float32) over `mask` (module docstring)."""
    log_ratio = torch.where(mask, lp - mu, torch.zeros_like(lp))
    diff = log_ratio.abs()[mask].double()
    out: dict[str, Any] = {
        "logprob_mismatch": diff.mean().item(),
        "max": diff.max().item(),
        "p99": diff.quantile(0.99).item(),
        "tokens": int(mask.sum()),
    }
    for cap in CAPS:
        _, capped, _ = importance_weights(log_ratio, mask, LossConfig(correction="truncate", ratio_cap=cap))
        out[f"ratio_capped_frac@{cap}"] = capped[mask].float().mean().item()
    _, _, dropped = importance_weights(log_ratio, mask, LossConfig(correction="mask"))
    out["ratio_masked_frac@[0.5,2]"] = dropped[mask].float().mean().item()
    return out


def megatron_logprobs(path: Path, dtype: str, tokens: TokenBatch) -> torch.Tensor:
    from mopd_hpc.engines.megatron.parallel import initialize_parallel
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine

    device = initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=0)
    return MegatronScoringEngine.from_pretrained(path, dtype=dtype, device=device).logprobs(tokens).cpu()


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    path = make_moe(work / "moe", args.router_std)
    t0 = time.perf_counter()
    rollout = HFRolloutEngine.load(str(path), args.device, args.dtype, decoder="loop", compile_decode=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (args.prompt_len,), generator=g).tolist()
               for _ in range(args.rows)]  # fmt: skip
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    rows = [RowRequest(tuple(p), sampling, seed=i, return_logprob=True, return_routed_experts=True)
            for i, p in enumerate(prompts)]  # fmt: skip
    results = rollout.generate(rows, _Always())
    generate_s = time.perf_counter() - t0
    del rollout
    tokens = TokenBatch.from_samples(prompts, [r.output_ids for r in results], pad_id=0)
    mu = tokens.pad_response_values([r.output_logprobs for r in results])
    first = results[0].routed_experts[0]
    routed = torch.full((len(results), tokens.response_width, *first.shape), -1, dtype=torch.int16)
    for b, r in enumerate(results):
        routed[b, : len(r.routed_experts)] = torch.stack(r.routed_experts)
    mask = tokens.response_mask

    actor = TorchTrainEngine.from_pretrained(
        path, dtype=args.dtype, device=args.device, optimizer=OptimizerConfig(lr=1e-6),
        loss=LossConfig(router_aux_loss_coefficient=0.0),
    )  # fmt: skip
    plain = actor.logprobs(tokens).cpu()
    targets = aggregate_teacher_targets({"t": mu}, [{"t": 1.0}] * tokens.batch_size)
    batch = TrainBatch.create(tokens, mu.clone(), targets=targets, routed_experts=routed).to(actor.device)
    _, replayed, _ = actor.compute_loss(batch)
    actor.routing.end()
    replayed = replayed.detach().cpu()
    out: dict[str, Any] = {
        "no_replay": stats(plain, mu, mask),
        "replay": stats(replayed, mu, mask),
        "routing_flips": {},
    }
    # how often the actor's own routers choose other experts than the rollout did (any of the k), per token
    hooks = actor.routing
    hooks.recording, hooks.recorded = True, []
    with torch.no_grad():
        actor.logprobs(tokens)
    hooks.recording = False
    own = torch.stack(hooks.recorded, dim=1).reshape(*tokens.input_ids.shape, routed.shape[2], -1).cpu()
    at = torch.arange(tokens.batch_size)[:, None].expand_as(mask)
    mine = own[at[mask], tokens.logit_positions[mask]].sort(-1).values
    theirs = routed[mask].long().sort(-1).values
    differs = (mine != theirs).any(-1)  # [N, M]
    out["routing_flips"] = {"per_layer_token_frac": differs.float().mean(0).tolist(),
                            "any_layer_token_frac": differs.any(-1).float().mean().item()}  # fmt: skip
    del actor
    if args.device.startswith("cuda") and not args.no_megatron:
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            out["megatron_no_replay"] = None
        else:
            out["megatron_no_replay"] = stats(megatron_logprobs(path, args.dtype, tokens), mu, mask)
    out["generate_s"] = round(generate_s, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--router-std", type=float, default=0.05,
                   help="σ of the routers' N(0, σ²) weights (router logits' spread ≈ σ·√hidden)")  # fmt: skip
    p.add_argument("--no-megatron", action="store_true", help="skip the megatron forward")
    p.add_argument("--out", type=Path, default=RESULTS / "moe_mismatch.json")
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="moe_mismatch_") as work:
        figures = run(args, Path(work))
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    result = {"commit": commit_of(args.commit), "device": device, "dtype": args.dtype, "shape": SHAPE,
              "rows": args.rows, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "router_std": args.router_std, **figures}  # fmt: skip
    for name in ("no_replay", "replay", "megatron_no_replay"):
        r = figures.get(name)
        if r:
            print(f"{name:20s} mismatch {r['logprob_mismatch']:.5f}  max {r['max']:.4f}  "
                  f"capped@2 {r['ratio_capped_frac@2.0']:.4f}  capped@5 {r['ratio_capped_frac@5.0']:.4f}")  # fmt: skip
    print("routing flips", figures["routing_flips"])
    out_dir = os.environ.get("OUT")
    if out_dir:
        write_results(Path(out_dir) / args.out.name, result)
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
