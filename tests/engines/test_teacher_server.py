"""The teacher server as a real subprocess (`python -m mopd_hpc.roles.teacher`) on a real port.

Configured through the environment, as the guard starts it (MOPD_TEACHER_ID, MOPD_MODEL_PATH,
MOPD_PORT_HTTP=0, MOPD_RUN_DIR); driven through `TeacherClient`. Oracle: an in-process transformers
forward of the same checkpoint, float64 log_softmax.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import helpers_fork
import pytest
import torch
from helpers_auth import AUTH, TOKEN, write_run_dir_token
from helpers_models import save_micro_qwen3

from mopd_hpc.engines.teacher.client import TeacherClient, TeacherClientError
from mopd_hpc.engines.teacher.http_app import checkpoint_fingerprint
from mopd_hpc.engines.teacher.process import endpoint_path
from mopd_hpc.records.endpoint import read_endpoint
from mopd_hpc.roles.teacher import args_from_argv

VOCAB = 32
ROWS = [[1, 2, 3, 11, 12, 13], [4, 5, 15], [6, 7, 8, 9, 16, 17, 18, 19]]
STARTS = [3, 2, 4]
STARTUP_DEADLINE_S = 120


def direct_scores(
    path: Path, k: int
) -> tuple[list[list[float]], list[list[list[int]]], list[list[list[float]]]]:
    """Per-row response log-probs and top-k from a plain in-process forward (float64 softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    lps, ids, vals = [], [], []
    with torch.no_grad():
        for row, start in zip(ROWS, STARTS, strict=True):
            logp = torch.log_softmax(model(torch.tensor([row])).logits[0].double(), -1)[
                start - 1 : len(row) - 1
            ]
            lps.append(logp.gather(1, torch.tensor(row[start:])[:, None])[:, 0].tolist())
            top = logp.topk(min(k, VOCAB), -1)
            ids.append(top.indices.tolist())
            vals.append(top.values.tolist())
    return lps, ids, vals


def run(coro):
    return asyncio.run(coro)


async def call(url: str, method: str, *args, binary: bool = True, **kwargs):
    async with TeacherClient(url, timeout_s=60, binary=binary, token=TOKEN) as client:
        return await getattr(client, method)(*args, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    model = save_micro_qwen3(root / "teacher", seed=1, vocab_size=VOCAB, initializer_range=0.2)
    run_dir = root / "run"
    write_run_dir_token(run_dir)  # the standalone server reads the run dir's token file
    env = dict(os.environ) | {
        "MOPD_TEACHER_ID": "t1",
        "MOPD_MODEL_PATH": str(model),
        "MOPD_PORT_HTTP": "0",
        "MOPD_RUN_DIR": str(run_dir),
        "MOPD_DEVICE": "cpu",
    }
    log_path = root / "teacher.log"
    with open(log_path, "wb") as log:
        proc = helpers_fork.popen(
            ["-m", "mopd_hpc.roles.teacher", "--num-threads", "1"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    endpoint = endpoint_path(run_dir, "t1")
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while not endpoint.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"teacher server did not start (rc {proc.poll()}); log:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.1)
        record = json.loads(endpoint.read_text())
        yield {
            "proc": proc,
            "model": model,
            "record": record,
            "url": record["url"],
            "log": log_path,
            "endpoint": endpoint,
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_endpoint_file_and_health(server):
    record = server["record"]
    assert record["teacher_id"] == "t1" and record["host"] == "127.0.0.1" and record["port"] > 0
    assert record["pid"] == server["proc"].pid
    assert record["url"] == f"http://127.0.0.1:{record['port']}"
    assert record["fingerprint"] == checkpoint_fingerprint(server["model"])
    assert read_endpoint(server["endpoint"]).to_json() == record  # written through records/endpoint.py
    health = run(call(server["url"], "health"))
    assert health == {
        "status": "ok",
        "resident": True,
        "teacher_id": "t1",
        "weight_version": "1",
        "fingerprint": record["fingerprint"],
    }


def test_score_equals_direct_forward_with_topk(server):
    want_lp, want_ids, want_vals = direct_scores(server["model"], k=5)
    plain = run(call(server["url"], "score", ROWS, STARTS))
    assert plain.topk_ids is None and plain.topk_logprobs is None and plain.weight_version == "1"
    assert [len(r) for r in plain.logprobs] == [3, 1, 4]
    for got, want in zip(plain.logprobs, want_lp, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    top = run(call(server["url"], "score", ROWS, STARTS, top_k=5))
    assert [[len(pos) for pos in row] for row in top.topk_ids] == [[5] * 3, [5], [5] * 4]
    assert top.topk_ids == want_ids
    for got, want in zip(top.topk_logprobs, want_vals, strict=True):
        assert [v for pos in got for v in pos] == pytest.approx([v for pos in want for v in pos], abs=1e-5)
    wide = run(call(server["url"], "score", ROWS, STARTS, top_k=10 * VOCAB))
    assert {len(pos) for row in wide.topk_ids for pos in row} == {VOCAB}  # K = min(top_k, V)
    assert sorted(wide.topk_ids[0][0]) == list(range(VOCAB))


def test_binary_transport_equals_json_and_the_engine_bit_for_bit(server):
    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    async def both():
        async with (
            TeacherClient(server["url"], binary=False, token=TOKEN) as js,
            TeacherClient(server["url"], token=TOKEN) as binary,
        ):
            return (
                await js.score(ROWS, STARTS, top_k=5),
                await binary.score(ROWS, STARTS, top_k=5),
                await binary.score_tensors(ROWS, STARTS, top_k=5),
                await binary.score_tensors(ROWS, STARTS),
            )

    from_json, from_binary, packed, plain = run(both())
    assert from_binary == from_json  # the same lists of Python floats, exactly
    assert (packed.logprobs.dtype, packed.topk_ids.dtype, packed.topk_logprobs.dtype) == (
        torch.float32,
        torch.int32,
        torch.float32,
    )
    assert packed.lengths.tolist() == [3, 1, 4] and packed.topk_ids.shape == (8, 5)
    flat = torch.tensor([v for row in from_json.logprobs for v in row], dtype=torch.float32)
    assert torch.equal(flat.view(torch.int32), packed.logprobs.view(torch.int32))  # bitwise
    vals = torch.tensor([p for row in from_json.topk_logprobs for p in row], dtype=torch.float32)
    assert torch.equal(vals.view(torch.int32), packed.topk_logprobs.view(torch.int32))
    assert plain.topk_ids is None and torch.equal(plain.logprobs.view(torch.int32), flat.view(torch.int32))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's --num-threads: the same kernels, the same bits
    try:
        engine = TorchScoringEngine.from_pretrained(server["model"])
        batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
        lp, top = engine.score(batch, 5)
    finally:
        torch.set_num_threads(threads)
    mask = batch.response_mask
    assert torch.equal(lp[mask].view(torch.int32), packed.logprobs.view(torch.int32))
    assert torch.equal(top.indices[mask], packed.topk_ids.long())
    assert torch.equal(top.logprobs[mask].view(torch.int32), packed.topk_logprobs.view(torch.int32))
    ids, values = packed.padded_topk(batch.response_width)
    assert torch.equal(ids[mask], top.indices[mask]) and not ids[~mask].any() and not values[~mask].any()
    padded = packed.padded_logprobs(batch.response_width)
    assert torch.equal(padded[mask], lp[mask]) and padded[~mask].isnan().all()


@pytest.mark.parametrize("binary", [True, False])
def test_bad_requests_are_400_naming_the_field(server, binary):
    with pytest.raises(TeacherClientError, match=r"response_start\[1\] is 0") as err:
        run(call(server["url"], "score", ROWS, [3, 0, 4], binary=binary))
    assert err.value.status == 400
    with pytest.raises(TeacherClientError, match=r"input_ids\[0\]: expected token ids in \[0, 32\)"):
        run(call(server["url"], "score", [[1, 99]], [1], binary=binary))
    with pytest.raises(TeacherClientError, match="top_k is 0"):
        run(call(server["url"], "score", ROWS, STARTS, top_k=0, binary=binary))


def test_malformed_frames_are_400_and_the_server_keeps_serving(server):
    from mopd_hpc.engines.frames.codec import encode
    from mopd_hpc.engines.frames.over_http import FRAME_HEADERS
    from mopd_hpc.engines.teacher.score_frames import encode_score_request

    good = encode_score_request(ROWS, STARTS, 2)
    bad = {
        "truncated": (bytes(good)[:-3], r"truncated frame: tensor '\w+' needs data bytes"),
        "not a frame": (b"{}", r"truncated frame: 2 bytes; expected at least 8"),
        "float ids": (
            encode(
                {
                    "input_ids": torch.zeros(3),
                    "row_lengths": torch.tensor([3]),
                    "response_start": torch.tensor([1]),
                }
            ),
            r"tensor 'input_ids' is F32 of shape \[3\]; expected I32 or I64 with 1 dims",
        ),
        "lengths": (
            encode(
                {
                    "input_ids": torch.zeros(3, dtype=torch.int64),
                    "row_lengths": torch.tensor([2]),
                    "response_start": torch.tensor([1]),
                }
            ),
            r"row_lengths sum to 2; input_ids holds 3 tokens",
        ),
    }

    async def post_all():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            out = {}
            for name, (body, _) in bad.items():
                async with session.post(server["url"] + "/score", data=body, headers=FRAME_HEADERS) as resp:
                    out[name] = (resp.status, resp.content_type, (await resp.json())["error"]["message"])
            return out

    for name, (status, kind, message) in run(post_all()).items():
        assert (status, kind) == (400, "application/json"), name
        assert re.search(bad[name][1], message), (name, message)
    assert len(run(call(server["url"], "score", ROWS, STARTS)).logprobs) == 3


def test_offload_onload_on_cpu_are_noops(server):
    off = run(call(server["url"], "offload"))
    assert (off["action"], off["moved"], off["bytes_moved"], off["device"]) == ("offload", False, 0, "cpu")
    on = run(call(server["url"], "onload"))
    assert on["action"] == "onload" and on["moved"] is False
    assert len(run(call(server["url"], "score", ROWS, STARTS)).logprobs) == 3


def test_reload_only_when_checkpoint_changes(server):
    model = server["model"]
    first = run(call(server["url"], "reload"))
    assert first["reloaded"] is False and first["weight_version"] == "1"
    old = run(call(server["url"], "score", ROWS, STARTS)).logprobs
    time.sleep(0.01)  # a distinct mtime even on coarse-clock filesystems
    save_micro_qwen3(
        model, seed=2, vocab_size=VOCAB, initializer_range=0.2
    )  # a different checkpoint at the same path
    second = run(call(server["url"], "reload"))
    assert second["reloaded"] is True and second["weight_version"] == "2"
    assert second["fingerprint"] == checkpoint_fingerprint(model) != first["fingerprint"]
    new = run(call(server["url"], "score", ROWS, STARTS))
    want, _, _ = direct_scores(model, k=1)
    assert new.weight_version == "2"
    for got, expected, before in zip(new.logprobs, want, old, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
        assert got != pytest.approx(before, abs=1e-3)
    assert run(call(server["url"], "reload"))["reloaded"] is False


def test_sigterm_stops_cleanly(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert "teacher server t1 stopping" in server["log"].read_text()
    assert not server["endpoint"].exists()  # no stale endpoint left for the controller


def test_args_come_from_flags_or_environment():
    env = {"MOPD_TEACHER_ID": "a", "MOPD_MODEL_PATH": "/m", "MOPD_PORT_HTTP": "23456", "MOPD_HOST": "n1"}
    args = args_from_argv([], env)
    assert (args.teacher_id, args.model_path, args.port, args.host, args.advertise_host) == (
        "a",
        "/m",
        23456,
        "127.0.0.1",
        "127.0.0.1",
    )
    args = args_from_argv(["--teacher-id", "b", "--host", "0.0.0.0", "--port", "1"], env)
    assert (args.teacher_id, args.port, args.advertise_host) == ("b", 1, "n1")
    with pytest.raises(SystemExit) as exit_info:
        args_from_argv([], {"MOPD_MODEL_PATH": "/m", "MOPD_PORT_HTTP": "1"})
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        args_from_argv([], env | {"MOPD_PORT_HTTP": "http"})
