"""The floor arithmetic of benchmarks/step_floors.py against hand-computed values, the parameter count
against a real (tiny) transformers Qwen3, and benchmarks/gpu_step_roles.py's argument parsing, metrics
summary and results merge (the GPU run itself is the device's: issue 22)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from helpers_models import QWEN3_0_6B, QWEN3_1_7B

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_step_roles  # noqa: E402
from gpu_memory import plan_of  # noqa: E402
from step_floors import Device, ModelShape, StepTokens, decode_floor_s, floor_ratios, phase_floors  # noqa: E402

#: layers 1, hidden 4, MLP 8, 2 heads / 1 KV head of dim 2, vocab 10: 200 parameters (tied), by hand:
#: q 4·4 + k 4·2 + v 4·2 + o 4·4 = 48, q/k norms 2 + 2, MLP 3·4·8 = 96, two norms 8 → 156; embedding 40; norm 4.
TINY = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=2, vocab_size=10, tie_word_embeddings=True)  # fmt: skip
SLOW = Device(hbm_gbps=1e-6, peak_tflops=1e-9)  # 1,000 bytes/s, 1,000 FLOP/s: hand-sized seconds
H200ISH = Device(hbm_gbps=4000.0, peak_tflops=800.0)


def test_parameter_counts_by_hand_and_against_transformers() -> None:
    # 28 · 15,730,944 + 155,582,464 + 1,024, and 28 · 50,336,000 + 311,164,928 + 2,048
    assert ModelShape.from_hf_config(QWEN3_0_6B).params == 596_049_920
    assert ModelShape.from_hf_config(QWEN3_1_7B).params == 1_720_574_976
    tiny = ModelShape.from_hf_config(TINY)
    assert (tiny.params, tiny.matmul_params, tiny.weight_bytes, tiny.kv_bytes_per_token) == (200, 200, 400, 8)
    untied = ModelShape.from_hf_config(dict(TINY, tie_word_embeddings=False))
    assert (untied.params, untied.matmul_params) == (240, 200)  # + lm_head 40; the input lookup is no matmul
    assert ModelShape.from_hf_config(QWEN3_0_6B).kv_bytes_per_token == 114_688  # 2 · 28 · 8 · 128 · 2

    transformers = pytest.importorskip("transformers")
    for cfg in (TINY, dict(TINY, tie_word_embeddings=False), dict(TINY, num_hidden_layers=3, hidden_size=8)):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
        real = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
        assert ModelShape.from_hf_config(model.config.to_dict()).params == real, cfg


def test_phase_floors_hand_computed_memory_bound_decode() -> None:
    """0.6B, 32 prompts × 4 samples × 128 new tokens, prompts of 20 tokens, on 4,000 GB/s and 800 TFLOP/s."""
    model = ModelShape.from_hf_config(QWEN3_0_6B)
    step = StepTokens(
        rows=128, samples_per_prompt=4, new_tokens=128, prompt_tokens=2560, response_tokens=16384
    )
    assert step.mean_decode_context == 83.5  # 20 + 127 / 2
    floors = phase_floors(model, model, step, H200ISH)
    # decode: 128 · (1,192,099,840 + 128 · 83.5 · 114,688 = 2,417,885,184 bytes) / 4e12 = 0.077372325888
    # (memory-bound: 2 · 596,049,920 · 128 / 8e14 per step is 0.19 ms < 0.60 ms);
    # prefill: 2 · 596,049,920 · 640 distinct prompt tokens / 8e14 = 0.000953679872
    assert floors["rollout"] == pytest.approx(0.077372325888 + 0.000953679872, rel=1e-12)
    assert floors["teacher"] == pytest.approx(0.0282289242112, rel=1e-12)  # 2 · P · 18,944 / 8e14
    assert floors["train"] == pytest.approx(0.0846867726336, rel=1e-12)  # 6 · P · 18,944 / 8e14
    assert floors["sync"] == pytest.approx(0.00059604992, rel=1e-12)  # 2 · 1,192,099,840 / 4e12 (one copy)
    assert floors["drain"] == 0.0


def test_phase_floors_hand_computed_compute_bound_decode() -> None:
    model = ModelShape.from_hf_config(TINY)
    step = StepTokens(rows=2, samples_per_prompt=2, new_tokens=3, prompt_tokens=10, response_tokens=6)
    # per decode step: read 400 + 2 · 6 · 8 = 496 bytes → 0.496 s; compute 2 · 200 · 2 = 800 FLOP → 0.8 s
    assert decode_floor_s(model, step, SLOW) == pytest.approx(2.4)
    floors = phase_floors(model, model, step, SLOW)
    assert floors == pytest.approx(  # prefill 2 · 200 · 5 = 2 s; tokens 16
        {"rollout": 4.4, "teacher": 6.4, "drain": 0.0, "train": 19.2, "sync": 0.8}
    )
    assert phase_floors(model, model, step, SLOW, extra_forward=True)["train"] == pytest.approx(25.6)
    untied = ModelShape.from_hf_config(dict(TINY, tie_word_embeddings=False))  # reads the same 200 weights
    assert decode_floor_s(untied, step, Device(hbm_gbps=1e-6, peak_tflops=1.0)) == pytest.approx(3 * 0.496)
    bigger_teacher = ModelShape.from_hf_config(dict(TINY, tie_word_embeddings=False))  # matmul params 200
    assert phase_floors(model, bigger_teacher, step, SLOW)["teacher"] == pytest.approx(6.4)


def test_floor_ratios() -> None:
    floors = {"rollout": 4.4, "teacher": 6.4, "drain": 0.0, "train": 19.2, "sync": 0.8}
    seconds = {"rollout": 8.8, "teacher": 6.4, "drain": 1.0, "train": 19.2, "sync": 8.0}
    r = floor_ratios(seconds, floors)
    assert r["phase_floor_ratio"] == pytest.approx({"rollout": 2.0, "teacher": 1.0, "drain": None,
                                                    "train": 1.0, "sync": 10.0})  # fmt: skip
    assert r["step_floor_ratio"] == pytest.approx(43.4 / 30.8)  # drain's second counts in the step


def test_records_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="samples_per_prompt"):
        StepTokens(rows=6, samples_per_prompt=4, new_tokens=1, prompt_tokens=0, response_tokens=0)
    with pytest.raises(ValueError, match="hbm_gbps"):
        Device(hbm_gbps=0.0, peak_tflops=1.0)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_hf_config({"hidden_size": 4})


def test_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = gpu_step_roles.parse_args(["--shapes", "32x4x128@0.6b", "--steps", "5"])
    assert args.shapes == [gpu_step_roles.Shape(32, 4, 128, "0.6b")] and args.steps == 5
    assert [s.name for s in gpu_step_roles.parse_args([]).shapes] == [
        "32x4x128@0.6b", "64x4x1024@0.6b", "32x4x128@1.7b", "64x4x1024@1.7b"
    ]  # fmt: skip
    two = gpu_step_roles.parse_args(["--shapes", "64x4x1024@1.7B, 8x2x16@0.6b"]).shapes
    assert [s.name for s in two] == ["64x4x1024@1.7b", "8x2x16@0.6b"]
    for bad, said in (("32x4@0.6b", "PROMPTSxSAMPLES"), ("32x4x128@8b", "'8b'"), ("0x4x128@0.6b", "≥ 1")):
        with pytest.raises(SystemExit) as exc:
            gpu_step_roles.parse_args(["--shapes", bad])
        assert exc.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_step_roles.parse_args(["--steps", "1"])
    assert "warm-up" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        gpu_step_roles.parse_args(["--help"])
    assert exc.value.code == 0 and "--shapes" in capsys.readouterr().out


def _line(step: int, ts: float, rollout: float, prompt: float) -> dict:
    return {"step": step, "ts": ts, "time/rollout_s": rollout, "time/teacher_s": 0.5, "time/drain_s": 0.25,
            "time/train_s": 1.0, "time/sync_s": 0.25, "train/prompt_tokens": prompt,
            "train/response_tokens": 128.0 * 128, "memory/actor/train/reserved_gib": 3.0 + step,
            "memory/rollout/0/rollout/reserved_gib": 2.0}  # fmt: skip


def test_summarize_excludes_the_warm_up_step() -> None:
    model = ModelShape.from_hf_config(QWEN3_0_6B)
    lines = [_line(1, 100.0, 50.0, 9999.0), _line(2, 104.0, 2.0, 2560.0), _line(3, 109.0, 3.0, 2560.0),
             _line(4, 113.0, 10.0, 2560.0)]  # fmt: skip
    shape = gpu_step_roles.Shape(32, 4, 128, "0.6b")
    r = gpu_step_roles.summarize(shape, lines, model, model, H200ISH)
    m = r["measured"]
    assert r["measured_steps"] == [2, 3, 4] and m["prompt_tokens"] == 2560
    assert m["seconds_per_phase"] == {
        "rollout": 3.0,
        "teacher": 0.5,
        "drain": 0.25,
        "train": 1.0,
        "sync": 0.25,
    }
    assert m["step_s"] == 5.0 and m["step_wall_s"] == 4.0  # medians of (4, 5, 12) and of ts gaps (4, 5, 4)
    expected = phase_floors(model, model, StepTokens(128, 4, 128, 2560, 16384), H200ISH)
    assert m["floor_s"] == pytest.approx(expected, abs=1e-6)
    assert m["step_floor_ratio"] == pytest.approx(5.0 / sum(expected.values()), abs=0.01)
    assert m["phase_floor_ratio"]["drain"] is None
    assert m["phase_floor_ratio"]["train"] == pytest.approx(1.0 / expected["train"], abs=0.01)
    assert r["peak_reserved_gib"] == {"actor": {"train": 7.0}, "rollout/0": {"rollout": 2.0}}
    assert gpu_step_roles.summarize(shape, lines[:1], model, model, H200ISH)["measured"] is None


def test_merge_keeps_other_shapes_and_replaces_a_rerun(tmp_path: Path) -> None:
    out = tmp_path / "gpu_step_roles.json"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"shapes": {"32x4x128@0.6b": {"run": 1}}}))
    b.write_text(json.dumps({"shapes": {"64x4x1024@0.6b": {"run": 2}}}))
    assert gpu_step_roles.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    a.write_text(json.dumps({"shapes": {"32x4x128@0.6b": {"run": 3}}}))
    assert gpu_step_roles.main(["--merge", str(a), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu_step_roles" and result["config"] == "configs/local_gpu_colocated.yaml"
    assert result["shapes"] == {"32x4x128@0.6b": {"run": 3}, "64x4x1024@0.6b": {"run": 2}}


def test_one_shape_reads_the_run_and_prints_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The glue on CPU: the job and the device measurement stood in by a written metrics file and fixed
    figures (the real ones run on the GPU); the record carries what issue 22 asks per shape."""
    models = tmp_path / "models" / "gpu_step_roles_0_6b"
    for m in ("student", "teacher"):
        (models / m).mkdir(parents=True)
        (models / m / "config.json").write_text(json.dumps(QWEN3_0_6B))
    seen: dict = {}

    def fake_job(
        sets: list[str], run_dir: Path, timeout_s: float, log: Path, config: Path
    ) -> tuple[int, float]:
        seen["sets"], seen["timeout_s"], seen["config"] = sets, timeout_s, config
        run_dir.mkdir(parents=True)
        lines = [_line(s, 100.0 + 5 * s, 3.0, 2560.0) for s in (1, 2, 3)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return 0, 42.0

    device = {
        "device": "stand-in",
        "torch": "x",
        "copy_gbps": 2000.0,
        "hbm_gbps": 4000.0,
        "peak_bf16_tflops": 800.0,
        "gpu_capacity_gib": 139.8,
    }
    monkeypatch.setattr(gpu_step_roles, "run_job", fake_job)
    monkeypatch.setattr(gpu_step_roles, "measure_device", lambda: device)
    args = gpu_step_roles.parse_args(
        [
            "--shapes",
            "32x4x128@0.6b",
            "--models-root",
            str(tmp_path / "models"),
            "--commit",
            "abc",
            "--steps",
            "3",
        ]
    )
    record, info = gpu_step_roles.one_shape(args.shapes[0], args, gpu_step_roles.time.perf_counter(), None)
    assert info == device and "data.eval.size=0" in seen["sets"] and "steps=3" in seen["sets"]
    assert f"models.actor.path={models / 'student'}" in seen["sets"] and seen["timeout_s"] > 500
    assert record["commit"] == "abc" and record["hbm_gbps"] == 4000.0 and record["peak_bf16_tflops"] == 800.0
    assert record["measured_steps"] == [2, 3] and record["measured"]["step_s"] == 5.0
    expected = phase_floors(
        *(ModelShape.from_hf_config(QWEN3_0_6B),) * 2, StepTokens(128, 4, 128, 2560, 16384), H200ISH
    )
    assert record["measured"]["floor_s"] == pytest.approx(expected, abs=1e-6)
    # the memory plan of the run's own sets at the device's memory, over the measured peak (6 GiB: the actor's
    # 3 + 3 in step 3's train phase)
    plan = plan_of(seen["sets"], 139.8)
    assert record["plan"] == plan and record["plan_over_measured"] == round(plan["peak_gib"] / 6.0, 3)
    # the config as shipped (issue 35: sglang + ipc): no set of the benchmark's own changes a backend; the
    # record names the config and the backends that ran
    assert not any(
        x.startswith(("rollout.", "weight_sync.")) and "max_new_tokens" not in x for x in seen["sets"]
    )
    assert seen["config"] == gpu_step_roles.CONFIG and record["config"] == "configs/local_gpu_colocated.yaml"
    assert record["implied_sets"] == [] and record["backends"] == {
        "rollout": "sglang", "rollout_mode": "colocated", "weight_sync": "ipc",
        "source": "local_gpu_colocated.yaml + --set",
    }  # fmt: skip
    assert gpu_step_roles.result_key(args.shapes[0], record["backends"]) == "32x4x128@0.6b/sglang+ipc"
    # the baseline before issue 35: hf + AWEX colocate, its own config file, keyed apart in the same results
    awex = gpu_step_roles.REPO / "configs" / "local_gpu_colocated_awex.yaml"
    args = gpu_step_roles.parse_args(["--shapes", "32x4x128@0.6b", "--models-root", str(tmp_path / "models"),
                                      "--commit", "abc", "--steps", "3", "--config", str(awex)])  # fmt: skip
    base, _ = gpu_step_roles.one_shape(args.shapes[0], args, gpu_step_roles.time.perf_counter(), device)
    assert seen["config"] == awex and base["config"] == "configs/local_gpu_colocated_awex.yaml"
    assert gpu_step_roles.result_key(args.shapes[0], base["backends"]) == "32x4x128@0.6b/hf+awex"
    assert base["plan"] == plan_of(seen["sets"], 139.8, awex) != record["plan"]
    text = gpu_step_roles.table("32x4x128@0.6b", record)
    assert "step_floor" not in text and "rollout" in text and "peak reserved GiB actor" in text
    assert f"plan / measured {record['plan_over_measured']}" in text
    assert f"{record['measured']['step_floor_ratio']:8.1f}" in text


def test_sglang_runs_with_the_sync_that_reaches_it_and_names_both(tmp_path: Path) -> None:
    """`--set rollout.backend=sglang` alone: the ipc sync (the only one that reaches a colocated sglang engine
    on a GPU: config/capabilities.py) is implied and recorded; a run's resolved config.yaml names what ran."""
    assert gpu_step_roles.implied_sets(["rollout.backend=sglang"]) == [
        "weight_sync.backend=ipc", "weight_sync.awex_mode=null",
    ]  # fmt: skip
    assert gpu_step_roles.implied_sets(["rollout.backend=sglang", "weight_sync.backend=torch"]) == []
    assert gpu_step_roles.implied_sets(["rollout.backend=hf"]) == gpu_step_roles.implied_sets([]) == []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert gpu_step_roles.ran_backends(run_dir, ["rollout.backend=sglang", "weight_sync.backend=ipc"]) == {
        "rollout": "sglang", "rollout_mode": "colocated", "weight_sync": "ipc",
        "source": "local_gpu_colocated.yaml + --set",
    }  # fmt: skip
    resolved = yaml.safe_load(gpu_step_roles.CONFIG.read_text())
    resolved["rollout"]["backend"], resolved["weight_sync"]["backend"] = "sglang", "ipc"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved))
    backends = gpu_step_roles.ran_backends(run_dir, [])
    assert backends == {"rollout": "sglang", "rollout_mode": "colocated", "weight_sync": "ipc",
                        "source": "run_dir/config.yaml"}  # fmt: skip
    shape = gpu_step_roles.Shape(32, 4, 128, "0.6b")
    assert gpu_step_roles.result_key(shape, backends) == "32x4x128@0.6b/sglang+ipc"
    args = gpu_step_roles.parse_args(["--shapes", "32x4x128@0.6b", "--set", "rollout.backend=sglang"])
    assert args.extra_sets == ["rollout.backend=sglang"]


@pytest.mark.parametrize(("rows", "new", "expected"), [(128, 128, 36), (256, 1024, 6), (16, 64, 55)])
def test_teacher_profile_scores_in_the_chunks_of_the_teacher_role(
    tmp_path: Path, rows: int, new: int, expected: int
) -> None:
    """benchmarks/teacher_profile.py scores `max_batch_rows` rows a forward by roles/teacher.py's rule."""
    import teacher_profile

    from mopd_hpc.config import load_run_config
    from mopd_hpc.roles.teacher import scoring_rows

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    sets = [f"data.batch_size={rows // 4}", f"rollout.sampling.max_new_tokens={new}"]
    cfg = load_run_config(str(gpu_step_roles.CONFIG), sets, False)
    got = teacher_profile.chunk_rows(rows, cfg.data.max_prompt_tokens + new, QWEN3_0_6B["vocab_size"])
    assert got == scoring_rows(cfg, str(tmp_path)) == expected


def test_teacher_profile_glue_on_cpu(tmp_path: Path) -> None:
    """The profile's parts on a CPU (the torch scoring engine, a micro Qwen3): the answer that came back
    through the real server and client equals the engine's own scores, every timing is there, and the
    profiler's tables are written beside the results."""
    import teacher_profile
    from helpers_models import save_micro_qwen3

    model = save_micro_qwen3(tmp_path / "model", seed=0)
    out = tmp_path / "teacher_profile.json"
    argv = ["--engine", "torch", "--device", "cpu", "--model", str(model), "--rows", "4", "--prompt-tokens", "3",
            "--new-tokens", "5", "--repeats", "1", "--commit", "abc", "--out", str(out)]  # fmt: skip
    assert teacher_profile.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["answer_vs_engine_max_abs"] == 0.0 and result["commit"] == "abc"
    assert set(result["seconds"]) == {
        "round_trip",
        "server_score",
        "engine_score",
        "engine_score_after_empty_cache",
    }
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"].values())
    assert result["teacher_floor_s"] is None and result["max_batch_rows"] == 64
    assert "sorted by cpu_time_total" in (tmp_path / "teacher_profile.txt").read_text()
