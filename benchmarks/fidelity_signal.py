"""Why MOPD learns slower than SFT on the embedded default: the learning signal of one step, from the same start.

    .venv/bin/python benchmarks/fidelity_signal.py [--config configs/local_cpu.yaml] [--batches 4]
        [--checkpoint DIR] [--sft-steps N]

On `--batches` batches of data.batch_size prompts (the run's stream), from the start student (or
`--checkpoint`, or the student after `--sft-steps` SFT steps at lr 2e-3), with torch on one thread:

- on-policy samples (temperature 1 and 0.5, the hf rollout engine): the share that is right (reward 1), and
  the share of response positions whose state is on the teacher's path (the sampled prefix y_<t equals the
  route teacher's greedy answer's first t tokens, t < its length): only there does the teacher's
  distribution speak about the answer the greedy evaluation reads;
- the gradient of one step's loss before clipping (no optimizer step) for SFT on the teacher's greedy answers,
  MOPD topk and MOPD sampled on the same prompts: its global L2 norm, its cosine with the SFT gradient (the
  direction to the evaluated answer), and for topk the part that comes from on-path states (the loss with the
  off-path positions masked, over the same token count): its share of the norm and its cosine with SFT's;
- at the states of the teachers' answers, per position, the gradient with respect to the logits of the
  reverse KL against the cross-entropy's, binned by the student's probability of the teacher's token
  (`position_signal`): where the reverse KL puts its signal.

Prints the table and writes benchmarks/results/fidelity_signal.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_steps import REPO, Bench, Learner, Setting  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fidelity_signal.json"


def flat_grad(
    learner: Learner, batch: Any, mask: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """The loss's gradient over every parameter, flattened (float64); `mask` restricts the loss positions
    (the result times `scale`)."""
    from mopd_hpc.mopd.logprobs import token_logprobs

    engine = learner.engine
    engine.model.zero_grad(set_to_none=True)
    tokens = batch.tokens
    logits = engine.forward.response_logits(tokens)
    lp = engine.forward.token_logprobs(logits, tokens)
    loss, _ = engine.objective(
        logprobs=lp,
        behavior_logprobs=batch.behavior_logprobs,
        loss_mask=tokens.response_mask if mask is None else mask,
        targets=batch.targets,
        teacher_topk=batch.teacher_topk,
        teacher_weights=batch.teacher_weights,
        student_logprobs=lambda ids: token_logprobs(logits, ids),
        sft=batch.sft,
    )
    (scale * loss).backward()
    return torch.cat([p.grad.double().flatten() for p in engine.model.parameters() if p.grad is not None])


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=1e-30))


def on_path(answers: list[list[int]], samples: list[Any], width: int) -> torch.Tensor:
    """[B, width] bool: the state before position t is the teacher answer's (module docstring)."""
    out = torch.zeros(len(samples), width, dtype=torch.bool)
    for b, (ans, s) in enumerate(zip(answers, samples, strict=True)):
        ids = list(s.output_ids)
        for t in range(min(len(ids), len(ans))):
            if ids[:t] != ans[:t]:
                break
            out[b, t] = True
    return out


def position_signal(learner: Learner, batch: Any, routes: list[str]) -> dict[str, float]:
    """At the states of the teachers' greedy answers (an SFT batch): the gradient of each position's loss with
    respect to the student's logits, reverse KL (topk, k ≥ V) p⊙(log p − log q − KL(p‖q)) against
    cross-entropy p − onehot(y), binned by the student's probability p(y) of the teacher's token: the mean
    L2 norm of each in the bin, and the bin's share of the positions."""
    from mopd_hpc.trainer.sft_warmup import route_teacher

    tokens = batch.tokens
    bench = learner.bench
    with torch.no_grad():
        logp = torch.log_softmax(learner.engine.forward.response_logits(tokens).double(), dim=-1)
        logq = torch.full_like(logp, float("-inf"))
        for teacher, scorer in bench.teachers.items():
            rows = torch.tensor([route_teacher(bench.weights[r]) == teacher for r in routes])
            _, top = scorer.score(tokens, logp.shape[-1])
            full = torch.full_like(logp, float("-inf")).scatter(-1, top.indices, top.logprobs.double())
            logq = torch.where(rows[:, None, None], full, logq)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1, keepdim=True)
    g_rkl = p * (logp - logq - kl)
    g_ce = p - torch.nn.functional.one_hot(tokens.response_ids, p.shape[-1]).double()
    pc = p.gather(-1, tokens.response_ids[..., None])[..., 0]
    mask = tokens.response_mask
    out: dict[str, float] = {}
    n = float(mask.sum())
    for lo, hi in ((0.0, 0.1), (0.1, 0.5), (0.5, 1.01)):
        sel = mask & (pc >= lo) & (pc < hi)
        k = max(float(sel.sum()), 1.0)
        out[f"p(y) in [{lo:g},{min(hi, 1):g})/share"] = float(sel.sum()) / n
        out[f"p(y) in [{lo:g},{min(hi, 1):g})/rkl_grad"] = float(g_rkl.norm(dim=-1)[sel].sum()) / k
        out[f"p(y) in [{lo:g},{min(hi, 1):g})/ce_grad"] = float(g_ce.norm(dim=-1)[sel].sum()) / k
    out["teacher_logq_wrong_mean"] = float(
        torch.where(torch.isfinite(logq) & (logq < -0.7), logq, 0.0)[mask].sum()
        / (torch.isfinite(logq) & (logq < -0.7))[mask].sum()
    )
    return out


def measure(bench: Bench, batches: int, checkpoint: Path | None, sft_steps: int = 0) -> dict[str, Any]:
    topk = Learner(bench, Setting("topk", 1e-3))
    sampled = Learner(bench, Setting("sampled", 1e-3))
    if sft_steps:  # the student after an SFT warm-up (lr 2e-3, the run's), measured from there
        warm = Learner(bench, Setting("sft", 2e-3))
        for _ in range(sft_steps):
            warm.step()
        for learner in (topk, sampled):
            learner.engine.model.load_state_dict(warm.engine.model.state_dict())
            learner.rollout.load_named_tensors(dict(learner.engine.named_weights()), "warm")
            learner.data = warm.data  # the stream after the warm-up's prompts
    for learner in (topk, sampled):
        if checkpoint is not None:
            from safetensors.torch import load_file

            learner.engine.model.load_state_dict(
                load_file(str(checkpoint / "model.safetensors")), strict=False
            )
            learner.rollout.load_named_tensors(dict(learner.engine.named_weights()), "ckpt")
    rows: list[dict[str, float]] = []
    for _ in range(batches):
        draws, prompt_ids = topk.draw(bench.cfg.data.batch_size)
        answers = bench.teacher_answers([d.route for d in draws], prompt_ids)
        row: dict[str, float] = {}
        for temperature in (1.0, 0.5):
            topk.s = dataclasses.replace(topk.s, temperature=temperature)
            samples = topk.sample(prompt_ids, 1)
            right = topk.rewards(draws, samples, 1)
            width = max(len(s.output_ids) for s in samples)
            path = on_path(answers, samples, width)
            n_tok = sum(len(s.output_ids) for s in samples)
            row[f"T{temperature:g}/right"] = sum(r == 1.0 for r in right) / len(right)
            row[f"T{temperature:g}/on_path_positions"] = float(path.sum()) / n_tok
            row[f"T{temperature:g}/response_tokens"] = n_tok / len(samples)
        topk.s = dataclasses.replace(topk.s, temperature=1.0)
        samples = topk.sample(prompt_ids, 1)
        b_sft = topk.sft_batch(draws, prompt_ids)
        row |= position_signal(topk, b_sft, [d.route for d in draws])
        g_sft = flat_grad(topk, b_sft)
        b_topk = topk.mopd_batch(draws, prompt_ids, samples, 1)
        g_topk = flat_grad(topk, b_topk)
        mask = b_topk.tokens.response_mask
        path = on_path(answers, samples, mask.shape[1]) & mask
        g_on = flat_grad(topk, b_topk, path, float(path.sum()) / float(mask.sum()))
        g_sampled = flat_grad(sampled, sampled.mopd_batch(draws, prompt_ids, samples, 1))
        row |= {
            "sft/grad_norm": float(g_sft.norm()),
            "topk/grad_norm": float(g_topk.norm()),
            "sampled/grad_norm": float(g_sampled.norm()),
            "topk/cos_sft": cos(g_topk, g_sft),
            "sampled/cos_sft": cos(g_sampled, g_sft),
            "topk/on_path_norm_share": float(g_on.norm() / g_topk.norm()),
            "topk/on_path_cos_sft": cos(g_on, g_sft),
            "topk/on_path_cos_topk": cos(g_on, g_topk),
            "sft/answer_tokens": sum(len(a) for a in answers) / len(answers),
        }
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local_cpu.yaml")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--checkpoint", type=Path, default=None, help="an HF student directory to start from")
    parser.add_argument("--sft-steps", type=int, default=0, help="measure after this many SFT steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bench = Bench(args.config)
    means = measure(bench, args.batches, args.checkpoint, args.sft_steps)
    print("\n".join(f"{k:<32} {v:10.4f}" for k, v in means.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    key = "start" if args.checkpoint is None else f"checkpoint {args.checkpoint.name}"
    key = f"after {args.sft_steps} SFT steps" if args.sft_steps else key
    entry = {"config": str(args.config), "batches": args.batches, "means": means}
    RESULTS.write_text(json.dumps(old | {key: entry}, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
