"""The teacher server as a real subprocess (`python -m mopd_hpc.roles.teacher`) on a real port.

Configured through the environment, as the guard starts it (MOPD_TEACHER_ID, MOPD_MODEL_PATH,
MOPD_PORT_HTTP=0, MOPD_RUN_DIR); driven through `TeacherClient`. Oracle: an in-process transformers
forward of the same checkpoint, float64 log_softmax.
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
from helpers_models import save_micro_qwen3

from mopd_hpc.engines.teacher_serve import endpoint_path
from mopd_hpc.engines.teacher_server import TeacherClient, TeacherClientError, checkpoint_fingerprint
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


async def call(url: str, method: str, *args, **kwargs):
    async with TeacherClient(url, timeout_s=60, token=TOKEN) as client:
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
        proc = subprocess.Popen(
            [sys.executable, "-m", "mopd_hpc.roles.teacher", "--num-threads", "1"],
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


def test_bad_requests_are_400_naming_the_field(server):
    with pytest.raises(TeacherClientError, match=r"response_start\[1\] is 0") as err:
        run(call(server["url"], "score", ROWS, [3, 0, 4]))
    assert err.value.status == 400
    with pytest.raises(TeacherClientError, match=r"input_ids\[0\]: expected token ids in \[0, 32\)"):
        run(call(server["url"], "score", [[1, 99]], [1]))
    with pytest.raises(TeacherClientError, match="top_k is 0"):
        run(call(server["url"], "score", ROWS, STARTS, top_k=0))


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
