"""configs/local_cpu_moe.yaml through `mopd-submit --local` on micro models (the builder's micro dense teachers and
micro Qwen3-MoE student): 2 steps of the whole job with the router's load-balancing loss and rollout routing
replay, then its evaluation. Oracles: the metrics contract; the load-balancing loss E·Σ f_i·P_i ≥ 1 (equality
when balanced); the train/inference mismatch of step 1 (rollout and actor hold the same float32 weights and,
with replay, route every response token to the same experts: |log π_θ − log μ| is rounding only)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers_jobs import submit_local
from helpers_models import load_builder
from test_controller import assert_metrics, micro_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def micro_models(micro_models: Path, tmp_path_factory) -> Path:
    """The shared micro models copied, with the micro MoE student built beside them."""
    import torch

    out = tmp_path_factory.mktemp("models") / "micro"
    shutil.copytree(micro_models, out)
    before = torch.get_num_threads()
    try:
        argv = ["--out", str(out), "--micro", "--threads", "1", "--only", "student_moe"]
        assert load_builder().main(argv) == 0
    finally:
        torch.set_num_threads(before)
    return out


def test_local_cpu_moe_runs_two_steps_and_writes_its_evaluation(micro_models: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = micro_config(
        micro_models, run_dir, tmp_path / "moe.yaml", "local_cpu_moe.yaml", "student_moe", steps=2
    )
    proc = submit_local(config, cwd=tmp_path, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = assert_metrics(run_dir, 2)
    for line in lines:
        assert (
            math.isfinite(line["router/load_balancing_loss"])
            and line["router/load_balancing_loss"] >= 1.0 - 1e-6
        )
        assert line["router/z_loss"] > 0
    assert lines[0]["mopd/logprob_mismatch"] < 1e-4, lines[0]["mopd/logprob_mismatch"]
    record = json.loads((run_dir / "eval.json").read_text())
    assert sorted(record["routes"]) == ["chain", "legs"]
    assert record["student_weights"] == {"start": "0", "end": "2"}
    assert "end/teacher" in proc.stdout
