"""The leader/follower protocol of a tensor-parallel teacher replica (`engines/teacher/tensor_parallel.py`) on CPU: three
real processes in a gloo group, each with its vocabulary shard of a fake forward whose logits are
all-gathered over the group; the leader serves the teacher's HTTP routes, the test is its client.

Oracle: the same fake forward with the whole weight matrix in this process (no collective). Checks: /score
answers equal the oracle (≤ 1e-6, top-k ids equal), the followers ran every request (their log-prob sums equal
the leader's, bit for bit), offload/onload reach every rank, STOP ends every follower, all exit 0.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import helpers_fork
import pytest
import torch
from helpers_auth import TOKEN
from helpers_ports import free_port
from teacher_tp_prog import VOCAB, FakeTPEngine

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.teacher.client import TeacherClient

PROG = Path(__file__).with_name("teacher_tp_prog.py")
WORLD = 3


def batches() -> list[tuple[list[list[int]], list[int], int | None]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for count, k in ((5, 4), (9, None), (2, 48)):
        rows, starts = [], []
        for _ in range(count):
            prompt, response = (
                int(torch.randint(1, 6, (1,), generator=gen)),
                int(torch.randint(0, 8, (1,), generator=gen)),
            )
            rows.append(torch.randint(0, VOCAB, (prompt + response,), generator=gen).tolist())
            starts.append(prompt)
        out.append((rows, starts, k))
    return out


def test_leader_broadcasts_and_followers_run_the_same_forward(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        helpers_fork.popen(
            [str(PROG), str(tmp_path), str(r), str(WORLD), str(port), TOKEN],
            stdout=(tmp_path / f"rank{r}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "port.json").exists():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("leader did not start: " + (tmp_path / "rank0.log").read_text()[-2000:])
            time.sleep(0.05)
        url = f"http://127.0.0.1:{json.loads((tmp_path / 'port.json').read_text())['port']}"

        async def drive():
            answers = []
            async with TeacherClient(url, token=TOKEN, timeout_s=60) as client:
                for rows, starts, k in batches():
                    answers.append(await client.score_tensors(rows, starts, k))
                assert (await client.offload())["on_device"] is False
                assert (await client.onload())["on_device"] is True
            return answers

        answers = asyncio.run(drive())
        (tmp_path / "stop").touch()
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * WORLD, [(tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(WORLD)]
    oracle = FakeTPEngine()
    for (rows, starts, k), answer in zip(batches(), answers, strict=True):
        lp, top = oracle.score(TokenBatch.from_rows(rows, starts, pad_id=0), k)
        assert torch.equal(
            answer.lengths, torch.tensor([len(r) - s for r, s in zip(rows, starts, strict=True)])
        )
        want = torch.cat([lp[b, :n] for b, n in enumerate(answer.lengths.tolist())])
        assert (answer.logprobs - want).abs().max().item() <= 1e-6
        if k is not None:
            ids, vals = answer.padded_topk(top.indices.shape[1])
            mask = torch.arange(ids.shape[1]) < answer.lengths.unsqueeze(1)
            assert torch.equal(ids[mask], top.indices[mask])
            assert (vals[mask] - top.logprobs[mask]).abs().max().item() <= 1e-6
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["served"] for r in records] == [3] * WORLD  # every rank ran every /score
    assert all(r["sums"] == records[0]["sums"] for r in records[1:])  # the same forward, bit for bit
    assert all(r["resident"] for r in records)  # offload then onload reached every rank
