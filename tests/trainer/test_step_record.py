"""The actor group's control records (trainer/step_record.py): bit-exact round trip through the wire format,
binary buffers (no JSON floats), the shard views every rank builds its TrainBatch from, and malformed input."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.trainer.step_record import ControlRecord, RecordError


def step_record(orm: bool = True) -> ControlRecord:
    gen = torch.Generator().manual_seed(3)
    rows = [[1, 5, 6, 7], [1, 2, 9], [1, 4, 4, 4, 4, 8], [3, 3]]
    starts = [2, 2, 3, 1]
    tokens = TokenBatch.from_rows(rows, starts, pad_id=0)
    mu = -torch.rand((4, tokens.response_width), generator=gen) * 3
    mu = torch.where(tokens.response_mask, mu, 0.0)
    advantages = torch.randn(4, generator=gen) if orm else None
    return ControlRecord.from_rows(7, rows, starts, ["chain", "legs", "chain", "legs"], mu, advantages, 0)


@pytest.mark.parametrize("orm", [True, False])
def test_round_trip_is_bit_exact(orm):
    record = step_record(orm)
    data = record.to_bytes()
    back = ControlRecord.from_bytes(data)
    assert back == record
    # μ's float32 bits survive: the same bytes again
    assert back.to_bytes() == data
    # one engines/frames/codec.py frame: a safetensors file of int32/float32 buffers (no JSON floats)
    tensors = safetensors.torch.load(bytes(data))
    expected = {"tokens": 15, "row_lengths": 4, "starts": 4, "mu": 7, **({"orm": 4} if orm else {})}
    assert {name: t.numel() for name, t in tensors.items()} == expected
    assert {name: t.dtype for name, t in tensors.items()} == {
        name: torch.float32 if name in ("mu", "orm") else torch.int32 for name in expected
    }
    (n,) = struct.unpack_from("<Q", data)
    assert len(data) == 8 + n + 4 * sum(expected.values())
    assert "mu" not in json.loads(data[8 : 8 + n])["__metadata__"]["mopd.meta"]


def test_shard_views_equal_the_full_batch_rows():
    record = step_record()
    full = record.tokens(0, 4)
    mu_full = record.behavior(full, 0, 4)
    part = record.tokens(1, 3)
    mu_part = record.behavior(part, 1, 3)
    width = part.response_width
    assert torch.equal(part.response_ids, full.response_ids[1:3, :width])
    assert torch.equal(part.response_mask, full.response_mask[1:3, :width])
    assert torch.equal(mu_part, mu_full[1:3, :width])
    assert torch.equal(record.orm_advantages(1, 3), torch.tensor(record.orm[1:3], dtype=torch.float32))
    assert record.response_lengths == (2, 1, 3, 1)


def test_start_and_stop_records():
    for record in (
        ControlRecord.start(0),
        ControlRecord.start(12),
        ControlRecord.stop(3, "checkpoint_signal"),
    ):
        assert ControlRecord.from_bytes(record.to_bytes()) == record
    with pytest.raises(RecordError, match="stop reason='later'"):
        ControlRecord.stop(3, "later")
    with pytest.raises(RecordError, match="kind='go'"):
        ControlRecord("go", 1)


def test_inconsistent_and_malformed_records_are_refused():
    with pytest.raises(RecordError, match="row 0: 1 behavior log-probs for 2 response tokens"):
        ControlRecord("step", 1, rows=((1, 2, 3),), starts=(1,), routes=("a",), mu=((0.5,),))
    with pytest.raises(RecordError, match="needs at least one row"):
        ControlRecord("step", 1)
    data = step_record().to_bytes()
    with pytest.raises(RecordError, match="truncated frame"):
        ControlRecord.from_bytes(data[:-3])
    with pytest.raises(RecordError, match="after the last tensor"):
        ControlRecord.from_bytes(data + b"\0")
    with pytest.raises(RecordError, match="not a control record"):
        ControlRecord.from_bytes(b"\x01")


def test_weights_and_checkpoint_records_round_trip():
    for record in (
        ControlRecord.weights(3, "sync"),
        ControlRecord.weights(0, "export"),
        ControlRecord.checkpoint(4),
    ):
        back = ControlRecord.from_bytes(record.to_bytes())
        assert back == record and back.rows == ()
    assert ControlRecord.weights(3, "evaluate").kind == "weights"
    with pytest.raises(RecordError, match="weights reason='train': expected one of"):
        ControlRecord.weights(3, "train")
