"""The embedded CPU config (configs/local_cpu.yaml: rollout.mode colocated) run by `mopd-submit --local` twice,
once with the torch broadcast (gloo) and once with weight_sync.backend ipc (a /dev/shm buffer): both deliver
the actor's float32 weights bitwise, so step 2's rollouts (sampled with the weights synced after step 1) and
everything computed from them are the same. Oracle: the broadcast run's metrics lines, timings aside; the
broadcast run is conftest's `plain_run` (the default weight sync; run once for the test run, shared with the
other tests that compare with such a run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers_jobs import PLAIN_STEPS, PlainRun, plain_config, submit_local

#: Metrics that are not functions of the weights and data (wall time, memory).
UNTIMED = ("time/", "perf/", "memory/")


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ipc_run_matches_the_broadcast_run(micro_models: Path, plain_run: PlainRun, tmp_path: Path) -> None:
    resolved = yaml.safe_load((plain_run.run_dir / "config.yaml").read_text())
    assert resolved["weight_sync"]["backend"] == "torch"  # the shared run synced by broadcast
    broadcast = metric_lines(plain_run.run_dir)
    config = plain_config(
        micro_models, tmp_path / "run", tmp_path / "c.yaml", **{"weight_sync.backend": "ipc"}
    )
    proc = submit_local(config, cwd=tmp_path, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shared = metric_lines(tmp_path / "run")
    assert [m["step"] for m in shared] == list(range(1, PLAIN_STEPS + 1))
    assert {k for k in shared[1] if k.startswith("time/sync/")} == {
        f"time/sync/{s}_s" for s in ("export", "fill", "post", "copy")
    }
    for a, b in zip(broadcast, shared, strict=True):
        same = {k: v for k, v in a.items() if k != "ts" and not k.startswith(UNTIMED)}
        assert {k: b[k] for k in same} == same
