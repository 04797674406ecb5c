"""The megatron teacher behind the real teacher server, on one GPU (issue 8): `python -m
mopd_hpc.roles.teacher` with engine megatron, dtype float32, device cuda:0 as a subprocess, driven over
HTTP by the controller's `TeacherClient`; oracle: `TorchScoringEngine` on the same checkpoint (float32, CPU).

The micro Qwen3 has vocab_size 250 (megatron's usual padding would make it 256): every token id and every
top-k id must be < 250. Tolerances (float32): log-probs and top-k log-probs within 2e-4 of the oracle; top-k
ids equal wherever the oracle's top-(k+1) log-probs are more than 1e-4 apart (closer ones may swap order
under float32 rounding; their log-probs are still compared). Offload → /score answers 503 → onload → the
same numbers bit for bit. /reload of a changed checkpoint (`load_weights`) → the new checkpoint's scores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers_auth import TOKEN, write_run_dir_token

from mopd_hpc.engines.batch import TokenBatch

REPO = Path(__file__).resolve().parents[2]
VOCAB = 250
TOP_K = 4
TOL = 2e-4
TIE_GAP = 1e-4
STARTUP_DEADLINE_S = 150
ROWS = [
    [5, 17, 42, 99, 3, 201, 77, 14, 249, 8],
    [120, 33, 7, 240, 61],
    [9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99, 108, 117, 126],
]
STARTS = [4, 2, 6]


def save_checkpoint(path: Path, seed: int) -> Path:
    """The micro Qwen3 of the brief: hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, tied embeddings,
    float32 weights (initializer_range 0.2: peaked distributions, few near-ties in the top-k)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
        initializer_range=0.2,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(str(path))
    return path


def oracle(path: Path) -> tuple[list[list[float]], list[list[list[int]]], list[list[list[float]]]]:
    """Per row: response log-probs, top-(k+1) ids and log-probs, from `TorchScoringEngine` on the CPU."""
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    engine = TorchScoringEngine.from_pretrained(path, dtype="float32", device="cpu")
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    lp, top = engine.score(batch, TOP_K + 1)
    n = batch.response_lengths.tolist()
    return (
        [lp[b, : n[b]].tolist() for b in range(len(ROWS))],
        [top.indices[b, : n[b]].tolist() for b in range(len(ROWS))],
        [top.logprobs[b, : n[b]].tolist() for b in range(len(ROWS))],
    )


def assert_matches(got, expected) -> None:
    """`got` (a ScoreResponse with top-k) against the oracle, to the module docstring's tolerances."""
    lps, ids, vals = expected
    assert [len(r) for r in got.logprobs] == [len(r) for r in lps]
    err = max(
        abs(a - b) for row, ref in zip(got.logprobs, lps, strict=True) for a, b in zip(row, ref, strict=True)
    )
    assert err < TOL, err
    compared = total = 0
    for b in range(len(ROWS)):
        for t in range(len(lps[b])):
            got_ids, got_vals = got.topk_ids[b][t], got.topk_logprobs[b][t]
            assert len(got_ids) == TOP_K and all(0 <= i < VOCAB for i in got_ids), got_ids
            assert max(abs(a - e) for a, e in zip(got_vals, vals[b][t][:TOP_K], strict=True)) < TOL
            total += 1
            ref = vals[b][t]
            if min(ref[i] - ref[i + 1] for i in range(TOP_K)) > TIE_GAP:
                assert got_ids == ids[b][t][:TOP_K], (b, t, got_ids, ids[b][t])
                compared += 1
    assert compared >= 0.8 * total, (compared, total)


def wait_for_endpoint(proc: subprocess.Popen, endpoint: Path, log_path: Path) -> dict:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        if endpoint.exists():
            return json.loads(endpoint.read_text())
        if proc.poll() is not None:
            pytest.fail(f"teacher server exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no endpoint after {STARTUP_DEADLINE_S} s:\n{log_path.read_text()[-4000:]}")


async def exercise(url: str, ckpt: Path) -> dict:
    """Score, offload (503 while offloaded), onload, score, reload a changed checkpoint, score."""
    from mopd_hpc.engines.teacher.client import TeacherClient, TeacherClientError

    out: dict = {}
    async with TeacherClient(url, timeout_s=120, token=TOKEN) as client:
        health = await client.health()
        assert (health["teacher_id"], health["resident"], health["weight_version"]) == ("mt", True, "1")
        out["scored"] = await client.score(ROWS, STARTS, top_k=TOP_K)
        out["no_topk"] = await client.score(ROWS, STARTS)
        out["offload"] = await client.offload()
        out["resident_offloaded"] = (await client.health())["resident"]
        with pytest.raises(TeacherClientError) as err:
            await client.score(ROWS, STARTS, top_k=TOP_K)
        out["offloaded_status"] = err.value.status
        out["onload"] = await client.onload()
        out["rescored"] = await client.score(ROWS, STARTS, top_k=TOP_K)
        save_checkpoint(ckpt, seed=1)  # new weights, new mtime: a new fingerprint
        out["reload"] = await client.reload()
        out["reloaded"] = await client.score(ROWS, STARTS, top_k=TOP_K)
    return out


@pytest.mark.gpu
def test_megatron_teacher_server_matches_torch_engine(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    ckpt = save_checkpoint(tmp_path / "ckpt", seed=0)
    expected = oracle(ckpt)
    run_dir = tmp_path / "run"
    write_run_dir_token(run_dir)  # the standalone server reads the run dir's token file
    env = dict(os.environ) | {
        "MOPD_TEACHER_ID": "mt",
        "MOPD_MODEL_PATH": str(ckpt),
        "MOPD_PORT_HTTP": "0",
        "MOPD_RUN_DIR": str(run_dir),
        "MOPD_DEVICE": "cuda:0",
        "MOPD_DTYPE": "float32",
        "MOPD_TEACHER_ENGINE": "megatron",
    }
    log_path = tmp_path / "teacher.log"
    endpoint = run_dir / "endpoints" / "teacher-mt.r0.json"  # replica 0 of a standalone server
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mopd_hpc.roles.teacher", "--max-batch-rows", "2"],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        record = wait_for_endpoint(proc, endpoint, log_path)
        out = asyncio.run(exercise(record["url"], ckpt))
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert rc == 0, text[-4000:]
    assert "engine megatron, device cuda:0" in text
    assert not endpoint.exists()  # removed on a clean stop
    # scoring: the megatron teacher equals the torch engine (top-k from the full logits, no padding id)
    assert_matches(out["scored"], expected)
    assert out["no_topk"].topk_ids is None
    labels_err = max(
        abs(a - b)
        for row, ref in zip(out["no_topk"].logprobs, expected[0], strict=True)
        for a, b in zip(row, ref, strict=True)
    )
    assert labels_err < TOL, labels_err
    # residency: parameters to the host and back, the same numbers after
    assert out["offload"]["moved"] is True and out["offload"]["bytes_moved"] > 0
    assert out["offload"]["device"] == "cuda:0"
    assert out["resident_offloaded"] is False and out["offloaded_status"] == 503
    assert out["onload"]["moved"] is True and out["onload"]["bytes_moved"] == out["offload"]["bytes_moved"]
    assert out["rescored"].logprobs == out["scored"].logprobs
    assert out["rescored"].topk_ids == out["scored"].topk_ids
    assert out["rescored"].topk_logprobs == out["scored"].topk_logprobs
    # reload: load_weights of the changed checkpoint, scored like the torch engine on it
    assert out["reload"]["reloaded"] is True and out["reload"]["weight_version"] == "2"
    assert out["reloaded"].weight_version == "2"
    assert_matches(out["reloaded"], oracle(ckpt))
    assert out["reloaded"].logprobs != out["scored"].logprobs
