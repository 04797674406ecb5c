"""The expert-parallel tests' step batch (tests/engines/megatron_ep_prog.py on CPU, test_megatron_ep_gpu.py on
GPUs): one rank's rows of a step, the same for every EP size, with teacher targets and behavior log-probs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.mopd.targets import TeacherTargets


def ep_batch(step: int, rows: Sequence[Sequence[int]], starts: Sequence[int], lo: int, hi: int) -> TrainBatch:
    """Rows lo..hi−1 of step `step` (each token shifted by 3·step, within 1..30; response from `starts`),
    targets and behavior log-probs drawn from a generator seeded by the step (float32, < 0)."""
    shifted = [[(t + 3 * step) % 30 + 1 for t in r] for r in rows]
    tokens = TokenBatch.from_rows(shifted[lo:hi], list(starts[lo:hi]), pad_id=0)
    g = torch.Generator().manual_seed(step)
    width = tokens.response_width
    behavior, target = (-torch.rand(len(rows), 8, generator=g) * 3 for _ in range(2))
    targets = TeacherTargets(target[lo:hi, :width].clone(), torch.ones(hi - lo, width))
    return TrainBatch.create(tokens, behavior[lo:hi, :width].clone(), targets=targets)
