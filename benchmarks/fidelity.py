"""Fidelity at equal wall time: MOPD with the `sampled` and the `topk` estimator vs SFT on teacher samples.

    .venv/bin/python benchmarks/fidelity.py [--config configs/local_cpu.yaml] [--budget-s 180] [--evals 4]

Every method starts from the same student and trains for the same clock budget (sampling, teacher scoring,
training and data time; the evaluations are excluded), on one thread, in one process, with the project's
own parts: the hf rollout engine's sampler (behavior log-probs μ), the teachers' scoring engines, the routed
data stream, and `TorchTrainEngine` with the loss bound:

    sampled      MOPD, A_t·log π_θ(y_t) estimator, truncate correction, lr 3e-4, temperature 1 (its
                 calibrated setting: it collapsed at 1e-3, shared/reference/tiny_calibration.md)
    topk         MOPD, exact per-position reverse KL (k >= vocabulary), lr and temperature from the config
    sft_teacher  the off-policy baseline: cross-entropy on the route teacher's greedy answers to the same
                 prompts, generated on the fly (no student sampling), lr from the config

The greedy accuracy per route on the config's held-out prompts is measured `--evals` times along the budget.
Prints one table and writes benchmarks/results/fidelity.json. Timing goals are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "fidelity.json"
#: lr of the sampled estimator (calibration: collapses at 1e-3, flat at 1e-4).
SAMPLED_LR = 3e-4


class _Open:
    def between_steps(self) -> bool:
        return True


@dataclass
class Method:
    name: str
    lr: float
    temperature: float
    estimator: str | None  # None: SFT


def _setup(config: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from mopd_hpc.config import RunConfig
    from mopd_hpc.engines.teacher.greedy_generate import GreedyRequest, greedy_ids
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.roles.env import with_absolute_paths
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.evaluate import teacher_accuracy

    cfg = with_absolute_paths(RunConfig.from_yaml(config), {"MOPD_SUBMIT_DIR": str(REPO)})
    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    teachers = {t.id: TorchScoringEngine.from_pretrained(t.path) for t in cfg.models.teachers}
    data = build_run_data(cfg)
    weights = {r: dict(w) for r, w in cfg.routes.items()}
    max_new = cfg.rollout.sampling.max_new_tokens

    def generator(engine: Any) -> Any:  # the teacher servers' greedy route, in this process
        async def generate(ids: Any, new: int, eos: int, pad: int) -> list[list[int]]:
            return greedy_ids(engine, GreedyRequest(tuple(map(tuple, ids)), new, eos, pad))

        return generate

    generators = {tid: generator(engine) for tid, engine in teachers.items()}
    teacher_acc = asyncio.run(teacher_accuracy(generators, weights, tokenizer, data.eval_prompts, max_new))
    return {
        "cfg": cfg,
        "tokenizer": tokenizer,
        "teachers": teachers,
        "weights": weights,
        "teacher_acc": {r: max(a.values()) for r, a in teacher_acc.items()},
    }


def _sample(rollout: Any, prompt_ids: list[list[int]], temperature: float, max_new: int, step: int) -> Any:
    from mopd_hpc.engines.rollout.hf_engine import RowRequest
    from mopd_hpc.engines.rollout.protocol import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
    rows = [
        RowRequest(tuple(p), params, seed=step * 100003 + i, return_logprob=True)
        for i, p in enumerate(prompt_ids)
    ]
    return rollout.generate(rows, _Open())


def _teacher_greedy(
    env: dict[str, Any], routes: list[str], prompt_ids: list[list[int]], max_new: int
) -> list:
    """The route teacher's greedy answers (token ids, EOS included when produced)."""
    eos = env["tokenizer"].eos_token_id
    out: list[list[int]] = [[] for _ in prompt_ids]
    for teacher, engine in env["teachers"].items():
        idx = [i for i, r in enumerate(routes) if env["weights"][r].get(teacher, 0) > 0]
        if not idx:
            continue
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(prompt_ids[i])) + prompt_ids[i] for i in idx])
        mask = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(prompt_ids[i]) for i in idx])[:, None]
        ).long()
        with torch.inference_mode():
            gen = engine.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=eos,
            )
        for k, i in enumerate(idx):
            toks = gen[k, width:].tolist()
            out[i] = toks[: toks.index(eos) + 1] if eos in toks else toks
    return out


def run_method(env: dict[str, Any], method: Method, budget_s: float, evals: int) -> dict[str, Any]:
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
    from mopd_hpc.engines.torch.engine import TorchTrainEngine
    from mopd_hpc.mopd.targets import aggregate_teacher_targets
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.evaluate import student_accuracy

    cfg, tok = env["cfg"], env["tokenizer"]
    torch.manual_seed(cfg.seed)
    loss = LossConfig(estimator=method.estimator or "sampled", topk=max(64, cfg.loss.topk))
    engine = TorchTrainEngine.from_pretrained(
        cfg.models.actor.path,
        dtype="float32",
        device="cpu",
        optimizer=OptimizerConfig(lr=method.lr),
        loss=loss,
    )
    rollout = HFRolloutEngine.load(cfg.models.actor.path, "cpu", "float32")
    data = build_run_data(cfg)
    max_new = cfg.rollout.sampling.max_new_tokens
    curve = [{"clock_s": 0.0, "steps": 0, **student_accuracy(engine.model, tok, data.eval_prompts, max_new)}]
    marks = [budget_s * (i + 1) / evals for i in range(evals)]
    clock, step = 0.0, 0
    while marks:
        t0 = time.perf_counter()
        step += 1
        draws = data.dataset.take(cfg.data.batch_size)
        routes = [d.route for d in draws]
        prompt_ids = [list(x) for x in tok([d.sample.text for d in draws])["input_ids"]]
        if method.estimator is None:
            outputs = _teacher_greedy(env, routes, prompt_ids, max_new)
            tokens = TokenBatch.from_samples(prompt_ids, outputs, 0)
            engine.model.train()
            logits = engine.forward.response_logits(tokens)
            nll = -engine.forward.token_logprobs(logits, tokens)
            value = (nll * tokens.response_mask).sum() / tokens.response_mask.sum().clamp(min=1)
            engine.optimizer.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(engine.model.parameters(), 1.0)
            engine.optimizer.step()
        else:
            results = _sample(rollout, prompt_ids, method.temperature, max_new, step)
            tokens = TokenBatch.from_samples(prompt_ids, [r.output_ids for r in results], 0)
            mu = tokens.pad_response_values([r.output_logprobs for r in results])
            k = loss.topk if method.estimator == "topk" else None
            lps, tops, ws = {}, {}, {}
            for teacher, scorer in env["teachers"].items():
                lp, top = scorer.score(tokens, k)
                w = torch.tensor([env["weights"][r].get(teacher, 0.0) for r in routes])
                lps[teacher], ws[teacher] = torch.where(w[:, None] > 0, lp, float("nan")), w
                if top is not None:
                    tops[teacher] = top
            targets = aggregate_teacher_targets(
                lps, [{t: w for t, w in env["weights"][r].items() if w > 0} for r in routes]
            )
            batch = TrainBatch.create(
                tokens, mu, targets=targets, teacher_topk=tops or None, teacher_weights=ws if tops else None
            )
            engine.train_step(batch)
            rollout.load_named_tensors(dict(engine.named_weights()), str(step))
        clock += time.perf_counter() - t0
        if clock >= marks[0]:
            marks.pop(0)
            acc = student_accuracy(engine.model, tok, data.eval_prompts, max_new)
            curve.append({"clock_s": round(clock, 1), "steps": step, **acc})
            print(f"  {method.name}: {clock:.0f} s, {step} steps: {acc}", flush=True)
    return {"method": method.name, "lr": method.lr, "temperature": method.temperature, "curve": curve}


def format_table(results: list[dict[str, Any]], teacher: dict[str, float]) -> str:
    routes = list(teacher)
    head = f"{'method':<12} {'lr':>7} {'T':>4} {'clock s':>8} {'steps':>6} " + " ".join(
        f"{r + ' (% of t.)':>20}" for r in routes
    )
    lines = [head, "-" * len(head)]
    lines.append(
        f"{'teacher':<12} {'':>7} {'':>4} {'':>8} {'':>6} "
        + " ".join(f"{100 * teacher[r]:>19.1f}%" for r in routes)
    )
    for res in results:
        for point in res["curve"]:
            cells = " ".join(
                f"{100 * point[r]:>8.1f}% ({100 * point[r] / teacher[r] if teacher[r] else 0:>5.1f}%)  "
                for r in routes
            )
            lines.append(
                f"{res['method']:<12} {res['lr']:>7.0e} {res['temperature']:>4} {point['clock_s']:>8} {point['steps']:>6} {cells}"
            )
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local_cpu.yaml")
    parser.add_argument("--budget-s", type=float, default=180.0, help="training clock per method, seconds")
    parser.add_argument("--evals", type=int, default=4, help="evaluations along the budget")
    parser.add_argument("--methods", default="topk,sampled,sft_teacher")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env = _setup(args.config)
    cfg = env["cfg"]
    lr, temp = cfg.models.actor.optimizer.lr, cfg.rollout.sampling.temperature
    known = {
        "sampled": Method("sampled", SAMPLED_LR, 1.0, "sampled"),
        "topk": Method("topk", lr, temp, "topk"),
        "sft_teacher": Method("sft_teacher", lr, 0.0, None),
    }
    results = [run_method(env, known[m], args.budget_s, args.evals) for m in args.methods.split(",")]
    table = format_table(results, env["teacher_acc"])
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "config": str(args.config),
        "budget_s": args.budget_s,
        "batch_size": cfg.data.batch_size,
        "threads": 1,
        "teacher": env["teacher_acc"],
        "results": results,
        "table": table,
    }
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
