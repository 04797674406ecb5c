"""Teachers of different shapes on two routes (issue 17): the main job trains with a chain teacher of hidden
size 16 and one layer and a legs teacher of hidden size 24 and two layers (the same character tokenizer),
the legs teacher served by two replicas.

Real parts: the teacher and rollout role entry points as subprocesses with a guard's environment (each legs
replica its own child, MOPD_TEACHER_REPLICA), the controller in-process as rank 0 of a one-rank actor
(`test_controller.run_controller`), the compatibility check the actor role runs before training. Checks: the
run finishes its 3 steps with finite contract metrics, both teachers scored every step, each legs replica
served (its log says so) and every server exited 0 on the end of the job.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers_models import load_builder
from test_controller import assert_metrics, micro_config, run_controller

from mopd_hpc.config import load_run_config
from mopd_hpc.mopd.compatibility import ModelFiles, check_models
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.roles.actor import check_compatibility

#: The second teacher's shape (the micro chain teacher: hidden 16, 1 layer, 2 heads).
WIDE = {"hidden_size": 24, "num_layers": 2, "num_heads": 2}


@pytest.fixture(scope="module")
def models(micro_models: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "micro"
    shutil.copytree(micro_models, out)  # the shared models stay as built: a wide teacher joins them here
    builder = load_builder()
    legs = next(s for s in builder.MICRO_SPECS if s.name == "teacher_leg_counting")
    spec = dataclasses.replace(legs, name="teacher_legs_wide", **WIDE)
    builder.build_model(spec, out, builder.build_char_tokenizer())
    return out


def test_two_teachers_of_different_shapes_on_two_routes(models: Path, tmp_path: Path) -> None:
    chain = json.loads((models / "teacher_chain_sum" / "config.json").read_text())
    legs = json.loads((models / "teacher_legs_wide" / "config.json").read_text())
    assert (chain["hidden_size"], chain["num_hidden_layers"]) == (16, 1)
    assert (legs["hidden_size"], legs["num_hidden_layers"]) == (24, 2)
    run_dir = tmp_path / "run"
    config = micro_config(models, run_dir, tmp_path / "c.yaml", **{"loss.estimator": "topk"})
    doc = yaml.safe_load(config.read_text())
    doc["models"]["teachers"][1]["path"] = str(models / "teacher_legs_wide")
    doc["models"]["teachers"][1]["replicas"] = 2
    config.write_text(yaml.safe_dump(doc))
    cfg = load_run_config(config)
    check_compatibility(cfg, ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids))
    report = check_models(
        ModelFiles("actor", str(models / "student")),
        [
            ModelFiles("chain", str(models / "teacher_chain_sum")),
            ModelFiles("legs", str(models / "teacher_legs_wide")),
        ],
    )
    assert len(set(dict(report.architecture_digests).values())) == 3  # three shapes, one tokenizer

    controller, outcome, codes, out = run_controller(config, run_dir, "job-shapes")
    assert (outcome.reason, outcome.step) == ("finished", 3) and codes == [0, 0, 0, 0], out
    lines = assert_metrics(run_dir, 3)
    assert all(line["time/teacher_s"] > 0 for line in lines)
    assert all(line["mopd/reverse_kl"] >= -1e-6 for line in lines)  # top-k ≥ vocabulary: an exact KL
    logs = {p.name: p.read_text() for p in run_dir.glob("teacher-*.log")}
    assert len(logs) == 3
    ready = [line for text in logs.values() for line in text.splitlines() if "teacher server ready" in line]
    assert sorted(r.split("teacher server ready: ")[1].split(" on ")[0] for r in ready) == [
        "chain replica 0",
        "legs replica 0",
        "legs replica 1",
    ]
    assert not list((run_dir / "endpoints").glob("teacher-*.json"))  # every replica removed its record
