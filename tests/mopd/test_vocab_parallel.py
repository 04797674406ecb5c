"""The student's top-k reverse KL on a vocab-parallel student (`mopd.vocab_parallel`) against the
full-vocabulary reference (`topk_reverse_kl_loss` of the gathered logits), float64, 1e-12.

The vocabulary is sharded in one process: each shard runs in its own thread and the group's all-reduce is
a sum (or max) over the threads' tensors (a barrier in place of the collective); each shard back-propagates
into its own columns, and the columns' gradients, put side by side, must equal the reference gradient of
the full logits (0 on megatron's padding columns, ids ≥ V). Then the same with a real 2-process gloo group.
Top-k across shards: per-shard top-k, then the top-k of the candidates, equals the full top-k.
A vocab-parallel teacher's answer (`vocab_parallel_score`, what megatron's scoring engine calls): at one
shard it is the engine's former arithmetic (float32 log-softmax of the full logits, then top-k; values
within 1e-6, ids identical), and two gloo ranks holding vocabulary shards give the one-process answer.
"""

from __future__ import annotations

import json
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from helpers_ranks import run_ranks

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.topk import TeacherTopK, topk_reverse_kl, topk_reverse_kl_loss
from mopd_hpc.mopd.vocab_parallel import (
    VocabParallelLogprobs,
    merge_topk,
    shard_topk,
    vocab_parallel_score,
    vocab_parallel_topk,
)

REPO = Path(__file__).resolve().parents[2]
#: The test folders on sys.path (pyproject's pythonpath), for children that import test modules.
TEST_DIRS = ":".join(p for p in sys.path if p.startswith(str(REPO / "tests")))
B, T, V = 3, 5, 50
TOL = 1e-12


class ThreadGroup:
    """`size` shards in threads of one process; `all_reduce(t, op)` sums (maxes) every shard's t in place."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier = size, threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def for_rank(self, rank: int):
        def all_reduce(tensor: torch.Tensor, op: str) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)  # type: ignore[arg-type]
            result = stacked.sum(0) if op == "sum" else stacked.max(0).values
            self.barrier.wait()  # every rank has read the slots before any writes the next
            tensor.copy_(result)

        return all_reduce

    def gather(self, rank: int):
        def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            out = [t.clone() for t in self.slots]  # type: ignore[union-attr]
            self.barrier.wait()
            return out

        return all_gather


def problem(seed: int = 0):
    """Full logits [B, T, V] float64, a loss mask, two teachers' top-k (k = 7 and k = V) and weights."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, :1] = False
    teachers = {
        "a": TeacherTopK.from_logits(2.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64), 7),
        "b": TeacherTopK.from_logits(2.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64), V),
    }
    weights = {"a": torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64), "b": torch.tensor([0.0, 0.5, 2.0])}
    sampled = torch.randint(0, V, (B, T), generator=g)
    return logits, mask, teachers, weights, sampled


def reference(logits, mask, teachers, weights, sampled):
    full = logits.clone().requires_grad_(True)
    loss, stats = topk_reverse_kl_loss(full, teachers, weights, mask, LossConfig(estimator="topk"))
    lp = torch.log_softmax(full, -1).gather(-1, sampled[..., None]).squeeze(-1)
    (loss + (lp * mask).sum()).backward()
    return float(loss.detach()), stats, lp.detach(), full.grad


@pytest.mark.parametrize(
    "shards, width", [(1, 50), (4, 14), (3, 20), (5, 12)], ids=["tp1", "tp4", "tp3", "tp5"]
)
def test_sharded_topk_reverse_kl_equals_the_full_vocabulary(shards: int, width: int) -> None:
    """width·shards = V' ≥ V: the last shard holds padding columns (tp4: 6, tp3: 10, tp5: 10)."""
    logits, mask, teachers, weights, sampled = problem()
    want_loss, want_stats, want_lp, want_grad = reference(logits, mask, teachers, weights, sampled)
    padded = torch.cat([logits, 1e3 * torch.ones(B, T, shards * width - V, dtype=torch.float64)], -1)
    group = ThreadGroup(shards)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            local = padded[..., r * width : (r + 1) * width].clone().requires_grad_(True)
            student = VocabParallelLogprobs(local, r * width, V, group.for_rank(r))
            loss, stats = topk_reverse_kl(student, teachers, weights, mask, LossConfig(estimator="topk"))
            lp = student(sampled[..., None]).squeeze(-1)
            (loss + (lp * mask).sum()).backward()
            results[r] = (float(loss.detach()), stats, lp.detach(), local.grad)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in range(shards):
        loss, stats, lp, _ = results[r]
        assert abs(loss - want_loss) <= TOL, (r, loss, want_loss)  # every rank holds the same loss
        for key, value in want_stats.items():
            assert abs(float(stats[key]) - float(value)) <= 1e-6, key
        torch.testing.assert_close(lp, want_lp, atol=TOL, rtol=0)
    grad = torch.cat([results[r][3] for r in range(shards)], -1)
    torch.testing.assert_close(grad[..., :V], want_grad, atol=TOL, rtol=0)
    assert float(grad[..., V:].abs().sum()) == 0.0  # padding columns get no gradient
    assert float(want_grad.abs().max()) > 1e-2


def test_topk_across_shards_is_the_full_topk() -> None:
    logits = problem(seed=3)[0]
    for shards, width, k in ((4, 14, 5), (5, 12, 12), (2, 25, 1)):
        padded = torch.cat([logits, torch.full((B, T, shards * width - V), 1e3, dtype=torch.float64)], -1)
        parts = [shard_topk(padded[..., r * width : (r + 1) * width], r * width, V, k) for r in range(shards)]
        values, ids = merge_topk(
            torch.cat([p[0] for p in parts], -1), torch.cat([p[1] for p in parts], -1), k
        )
        want_values, want_ids = logits.topk(k, dim=-1)
        torch.testing.assert_close(values, want_values.float(), atol=1e-6, rtol=0)
        assert torch.equal(ids, want_ids), (shards, k)
        # with the global logsumexp: the teacher's top-k log-probs (TeacherTopK.from_logits), via threads
        group = ThreadGroup(shards)
        got: dict[int, tuple] = {}

        def rank_main(r: int, padded=padded, group=group, got=got, width=width, k=k) -> None:
            local = padded[..., r * width : (r + 1) * width]
            got[r] = vocab_parallel_topk(local, r * width, V, k, group.gather(r), group.for_rank(r))

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(shards)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        want = TeacherTopK.from_logits(logits, k)
        for r in range(shards):
            assert torch.equal(got[r][0], want.indices)
            torch.testing.assert_close(got[r][1], want.logprobs.float(), atol=1e-6, rtol=0)


_GLOO = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    sys.path[:0] = sys.argv[4].split(':')
    from test_vocab_parallel import problem, V
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.mopd.topk import topk_reverse_kl
    from mopd_hpc.mopd.vocab_parallel import VocabParallelLogprobs, process_group_all_reduce, vocab_parallel_topk
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    logits, mask, teachers, weights, sampled = problem()
    width = V // 2
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    student = VocabParallelLogprobs(local, rank * width, V, process_group_all_reduce())
    loss, _ = topk_reverse_kl(student, teachers, weights, mask, LossConfig(estimator="topk"))
    lp = student(sampled[..., None]).squeeze(-1)
    (loss + (lp * mask).sum()).backward()
    def gather(t):
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t)
        return parts
    # megatron-like padding: V' = 56, rank 1 holds 22 real columns of 28 (ids 28..49) and 6 of padding
    padded = torch.cat([logits, torch.full((*logits.shape[:-1], 6), 1e3, dtype=logits.dtype)], -1)
    top_ids, top_lp = vocab_parallel_topk(padded[..., rank * 28:(rank + 1) * 28], rank * 28, V, 25, gather,
                                          process_group_all_reduce())
    torch.save({"loss": float(loss.detach()), "grad": local.grad, "top_ids": top_ids, "top_lp": top_lp},
               sys.argv[3])
    dist.destroy_process_group()
    """
)


def test_two_gloo_ranks_equal_the_full_vocabulary(tmp_path: Path) -> None:
    logits, mask, teachers, weights, sampled = problem()
    want_loss, _, _, want_grad = reference(logits, mask, teachers, weights, sampled)
    store = tmp_path / "store"
    run_ranks(_GLOO, lambda r: (str(r), str(store), str(tmp_path / f"r{r}.pt"), TEST_DIRS), timeout_s=120)
    out = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    for o in out:
        assert abs(o["loss"] - want_loss) <= TOL
    torch.testing.assert_close(torch.cat([o["grad"] for o in out], -1), want_grad, atol=TOL, rtol=0)
    want_top = TeacherTopK.from_logits(logits, 25)  # k = 25 > rank 1's 22 real columns
    for o in out:
        assert torch.equal(o["top_ids"], want_top.indices)
        torch.testing.assert_close(o["top_lp"], want_top.logprobs.float(), atol=1e-6, rtol=0)


@pytest.mark.gpu
def test_no_float32_vocabulary_tensor_on_gpu() -> None:
    """One shard (TP = 1) of a Qwen3 vocabulary, bf16 logits [4096, 151936] (1.16 GiB), top-64 of two teachers
    plus the sampled tokens, forward and backward: the peak above the logits stays below 3 bf16 copies of them
    (their gradient and autograd's transient sum) + 2 float32 blocks; a float32 log-softmax alone would be 2
    bf16 copies for its output, 2 more saved for its backward. Figures to benchmarks/results/ when present."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n, vocab, k = 4096, 151936, 64
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (3 * torch.randn(1, n, vocab, device=dev, generator=g)).to(torch.bfloat16).requires_grad_(True)
    teachers = {
        t: TeacherTopK(
            torch.randint(0, vocab, (1, n, k), device=dev, generator=g), -torch.rand(1, n, k, device=dev)
        )
        for t in "ab"
    }
    weights = {"a": torch.tensor([0.5], device=dev), "b": torch.tensor([0.5], device=dev)}
    mask = torch.ones(1, n, dtype=torch.bool, device=dev)
    sampled = torch.randint(0, vocab, (1, n, 1), device=dev, generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    student = VocabParallelLogprobs(logits, 0, vocab)
    loss, _ = topk_reverse_kl(student, teachers, weights, mask, LossConfig(estimator="topk"))
    (loss + student(sampled).sum() * 1e-3).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - base
    copy = logits.numel() * logits.element_size()
    figures = {"tokens": n, "vocab": vocab, "k": k, "logits_bf16_bytes": copy, "peak_above_logits_bytes": peak,
               "peak_in_logits_copies": peak / copy, "float32_copy_bytes": 2 * copy}  # fmt: skip
    print(figures)
    out = REPO / "benchmarks" / "results"
    if out.is_dir():
        (out / "vocab_parallel_memory_gpu.json").write_text(json.dumps(figures, indent=1))
    ref = torch.log_softmax(logits.detach()[0, :8].float(), -1).gather(-1, teachers["a"].indices[0, :8])
    torch.testing.assert_close(student(teachers["a"].indices)[0, :8].detach(), ref, atol=2e-3, rtol=0)
    assert peak < 3 * copy + 2 * 128 * 2**20, figures


SCORE_K = 6
SCORE_TOL = 1e-6  # float32, absolute
#: plus 2 float32 ulps relative: a log-prob below −8 has an ulp ≥ 9.5e-7 (x − lse and log_softmax round apart)
SCORE_RTOL = 2 * torch.finfo(torch.float32).eps


def teacher_problem(dtype: torch.dtype = torch.float32, seed: int = 5, vocab: int = 64):
    """Random teacher logits [B, T, vocab] (scale 3) and response token ids [B, T]."""
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(B, T, vocab, generator=g)).to(dtype)
    return logits, torch.randint(0, vocab, (B, T), generator=g)


def former_engine_score(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """MegatronScoringEngine.score's arithmetic before the vocab-parallel path (one float32 log-softmax of the
    full logits [B, T, V], the tokens' log-probs gathered from it, its top-k): (token lp, ids, values)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), ids, values


def assert_same_answer(got, want, tol: float = SCORE_TOL) -> None:
    """Token log-probs and the sorted top-k log-probs within tol; ids identical at every rank of the top-k
    whose value is apart from its neighbours (a tie may come in either order); returns nothing."""
    (lp, ids, values), (want_lp, want_ids, want_values) = got, want
    assert ids.shape == want_ids.shape and ids.dtype == torch.int64
    torch.testing.assert_close(lp, want_lp, atol=tol, rtol=SCORE_RTOL)
    torch.testing.assert_close(values, want_values, atol=tol, rtol=SCORE_RTOL)
    gap = want_values[..., :-1] - want_values[..., 1:]
    apart = torch.ones_like(want_ids, dtype=torch.bool)
    apart[..., :-1] &= gap > 0
    apart[..., 1:] &= gap > 0
    assert torch.equal(ids[apart], want_ids[apart])
    assert float(apart.float().mean()) > 0.5  # the comparison covers most of the top-k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_shard_score_is_the_former_engine_arithmetic(dtype: torch.dtype) -> None:
    """TP = 1 (no collective): the same answer as the full float32 log-softmax (bf16: the same top-k ids and
    values, since bf16 → float32 is exact and monotone), k ≤ V and k > V (the whole vocabulary)."""
    logits, tokens = teacher_problem(dtype)
    for k in (SCORE_K, 1, 64, 1000):
        got = vocab_parallel_score(logits, 0, logits.shape[-1], tokens, k)
        want = former_engine_score(logits, tokens, k)
        assert got[1].shape[-1] == min(k, logits.shape[-1])
        assert_same_answer(got, want)
        if dtype == torch.float32:  # random float32 logits: no ties, every id identical
            assert torch.equal(got[1], want[1])


_GLOO_SCORE = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    sys.path[:0] = sys.argv[4].split(':')
    from test_vocab_parallel import teacher_problem, SCORE_K
    from mopd_hpc.mopd.vocab_parallel import (process_group_all_gather, process_group_all_reduce,
                                              vocab_parallel_score)
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    out = {}
    for name, width, pad in (("even", 32, 0), ("padded", 36, 8)):  # padded: V' = 72, rank 1 has 28 real ids
        logits, tokens = teacher_problem()
        full = torch.cat([logits, torch.full((*logits.shape[:-1], pad), 1e3)], -1)  # padding would win
        local = full[..., rank * width:(rank + 1) * width].contiguous()
        out[name] = vocab_parallel_score(local, rank * width, logits.shape[-1], tokens, SCORE_K,
                                         process_group_all_gather(), process_group_all_reduce())
    torch.save(out, sys.argv[3])
    dist.destroy_process_group()
    """
)


def test_two_gloo_ranks_score_like_one_process(tmp_path: Path) -> None:
    """Two gloo processes, each holding half of the vocabulary (then with megatron's padding on rank 1),
    through `vocab_parallel_score` with the process-group collectives the engine uses: both ranks give the
    one-process full-vocabulary answer (float32, 1e-6; every id identical: random float32 logits, no ties)."""
    store = tmp_path / "store"
    run_ranks(
        _GLOO_SCORE,
        lambda r: (str(r), str(store), str(tmp_path / f"s{r}.pt"), TEST_DIRS),
        timeout_s=120,
    )
    logits, tokens = teacher_problem()
    want = former_engine_score(logits, tokens, SCORE_K)
    for r in range(2):
        got = torch.load(tmp_path / f"s{r}.pt")
        for name in ("even", "padded"):
            assert_same_answer(got[name], want)
            assert torch.equal(got[name][1], want[1]), (r, name)
            assert int(got[name][1].max()) < logits.shape[-1]  # no padding id
