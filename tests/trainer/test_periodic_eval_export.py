"""Held-out evaluation during training and periodic exports, through a real run (issue 32 items 3 and 5).

A 3-step run of the controller against real servers (tests/trainer/test_controller.py's harness: the rollout and teacher
roles as subprocesses, micro models) on configs/local_cpu.yaml's two reasoning-gym sources plus a jsonl source
on its own route whose eval_fraction holds out a quarter of its rows, with data.eval.interval 2,
data.eval.samples 2, export.interval 1 and export.keep 2. Checks, as values:

- the jsonl split: the held-out rows are never drawn for training, and they are the route's held-out prompts;
- eval.json: points at steps 0 (start), 2 (interval) and 3 (last, the end), each with pass@1 and mean@2 of
  every route, the jsonl source's included; the weights that answered are each point's step;
- metrics: the lines of steps 2 and 3 carry `eval/pass@1/<route>` and `eval/mean@k/<route>` equal to the
  points; step 1 carries none;
- the end point's pass@1 equals the in-process greedy evaluation of the step-3 export loaded here (the same
  prompts, the run's reward);
- exports: steps 2 and 3 kept (step 1 deleted: keep 2), each loadable by `AutoModelForCausalLM` and
  `AutoTokenizer`; their logits equal the trainer's at that step within 1e-5 (float32): step 3 against the
  controller's live engine, step 2 against the step-2 checkpoint's model state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from test_controller import micro_config, run_controller
from transformers import AutoModelForCausalLM, AutoTokenizer

from mopd_hpc.config import RunConfig
from mopd_hpc.data.evaluation import greedy_complete
from mopd_hpc.data.rewards import is_correct
from mopd_hpc.records.metrics import read_metrics
from mopd_hpc.trainer.data_setup import build_run_data

ROWS = 40
EVAL_SIZE = 8  # data.eval.size of micro_config: the first 8 of the 10 held-out rows are evaluated
ATOL = 1e-5


def jsonl_rows(path: Path) -> Path:
    """40 chain-sum-like rows the micro tokenizer encodes: `a+b=` → `a+b`."""
    rows = [{"prompt": f"{i % 10}+{i // 10}=", "answer": str(i % 10 + i // 10)} for i in range(ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def run(micro_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("periodic")
    run_dir = tmp / "run"
    config = micro_config(micro_models, run_dir, tmp / "c.yaml", **{"loss.estimator": "topk"})
    doc = yaml.safe_load(config.read_text())
    doc["data"]["sources"].append(
        {"name": "mine", "kind": "jsonl", "route": "mine", "path": str(jsonl_rows(tmp / "mine.jsonl")),
         "eval_fraction": 0.25}
    )  # fmt: skip
    doc["routes"]["mine"] = {"chain": 1.0}
    doc["data"]["eval"].update(interval=2, samples=2)
    doc["export"] = {"interval": 1, "keep": 2}
    config.write_text(yaml.safe_dump(doc))
    controller, outcome, codes, out = run_controller(config, run_dir, "job-p")
    assert (outcome.reason, outcome.step) == ("finished", 3) and all(c == 0 for c in codes), out
    return RunConfig.from_yaml(config), run_dir, controller, out


def test_jsonl_split_keeps_its_held_out_rows_out_of_training(run) -> None:
    cfg, *_ = run
    data = build_run_data(cfg)
    held = data.eval_prompts["mine"]
    assert len(held) == EVAL_SIZE and {p.source for p in held} == {"mine/eval"}
    assert [p.index for p in held] == list(range(EVAL_SIZE))
    train = data.sources["mine"]
    train_texts = {train[i].text for i in range(len(train))}
    assert len(train) == ROWS - ROWS // 4 and not train_texts & {p.text for p in held}
    assert train_texts | {p.text for p in held} <= {f"{i % 10}+{i // 10}=" for i in range(ROWS)}
    drawn = {d.sample.text for d in data.dataset.take(200) if d.source == "mine"}
    assert drawn == train_texts  # the stream draws every training row and no held-out one
    assert build_run_data(cfg).eval_prompts["mine"] == held  # the same rows on every process


def test_points_in_eval_json_and_in_the_metrics(run) -> None:
    cfg, run_dir, _, out = run
    record = json.loads((run_dir / "eval.json").read_text())
    routes = {"chain", "legs", "mine"}
    assert set(record["routes"]) == routes and record["k"] == 2
    assert record["routes"]["mine"]["n"] == EVAL_SIZE
    points = record["points"]
    assert [p["step"] for p in points] == [0, 2, 3]
    assert [p["weight_version"] for p in points] == ["0", "2", "3"]
    for p in points:
        assert set(p["pass@1"]) == set(p["mean@k"]) == routes
        assert all(0.0 <= v <= 1.0 for stat in ("pass@1", "mean@k") for v in p[stat].values())
    # the table `make run` prints: start and end are the first and last points' pass@1
    for route, row in record["routes"].items():
        assert (row["student_start"], row["student_end"]) == (
            points[0]["pass@1"][route],
            points[-1]["pass@1"][route],
        )
    assert record["student_weights"] == {"start": "0", "end": "3"}
    lines = {line["step"]: line for line in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(lines) == [1, 2, 3]
    assert not [k for k in lines[1] if k.startswith("eval/")]
    for point in points[1:]:
        got = {k: v for k, v in lines[point["step"]].items() if k.startswith("eval/")}
        want = {f"eval/{stat}/{r}": point[stat][r] for stat in ("pass@1", "mean@k") for r in routes}
        assert got == pytest.approx(want, abs=1e-12)
    assert "eval at step 2: pass@1/chain" in out and "evaluation at the end" in out


def test_end_point_equals_the_in_process_evaluation_of_the_export(run) -> None:
    cfg, run_dir, _, _ = run
    data = build_run_data(cfg)
    export = run_dir / "exports" / "step_000003"
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    end = json.loads((run_dir / "eval.json").read_text())["points"][-1]
    for route, prompts in data.eval_prompts.items():
        texts = greedy_complete(model, tokenizer, [p.text for p in prompts], max_new_tokens=5)
        correct = [is_correct(data.score(p, t)) for p, t in zip(prompts, texts, strict=True)]
        assert end["pass@1"][route] == sum(correct) / len(correct), route


def test_exports_load_and_equal_the_trainer_at_their_step(run) -> None:
    _, run_dir, controller, _ = run
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == ["step_000002", "step_000003"]
    ids = torch.tensor([[1, 5, 9, 13, 7, 3, 11], [2, 4, 6, 8, 10, 12, 14]])
    exported = {
        step: AutoModelForCausalLM.from_pretrained(
            run_dir / "exports" / f"step_{step:06d}", torch_dtype=torch.float32
        )
        for step in (2, 3)
    }
    assert all(m.dtype == torch.float32 for m in exported.values())
    # step 3: the controller's engine after the run holds the weights of step 3
    trainer = controller.engine.model.eval()
    torch.testing.assert_close(logits(exported[3], ids), logits(trainer, ids), rtol=0, atol=ATOL)
    # step 2: the trainer's state of step 2 is its checkpoint
    state = torch.load(run_dir / "checkpoints" / "step_000002" / "model.pt", weights_only=True)["model"]
    trainer.load_state_dict(state)
    torch.testing.assert_close(logits(exported[2], ids), logits(trainer, ids), rtol=0, atol=ATOL)
    assert not torch.allclose(logits(exported[2], ids), logits(exported[3], ids), atol=ATOL)  # it trained
    assert AutoTokenizer.from_pretrained(run_dir / "exports" / "step_000002").vocab_size > 0


def test_mopd_logs_plots_and_shows_the_points(run, tmp_path: Path) -> None:
    """`mopd-logs summarize --plot`: a fourth panel of the held-out points (the PNG is 4 panels of 3 inches at
    100 dpi tall); the screen's training table lists each `eval/<stat>/<route>` with its last point."""
    import io
    import struct

    from rich.console import Console

    from mopd_hpc.logs.plot import plot_summary
    from mopd_hpc.logs.render import render_summary
    from mopd_hpc.logs.summary import no_sacct, summarize_run

    _, run_dir, _, _ = run
    summary = summarize_run(run_dir, sacct_runner=no_sacct)
    record = json.loads((run_dir / "eval.json").read_text())
    for stat in ("pass@1", "mean@k"):
        for route in ("chain", "legs", "mine"):
            want = [(p["step"], p[stat][route]) for p in record["points"][1:]]
            assert summary.progress.series[f"eval/{stat}/{route}"] == want
    png = plot_summary(summary, tmp_path / "plot.png").read_bytes()
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (width, height) == (800, 1200)
    screen = io.StringIO()
    render_summary(summary, Console(file=screen, width=160, force_terminal=False))
    last = f"{record['points'][-1]['mean@k']['mine']:.4g}"
    rows = [line.strip("│ ").split()[:2] for line in screen.getvalue().splitlines()]
    assert ["eval/mean@k/mine", last] in rows
