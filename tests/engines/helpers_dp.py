"""Data-parallel test helpers: a recorded train batch (plain tensors on disk), the one-step case both the
DP = 1 reference and each DP rank run, and a pool of spawned worker processes that form one real gloo group
(rendezvous through a FileStore in a temp directory) and run cases until told to stop.

The workers are started once per test module: a case is a dict sent to every rank's own queue, and each rank
answers (rank, bytes of `torch.save`, or a traceback string).
"""

from __future__ import annotations

import functools
import io
import queue
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import helpers_fork
import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.data_parallel import DataParallel, DataParallelError
from mopd_hpc.engines.micro_batch import MicroBatching
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.engines.torch.hf_model import load_causal_lm
from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.mopd.topk import TeacherTopK
from mopd_hpc.trainer.step import ratio_means, ratio_sums

VOCAB = 32
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [2, 4, 6], [3, 5], [7], [8, 9, 1, 2]]
OUTPUTS = [
    [11, 12, 13, 14],
    [15],
    [],
    [18, 19, 20],
    [21, 22, 23, 24, 25],
    [26, 27],
    [28, 29, 30, 31],
    [5, 6, 7],
]
ROUTES = [{"a": 1.0}, {"a": 1.0, "b": 0.5}, {"b": 1.0}, {"a": 0.3, "b": 1.0}] * 2
GROUP_TIMEOUT_S = 60
ANSWER_TIMEOUT_S = 120
LR = 1e-3


def ratio_stats(student_logprobs, batch, loss):
    """The shard's importance-ratio statistics as `observe` returns them (trainer/step.py: sums over counts)."""
    return ratio_means(ratio_sums(student_logprobs, batch, loss))


def save_record(path: Path, batch: TrainBatch) -> Path:
    """Write `batch` as a dict of plain tensors (what a recorded step holds)."""
    rec: dict[str, Any] = {
        "input_ids": batch.tokens.input_ids,
        "response_start": batch.tokens.response_start,
        "attention_mask": batch.tokens.attention_mask,
        "response_ids": batch.tokens.response_ids,
        "response_mask": batch.tokens.response_mask,
        "pad_id": batch.tokens.pad_id,
        "behavior_logprobs": batch.behavior_logprobs,
        "logp_sum": batch.targets.logp_sum if batch.targets else None,
        "weight_sum": batch.targets.weight_sum if batch.targets else None,
        "topk": {k: (v.indices, v.logprobs) for k, v in batch.teacher_topk.items()},
        "teacher_weights": dict(batch.teacher_weights),
        "orm_advantages": batch.orm_advantages,
        "ref_logprobs": batch.ref_logprobs,
    }
    torch.save(rec, path)
    return path


def load_record(path: Path) -> TrainBatch:
    rec = torch.load(path)
    tokens = TokenBatch(
        rec["input_ids"],
        rec["attention_mask"],
        rec["response_ids"],
        rec["response_mask"],
        rec["response_start"],
        rec["pad_id"],
    )
    targets = None if rec["logp_sum"] is None else TeacherTargets(rec["logp_sum"], rec["weight_sum"])
    return TrainBatch.create(
        tokens,
        rec["behavior_logprobs"],
        targets=targets,
        teacher_topk={k: TeacherTopK(i, lp) for k, (i, lp) in rec["topk"].items()},
        teacher_weights=rec["teacher_weights"],
        orm_advantages=rec["orm_advantages"],
        ref_logprobs=rec["ref_logprobs"],
    )


def train_engine(case: dict[str, Any], dp: DataParallel) -> TorchTrainEngine:
    """The case's engine on CPU; dtype "float64" (for exact comparisons; not a config dtype) is the float32
    checkpoint cast to float64, built through the constructor."""
    micro = MicroBatching(case.get("micro_batch_tokens"), case.get("activation_checkpointing", False))
    optimizer = OptimizerConfig(lr=LR, grad_clip=None)
    loss = LossConfig(**case["loss"])
    if case.get("dtype") == "float64":
        cpu = torch.device("cpu")
        model = load_causal_lm(case["model"], "float32", cpu).double()
        return TorchTrainEngine(
            model, str(case["model"]), cpu, optimizer, loss, data_parallel=dp, micro_batching=micro
        )
    return TorchTrainEngine.from_pretrained(
        case["model"], dtype=case.get("dtype", "float32"), device="cpu", optimizer=optimizer, loss=loss,
        data_parallel=dp, micro_batching=micro,
    )  # fmt: skip


def run_case(dp: DataParallel, case: dict[str, Any]) -> dict[str, Any]:
    """One train step of rank `dp.rank` on its rows `case["bounds"][rank]` of the recorded batch, with
    `ratio_stats` observed (optional `dtype`, `micro_batch_tokens` and `activation_checkpointing` in the case). Returns the step's statistics, AdamW's exp_avg (= (1 − β1)·g after one step
    without clipping) and the parameters after the step, by parameter name."""
    batch = load_record(Path(case["batch"]))
    start, stop = case["bounds"][dp.rank]
    shard = batch.rows(start, stop)
    engine = train_engine(case, dp)
    stats = engine.train_step(
        shard, observe=functools.partial(ratio_stats, batch=shard, loss=engine.loss_config)
    )
    named = dict(engine.model.named_parameters())
    return {
        "stats": stats,
        "exp_avg": {n: engine.optimizer.state[p]["exp_avg"].clone() for n, p in named.items()},
        "params": {n: p.detach().clone() for n, p in named.items()},
    }


def check_key_mismatch(dp: DataParallel) -> str:
    """Every rank reduces statistics under a name of its own: each must raise, none may hang."""
    try:
        dp.all_reduce_stats({f"only_rank_{dp.rank}": 1.0}, {"loss": 1.0}, 1.0, torch.device("cpu"))
    except DataParallelError as err:
        return str(err)
    return "no error"


def serve(rank: int, world: int, store_path: str, tasks: Any, answers: Any) -> None:
    """A worker: join the gloo group, then run cases from `tasks` until None arrives."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    import transformers  # noqa: F401  (imported while the parent builds its models, not in the first case)

    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    dp = DataParallel.from_group()
    try:
        while (case := tasks.get()) is not None:
            try:
                result: Any = check_key_mismatch(dp) if case.get("kind") == "keys" else run_case(dp, case)
                buf = io.BytesIO()
                torch.save(result, buf)
                answers.put((rank, buf.getvalue()))
            except BaseException:
                answers.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class WorkerGroup:
    """`world` spawned worker processes forming one gloo group; `run(case)` gives every rank's result."""

    def __init__(self, world: int, tmp: Path) -> None:
        ctx = helpers_fork.context()  # forked with torch imported (spawn's on a GPU machine)
        self.world = world
        self.answers = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        store = str(tmp / "gloo_store")
        self.procs = [
            ctx.Process(target=serve, args=(r, world, store, self.tasks[r], self.answers), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, case: dict[str, Any]) -> list[Any]:
        """Send `case` to every rank; return the results in rank order. Raises AssertionError with the
        worker's traceback, or when a worker dies or does not answer in ANSWER_TIMEOUT_S."""
        for q in self.tasks:
            q.put(case)
        got: dict[int, Any] = {}
        while len(got) < self.world:
            try:
                rank, payload = self.answers.get(timeout=ANSWER_TIMEOUT_S)
            except queue.Empty:
                codes = [p.exitcode for p in self.procs]
                raise AssertionError(
                    f"no answer in {ANSWER_TIMEOUT_S} s; worker exit codes {codes}"
                ) from None
            if isinstance(payload, str):
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload))
        return [got[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


def record_step(root: Path) -> dict[str, Path]:
    """A student checkpoint and one recorded step's batch under `root` (8 rows, one with an empty response,
    two teachers scored with top-4 / top-3, an off-policy μ, a reference model's log-probs, GRPO
    advantages): {"model": student dir, "batch": the record}."""
    from helpers_models import save_micro_qwen3

    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.mopd.grpo import grpo_advantages
    from mopd_hpc.mopd.targets import aggregate_teacher_targets

    student = save_micro_qwen3(root / "student", 0, vocab_size=VOCAB, initializer_range=0.2)
    teachers = {
        tid: TorchScoringEngine.from_pretrained(save_micro_qwen3(root / tid, seed, initializer_range=0.2))
        for tid, seed in (("a", 1), ("b", 2))
    }
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    mask = tokens.response_mask
    gen = torch.Generator().manual_seed(0)
    lp = TorchScoringEngine.from_pretrained(student).logprobs(tokens)
    mu = torch.where(mask, lp + 0.3 * torch.randn(lp.shape, generator=gen), 0.0)
    ref = torch.where(mask, lp + 0.1 * torch.randn(lp.shape, generator=gen), 0.0)
    scored = {tid: t.score(tokens, k) for (tid, t), k in zip(teachers.items(), (4, 3), strict=True)}
    batch = TrainBatch.create(
        tokens,
        mu,
        targets=aggregate_teacher_targets({tid: s[0] for tid, s in scored.items()}, ROUTES),
        teacher_topk={tid: s[1] for tid, s in scored.items()},
        teacher_weights={tid: torch.tensor([r.get(tid, 0.0) for r in ROUTES]) for tid in teachers},
        orm_advantages=grpo_advantages(torch.rand(len(PROMPTS), generator=gen), 4),
        ref_logprobs=ref,
    )
    return {"model": student, "batch": save_record(root / "step.pt", batch)}
