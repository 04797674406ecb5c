"""The embedded CPU config (configs/local_cpu.yaml: rollout.mode colocated) run by `mopd-submit --local` twice,
once with the torch broadcast (gloo) and once with weight_sync.backend ipc (a /dev/shm buffer): both deliver
the actor's float32 weights bitwise, so step 2's rollouts (sampled with the weights synced after step 1) and
everything computed from them are the same. Oracle: the broadcast run's metrics lines, timings aside.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers_configs import without_sft_warmup
from helpers_jobs import submit_local

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local_cpu.yaml"
#: Metrics that are not functions of the weights and data (wall time, memory).
UNTIMED = ("time/", "perf/", "memory/")


def run(models: Path, tmp: Path, backend: str) -> list[dict]:
    doc = without_sft_warmup(yaml.safe_load(LOCAL.read_text()))  # step 2 samples the student
    doc["run_dir"] = str(tmp / "run")
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(models / "student")
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(models / name)
    doc.update(steps=2, checkpoint_interval=2)
    doc["data"].update(batch_size=4)
    doc["data"]["eval"]["size"] = 4
    doc["weight_sync"] = {"backend": backend}
    config = tmp / "c.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = submit_local(config, cwd=tmp, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ipc_run_matches_the_broadcast_run(micro_models: Path, tmp_path: Path) -> None:
    models = micro_models
    (tmp_path / "torch").mkdir()
    (tmp_path / "ipc").mkdir()
    broadcast = run(models, tmp_path / "torch", "torch")
    shared = run(models, tmp_path / "ipc", "ipc")
    assert [m["step"] for m in shared] == [1, 2]
    assert {k for k in shared[1] if k.startswith("time/sync/")} == {
        f"time/sync/{s}_s" for s in ("export", "fill", "post", "copy")
    }
    for a, b in zip(broadcast, shared, strict=True):
        same = {k: v for k, v in a.items() if k != "ts" and not k.startswith(UNTIMED)}
        assert {k: b[k] for k in same} == same
