"""The teacher's answer packed on the engine's device and copied to the host once (`engines.teacher.score_frames.pack_answer`)
against the answer as it was built before (`engines.teacher.score_frames.score_answer` from host copies of the padded
scores, `first_nan`, per-row lists for JSON): the frames equal byte for byte, the NaN report and the JSON
rows equal; on CUDA the device-packed answer equals the CPU-packed one bitwise, and so does the torch
scoring engine's score left on the device."""

from __future__ import annotations

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.teacher.score_frames import (
    INT32_MAX,
    first_nan,
    floor_nonfinite,
    pack_answer,
    score_answer,
)

IDENTITY = {"teacher_id": "t", "weight_version": "3", "fingerprint": "f"}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def scores(nan: bool, seed: int = 0, device: str = "cpu"):
    """Padded scores of 4 rows (lengths 3, 0, 5, 2 of T = 6, K = 4) with ±inf at real and padding positions,
    a NaN in the top-k values, and (nan) NaNs in the log-probs at padding and at row 2, position 1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 0, 5, 2])
    lp = -torch.rand(4, 6, generator=g) * 5
    lp[0, 1], lp[2, 4], lp[3, 5] = float("-inf"), float("inf"), float("nan")
    if nan:
        lp[2, 1], lp[3, 0] = float("nan"), float("nan")
    vals, ids = torch.rand(4, 6, 50, generator=g).log().topk(4, dim=-1)
    vals[0, 0, -1], vals[2, 3, 0], vals[1, 0, 0] = float("-inf"), float("nan"), float("nan")
    return lengths, lp.to(device), ids.to(device), vals.to(device)


@pytest.mark.parametrize("vocab", [50, INT32_MAX + 2], ids=["int32-ids", "int64-ids"])
@pytest.mark.parametrize("topk", [True, False], ids=["topk", "logprobs-only"])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_packed_answer_is_the_score_answer_bitwise(vocab, topk, nan):
    lengths, lp, ids, vals = scores(nan)
    ids, vals = (ids, vals) if topk else (None, None)
    packed = pack_answer(lengths, lp, ids, vals, vocab)
    before = score_answer(lengths, lp, ids, vals, IDENTITY, vocab)
    assert bytes(packed.frame(IDENTITY).encode()) == bytes(before.encode())
    assert packed.nan == first_nan(lp, lengths) == ((2, 1, 2) if nan else None)
    rows = lengths.tolist()
    assert packed.rows(packed.logprobs) == [floor_nonfinite(lp)[b, :n].tolist() for b, n in enumerate(rows)]
    if topk:
        assert packed.rows(packed.topk_ids) == [ids[b, :n].tolist() for b, n in enumerate(rows)]
        want = [floor_nonfinite(vals)[b, :n].tolist() for b, n in enumerate(rows)]
        assert packed.rows(packed.topk_logprobs) == want
    else:
        assert packed.topk_ids is None and packed.topk_logprobs is None


def test_an_answer_with_no_response_tokens():
    lengths = torch.tensor([0, 0])
    packed = pack_answer(
        lengths, torch.zeros(2, 0), torch.zeros(2, 0, 3, dtype=torch.long), torch.zeros(2, 0, 3), 9
    )
    before = score_answer(
        lengths, torch.zeros(2, 0), torch.zeros(2, 0, 3, dtype=torch.long), torch.zeros(2, 0, 3), IDENTITY, 9
    )
    assert bytes(packed.frame(IDENTITY).encode()) == bytes(before.encode()) and packed.nan is None


@CUDA
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_device_packed_answer_equals_the_host_packed_one(nan):
    lengths, lp, ids, vals = scores(nan)
    host = pack_answer(lengths, lp, ids, vals, 50)
    device = pack_answer(lengths, *(t.to("cuda") for t in (lp, ids, vals)), 50)
    assert bytes(device.frame(IDENTITY).encode()) == bytes(host.frame(IDENTITY).encode())
    assert device.nan == host.nan and device.logprobs.device.type == "cpu"


@CUDA
def test_torch_engine_score_left_on_the_device_is_the_host_score(tmp_path):
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    ckpt = save_micro_qwen3(tmp_path / "model", seed=0, initializer_range=0.2)
    engine = TorchScoringEngine.from_pretrained(ckpt, device="cuda", max_batch_rows=2)
    batch = TokenBatch.from_rows([[1, 2, 3, 11, 12], [4, 5, 15], [6, 7, 8, 9, 16, 17]], [3, 2, 4], pad_id=0)
    lp, top = engine.score(batch, 5)
    dlp, dtop = engine.score(batch, 5, host=False)
    assert dlp.device.type == "cuda" and dtop.indices.device.type == "cuda"
    assert torch.equal(dlp.cpu(), lp) and torch.equal(dtop.indices.cpu(), top.indices)
    assert torch.equal(dtop.logprobs.cpu(), top.logprobs)
    packed = pack_answer(batch.response_lengths, dlp, dtop.indices, dtop.logprobs, engine.vocab_size)
    before = score_answer(batch.response_lengths, lp, top.indices, top.logprobs, IDENTITY, engine.vocab_size)
    assert bytes(packed.frame(IDENTITY).encode()) == bytes(before.encode())
