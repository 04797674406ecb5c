"""One training step of each method of benchmarks/fidelity.py, built from the project's own parts.

A `Bench` holds what every method shares (the config, the tokenizer, the teachers' scoring engines in this
process, the route weights); `Learner` is one method's student (`TorchTrainEngine` with its loss bound, the hf
rollout engine that samples it) and runs its steps:

    sft       the route teacher's greedy answers to the step's prompts (`greedy_ids`, the teacher servers'
              greedy route, in this process), trained with the package's SFT loss (`TrainBatch.sft`: the
              warm-up step of `loss.sft_warmup_steps`, mopd/sft.py)
    topk      MOPD on student samples (μ from the hf engine), teachers' top-k (k ≥ vocabulary: exact reverse KL)
    sampled   MOPD, the A_t·log π_θ(y_t) estimator, truncate correction
    topk_rl   topk + rl_coefficient·L_GRPO (PPO-clip on group-normalized rewards), samples_per_prompt = n
              (batch_size / n prompts, so every step has batch_size rows)
    sft_topk  `warmup` SFT steps, then topk (the SFT-then-MOPD recipe of `loss.sft_warmup_steps`)

Prompts are encoded as the run encodes them (`rollout_phase.encode_prompts`).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


class _Open:
    def between_steps(self) -> bool:
        return True


@dataclass(frozen=True)
class Setting:
    """One point of a method's sweep."""

    method: str  # sft | topk | sampled | topk_rl | sft_topk
    lr: float
    temperature: float = 1.0
    warmup: int = 0  # sft_topk: SFT steps first
    rl: float = 0.0  # topk_rl: rl_coefficient
    n: int = 1  # samples per prompt

    def label(self) -> str:
        extra = {
            "warmup": self.warmup,
            "rl": self.rl,
            "n": self.n if self.n > 1 else 0,
            "T": self.temperature,
        }
        parts = [f"lr {self.lr:g}"] + [
            f"{k} {v:g}" for k, v in extra.items() if v and not (k == "T" and v == 1)
        ]
        return f"{self.method} ({', '.join(parts)})"

    def record(self) -> dict[str, Any]:
        return asdict(self)


class Bench:
    """What every method shares (module docstring)."""

    def __init__(self, config: Path) -> None:
        from transformers import AutoTokenizer

        from mopd_hpc.config import RunConfig
        from mopd_hpc.engines.teacher.greedy_generate import GreedyRequest, greedy_ids
        from mopd_hpc.engines.torch.scoring import TorchScoringEngine
        from mopd_hpc.roles.env import with_absolute_paths
        from mopd_hpc.trainer.data_setup import build_run_data
        from mopd_hpc.trainer.evaluate import teacher_accuracy

        self.cfg = cfg = with_absolute_paths(RunConfig.from_yaml(config), {"MOPD_SUBMIT_DIR": str(REPO)})
        self.tok = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.teachers = {t.id: TorchScoringEngine.from_pretrained(t.path) for t in cfg.models.teachers}
        self.weights = {r: dict(w) for r, w in cfg.routes.items()}
        self.max_new = cfg.rollout.sampling.max_new_tokens

        def generator(engine: Any) -> Any:  # the teacher servers' greedy route, in this process
            async def generate(ids: Any, new: int, eos: int, pad: int) -> list[list[int]]:
                return greedy_ids(engine, GreedyRequest(tuple(map(tuple, ids)), new, eos, pad))

            return generate

        self.generators = {tid: generator(e) for tid, e in self.teachers.items()}
        data = build_run_data(cfg)
        acc = asyncio.run(
            teacher_accuracy(self.generators, self.weights, self.tok, data.eval_prompts, self.max_new)
        )
        self.teacher_acc = {r: max(a.values()) for r, a in acc.items()}

    def data(self) -> Any:
        from mopd_hpc.trainer.data_setup import build_run_data

        return build_run_data(self.cfg)

    def teacher_answers(self, routes: list[str], prompt_ids: list[list[int]]) -> list[list[int]]:
        """Each prompt's route teacher's greedy answer, cut after EOS (trainer/sft_warmup.py's rows)."""
        from mopd_hpc.trainer.sft_warmup import cut_after_eos, route_teacher

        eos = self.tok.eos_token_id
        out: list[list[int]] = [[] for _ in prompt_ids]
        by: dict[str, list[int]] = {}
        for i, r in enumerate(routes):
            by.setdefault(route_teacher(self.weights[r]), []).append(i)
        for teacher, rows in by.items():
            gen = asyncio.run(
                self.generators[teacher]([prompt_ids[i] for i in rows], self.max_new, eos, self.pad)
            )
            for i, row in zip(rows, gen, strict=True):
                out[i] = cut_after_eos(row, eos)
        return out


class Learner:
    """One method's student and its steps (module docstring)."""

    def __init__(self, bench: Bench, setting: Setting) -> None:
        from mopd_hpc.config.loss import LossConfig
        from mopd_hpc.config.models import OptimizerConfig
        from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
        from mopd_hpc.engines.torch.engine import TorchTrainEngine

        cfg = bench.cfg
        torch.manual_seed(cfg.seed)
        self.bench, self.s = bench, setting
        estimator = "sampled" if setting.method == "sampled" else "topk"
        self.loss = LossConfig(estimator=estimator, topk=max(64, cfg.loss.topk), rl_coefficient=setting.rl)
        self.engine = TorchTrainEngine.from_pretrained(
            cfg.models.actor.path,
            dtype="float32",
            device="cpu",
            optimizer=OptimizerConfig(lr=setting.lr, grad_clip=cfg.models.actor.optimizer.grad_clip),
            loss=self.loss,
        )
        self.rollout = HFRolloutEngine.load(cfg.models.actor.path, "cpu", "float32")
        self.data = bench.data()
        self.steps = 0
        self.tokens = 0  # response tokens trained on (the student's samples, or the teacher's answers)

    def is_sft(self) -> bool:
        return self.s.method == "sft" or (self.s.method == "sft_topk" and self.steps < self.s.warmup)

    def draw(self, prompts: int) -> tuple[list[Any], list[list[int]]]:
        from mopd_hpc.trainer.rollout_phase import encode_prompts

        draws = self.data.dataset.take(prompts)
        return draws, encode_prompts(self.bench.tok, draws, self.bench.cfg.data.max_prompt_tokens)

    def sample(self, prompt_ids: list[list[int]], n: int) -> list[Any]:
        from mopd_hpc.engines.rollout.protocol import SamplingParams
        from mopd_hpc.engines.rollout.rows import RowRequest

        params = SamplingParams(max_new_tokens=self.bench.max_new, temperature=self.s.temperature)
        rows = [
            RowRequest(tuple(p), params, seed=self.steps * 100003 + i * n + j, return_logprob=True)
            for i, p in enumerate(prompt_ids)
            for j in range(n)
        ]
        return self.rollout.generate(rows, _Open())

    def sft_batch(self, draws: list[Any], prompt_ids: list[list[int]]) -> Any:
        """The SFT step's batch: the route teachers' greedy answers, `TrainBatch.sft`."""
        from mopd_hpc.engines.batch import TokenBatch, TrainBatch

        answers = self.bench.teacher_answers([d.route for d in draws], prompt_ids)
        tokens = TokenBatch.from_samples(prompt_ids, answers, self.bench.pad)
        return TrainBatch.create(tokens, torch.zeros(tokens.response_mask.shape), sft=True)

    def mopd_batch(self, draws: list[Any], prompt_ids: list[list[int]], results: list[Any], n: int) -> Any:
        """The on-policy step's batch: `results` (n samples per prompt, in order) with μ, the teachers' scores
        (and top-k for the topk estimator), A_ORM when the RL term is on."""
        from mopd_hpc.engines.batch import TokenBatch, TrainBatch
        from mopd_hpc.mopd.grpo import grpo_advantages
        from mopd_hpc.mopd.targets import aggregate_teacher_targets

        b = self.bench
        rows = [p for p in prompt_ids for _ in range(n)]
        routes = [d.route for d in draws for _ in range(n)]
        tokens = TokenBatch.from_samples(rows, [r.output_ids for r in results], b.pad)
        mu = tokens.pad_response_values([r.output_logprobs for r in results])
        k = self.loss.topk if self.loss.estimator == "topk" else None
        lps, tops, ws = {}, {}, {}
        for teacher, scorer in b.teachers.items():
            lp, top = scorer.score(tokens, k)
            w = torch.tensor([b.weights[r].get(teacher, 0.0) for r in routes])
            lps[teacher], ws[teacher] = torch.where(w[:, None] > 0, lp, float("nan")), w
            if top is not None:
                tops[teacher] = top
        targets = aggregate_teacher_targets(
            lps, [{t: w for t, w in b.weights[r].items() if w > 0} for r in routes]
        )
        orm = None
        if self.s.rl > 0:
            orm = grpo_advantages(torch.tensor(self.rewards(draws, results, n)), n)
        return TrainBatch.create(
            tokens, mu, targets=targets, teacher_topk=tops or None, teacher_weights=ws if tops else None,
            orm_advantages=orm,
        )  # fmt: skip

    def rewards(self, draws: list[Any], results: list[Any], n: int) -> list[float]:
        """Each sample's reward by its source's scorer (1: right)."""
        texts = [self.bench.tok.decode(list(r.output_ids), skip_special_tokens=True) for r in results]
        rows = [d for d in draws for _ in range(n)]
        return [
            float(self.data.sources[d.source].score(d.sample, t)) for d, t in zip(rows, texts, strict=True)
        ]

    def step(self) -> dict[str, float]:
        """One step; returns the engine's statistics."""
        batch_size = self.bench.cfg.data.batch_size
        if self.is_sft():
            batch = self.sft_batch(*self.draw(batch_size))
        else:
            draws, prompt_ids = self.draw(batch_size // self.s.n)
            batch = self.mopd_batch(draws, prompt_ids, self.sample(prompt_ids, self.s.n), self.s.n)
        stats = self.engine.train_step(batch)
        self.steps += 1
        self.tokens += int(batch.tokens.response_mask.sum())
        self.rollout.load_named_tensors(dict(self.engine.named_weights()), str(self.steps))
        return stats

    def accuracy(self) -> dict[str, float]:
        from mopd_hpc.trainer.evaluate import student_accuracy

        return student_accuracy(self.engine.model, self.bench.tok, self.data.eval_prompts, self.bench.max_new)
