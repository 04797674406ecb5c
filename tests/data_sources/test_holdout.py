"""Held-out splits of jsonl sources (data/holdout.py), their config fields, and eval.json's points on resume.

Oracles: the split by hand (a deterministic seeded sample of ⌈fraction·rows⌉ rows, the rest for training, in
file order); the config refusals name the field; a resumed run keeps exactly the points up to its step.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.data import JsonlSource
from mopd_hpc.data.errors import DataSourceError, SourceIndexError
from mopd_hpc.data.holdout import held_out_file, scorer_name, split_rows
from mopd_hpc.trainer.evaluator import keep_points_upto, point_metrics

REPO = Path(__file__).resolve().parents[2]


def write_rows(path: Path, n: int, offset: int = 0) -> Path:
    rows = [{"prompt": f"q{i + offset}", "answer": str(i + offset)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_split_rows_holds_out_a_seeded_fraction(tmp_path: Path) -> None:
    source = JsonlSource.from_path("mine", write_rows(tmp_path / "a.jsonl", 30))
    train, held = split_rows(source, 0.1, seed=7)
    chosen = sorted(random.Random("7/mine").sample(range(30), math.ceil(0.1 * 30)))
    assert [held[i].text for i in range(len(held))] == [f"q{i}" for i in chosen]
    assert [train[i].text for i in range(len(train))] == [f"q{i}" for i in range(30) if i not in chosen]
    assert (held.name, held[0].source, held[1].index) == ("mine/eval", "mine/eval", 1)
    assert (train.name, train[0].source, train[len(train) - 1].index) == ("mine", "mine", 26)
    assert held.score(held[0], held[0].answer) == 1.0 and held.score(held[0], "no") == 0.0
    again, _ = split_rows(JsonlSource.from_path("mine", tmp_path / "a.jsonl"), 0.1, seed=7)
    assert [again[i] for i in range(len(again))] == [train[i] for i in range(len(train))]
    other, _ = split_rows(source, 0.1, seed=8)
    assert [other[i] for i in range(len(other))] != [train[i] for i in range(len(train))]
    with pytest.raises(SourceIndexError):
        held[len(held)]
    with pytest.raises(DataSourceError, match="leaving no training row"):
        split_rows(JsonlSource.from_path("tiny", write_rows(tmp_path / "t.jsonl", 1)), 0.5, seed=0)


def test_held_out_file_is_scored_by_its_source(tmp_path: Path) -> None:
    source = JsonlSource.from_path("mine", write_rows(tmp_path / "a.jsonl", 4))
    held = held_out_file(source, write_rows(tmp_path / "b.jsonl", 3, offset=100))
    assert [held[i].text for i in range(len(held))] == ["q100", "q101", "q102"]
    assert {held[i].source for i in range(3)} == {"mine/eval"} and scorer_name("mine/eval") == "mine"
    assert held.score(held[2], "102") == 1.0


def test_split_fields_are_checked_naming_the_field(tmp_path: Path) -> None:
    base = "data.sources[0]={kind: jsonl, name: mine, route: chain, path: data/mine.jsonl"
    with pytest.raises(ConfigError) as both:
        load_run_config(
            REPO / "configs" / "local_cpu.yaml", [base + ", eval_fraction: 0.1, eval_path: t.jsonl}"]
        )
    assert "data.sources[0].eval_path" in [p.path for p in both.value.problems]
    with pytest.raises(ConfigError) as whole:
        load_run_config(REPO / "configs" / "local_cpu.yaml", [base + ", eval_fraction: 1.0}"])
    assert "data.sources[0].eval_fraction" in [p.path for p in whole.value.problems]
    for field in ("data.eval.interval=-1", "export.keep=0"):
        with pytest.raises(ConfigError) as bad:
            load_run_config(REPO / "configs" / "local_cpu.yaml", [field])
        assert field.split("=")[0] in [p.path for p in bad.value.problems]


def test_a_resumed_run_keeps_the_points_up_to_its_step(tmp_path: Path) -> None:
    assert keep_points_upto(tmp_path, 2) is False  # no eval.json: the start evaluation is still to do
    points = [{"step": s, "weight_version": str(s), "pass@1": {"r": s / 10}, "mean@k": {}} for s in (0, 2, 4)]
    (tmp_path / "eval.json").write_text(json.dumps({"routes": {}, "points": points}))
    assert keep_points_upto(tmp_path, 2) is True
    assert json.loads((tmp_path / "eval.json").read_text())["points"] == points[:2]
    assert point_metrics(points[1]) == {"eval/pass@1/r": 0.2}
    both = {"pass@1": {"a": 0.5}, "mean@k": {"a": 0.25}}
    assert point_metrics(both) == {"eval/pass@1/a": 0.5, "eval/mean@k/a": 0.25}
