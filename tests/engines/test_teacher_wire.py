"""The teacher's frames (`engines/teacher/score_frames.py`): a request frame builds the batch the JSON body builds,
and a real `TeacherServer` on a real socket answers the same values bit for bit in both encodings, also
where the engine's log-probs are −inf or NaN (both become LOGPROB_FLOOR)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers_ports import free_port

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.frames.codec import WireError, decode
from mopd_hpc.engines.packed_batch import token_batch_from_packed
from mopd_hpc.engines.teacher.client import TeacherClient
from mopd_hpc.engines.teacher.http_app import TeacherServer
from mopd_hpc.engines.teacher.score_frames import LOGPROB_FLOOR, decode_score_request, encode_score_request
from mopd_hpc.mopd.topk import TeacherTopK

ROWS = [[1, 2, 3, 11, 12, 13], [4, 5, 15], [6, 7, 8, 9, 16, 17, 18, 19]]
STARTS = [3, 2, 4]
VOCAB = 32
FIELDS = ("input_ids", "attention_mask", "response_ids", "response_mask", "response_start")


@pytest.mark.parametrize("as_tensors", [False, True])
def test_request_frame_builds_the_json_batch(as_tensors):
    rows = [torch.tensor(r, dtype=torch.int32) for r in ROWS] if as_tensors else ROWS
    ids, lengths, starts, top_k = decode_score_request(decode(encode_score_request(rows, STARTS, 5)), VOCAB)
    packed = token_batch_from_packed(ids, lengths, starts, pad_id=0)
    listed = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    assert top_k == 5 and all(torch.equal(getattr(packed, f), getattr(listed, f)) for f in FIELDS)
    with pytest.raises(WireError, match=r"response_start\[1\] is 4; expected an int in \[1, 3\]"):
        decode_score_request(decode(encode_score_request(ROWS, [3, 4, 4], None)), VOCAB)
    with pytest.raises(WireError, match=r"input_ids\[2\]: expected token ids in \[0, 32\)"):
        decode_score_request(decode(encode_score_request(ROWS[:2] + [[6, 40]], [3, 2, 1], None)), VOCAB)


class NonFiniteEngine:
    """A stand-in scoring engine: seeded values with −inf, +inf and NaN at fixed places (a NaN sampled-token
    log-prob is a broken forward the server refuses, tests/mopd/test_numerical_edges.py: here the sampled
    log-probs carry ±inf only, the top-k a NaN too)."""

    vocab_size = VOCAB
    device = torch.device("cpu")

    def __init__(self) -> None:
        from mopd_hpc.engines.memory.residency import Residency

        self.residency = Residency(torch.nn.Linear(1, 1), self.device)

    def score(self, batch: TokenBatch, k: int | None = None, *, host: bool = True):  # CPU: host either way
        g = torch.Generator().manual_seed(batch.batch_size)
        shape = (batch.batch_size, batch.response_width)
        lp = -torch.rand(shape, generator=g) * 5
        lp[0, 1], lp[2, 0] = float("-inf"), float("inf")
        if k is None:
            return lp, None
        vals, ids = torch.rand(*shape, VOCAB, generator=g).log().topk(k, dim=-1)
        vals[0, 0, -1], vals[2, 3, 0] = float("-inf"), float("nan")
        return lp, TeacherTopK(ids, vals)


def test_both_encodings_agree_bitwise_with_nonfinite_values(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    engine = NonFiniteEngine()
    server = TeacherServer(engine, "t", str(tmp_path))  # type: ignore[arg-type]

    async def scenario():
        from aiohttp import web

        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            async with TeacherClient(url, binary=False) as js, TeacherClient(url) as binary:
                return (
                    await js.score(ROWS, STARTS, 4),
                    await binary.score(ROWS, STARTS, 4),
                    await binary.score_tensors(ROWS, STARTS, 4),
                )
        finally:
            await runner.cleanup()

    from_json, from_binary, packed = asyncio.run(scenario())
    assert from_binary == from_json
    assert from_json.logprobs[0][1] == LOGPROB_FLOOR and from_json.logprobs[2][0] == LOGPROB_FLOOR
    assert from_json.topk_logprobs[0][0][-1] == LOGPROB_FLOOR == from_json.topk_logprobs[2][3][0]
    batch = TokenBatch.from_rows(ROWS, STARTS, 0)
    lp, top = engine.score(batch, 4)
    mask, f = batch.response_mask, LOGPROB_FLOOR
    want = torch.nan_to_num(lp[mask], nan=f, posinf=f, neginf=f)
    assert torch.equal(packed.logprobs.view(torch.int32), want.view(torch.int32))
    want_top = torch.nan_to_num(top.logprobs[mask], nan=f, posinf=f, neginf=f)
    assert torch.equal(packed.topk_logprobs.view(torch.int32), want_top.view(torch.int32))
    assert torch.equal(packed.topk_ids.long(), top.indices[mask])
    ids, vals = packed.padded_topk(batch.response_width)
    assert torch.equal(ids[mask], top.indices[mask]) and not ids[~mask].any() and not vals[~mask].any()
    assert torch.equal(vals[mask].view(torch.int32), want_top.view(torch.int32))
    padded = packed.padded_logprobs()
    assert padded.shape == (3, 4) and padded[~mask].isnan().all()
    with pytest.raises(WireError, match=r"width=3: a row has 4 response tokens; expected width >= 4"):
        packed.padded_topk(3)
