"""The MOPD controller in-process, against real servers: the teacher and rollout role entry points run as real
subprocesses (the environment a guard would give them), micro models built in seconds.

Checks: 3 steps write metrics lines for exactly steps 1..3 with finite contract values; checkpoints and the
final student exist; eval.json has its schema, and the student was evaluated on the rollout engines with
the weights of step 0 and of the last step; the rollout's weight version advances every step (step s was
sampled with the weights of step s-1); the servers stop on the end-of-job marker; c_d = 0 scores no teacher
(no TEACHER phase, no teacher client); the metrics writer rolls back exactly the lines after a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import helpers_fork
import pytest
import yaml
from helpers_auth import TOKEN, write_run_dir_token
from helpers_configs import set_dotted, uniform_mixture, without_sft_warmup
from helpers_ports import free_port

from mopd_hpc.mopd.phases import Phase
from mopd_hpc.records.metrics import MetricsWriter, read_metrics, rollback_metrics

REPO = Path(__file__).resolve().parents[2]
#: The metrics line contract (issue 6) every step must carry, finite.
CONTRACT_KEYS = (
    "loss/total",
    "loss/mopd",
    "loss/rl",
    "mopd/reverse_kl",
    "mopd/rho_mean",
    "mopd/ratio_capped_frac",
    "mopd/ratio_masked_frac",
    "mopd/teacher_student_gap",
    "reward/chain",
    "accuracy/chain",
    "reward/legs",
    "accuracy/legs",
    "perf/tokens_per_s",
    "time/rollout_s",
    "time/teacher_s",
    "time/drain_s",
    "time/train_s",
    "time/sync_s",
    "time/train/prepare_s",
    "time/train/forward_backward_s",
    "time/train/optimizer_s",
)


def micro_config(
    models: Path,
    run_dir: Path,
    path: Path,
    base: str = "local_cpu.yaml",
    student: str = "student",
    **changes: object,
) -> Path:
    """configs/`base` on the micro models (the actor: `student`), small, MOPD from step 1 (configs/local_cpu.yaml's
    SFT warm-up off: `without_sft_warmup`; a test of the warm-up sets it in `changes`) on a uniform mixture
    (`uniform_mixture`): `changes` are dotted keys (e.g. "loss.topk")."""
    doc = uniform_mixture(without_sft_warmup(yaml.safe_load((REPO / "configs" / base).read_text())))
    doc["run_dir"] = str(run_dir)
    doc["models"]["actor"]["path"] = str(models / student)
    doc["models"]["tokenizer"]["path"] = str(models / student)
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(models / name)
    doc.update(steps=3, checkpoint_interval=2)
    doc["data"]["batch_size"] = 8
    doc["data"]["eval"]["size"] = 8
    set_dotted(doc, changes)
    path.write_text(yaml.safe_dump(doc))
    return path


def start_role(
    module: str, run_dir: Path, role: str, index: int, job_id: str, **env: str
) -> subprocess.Popen:
    """A role entry point with the environment a guard gives its children."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    child_env.update(
        MOPD_RUN_DIR=str(run_dir),
        MOPD_ROLE=role,
        MOPD_INDEX=str(index),
        MOPD_JOB_ID=job_id,
        MOPD_HOST="localhost",
        MOPD_BACKEND="local",
        MOPD_PORT_HTTP=str(free_port()),
        **env,
    )
    log = open(run_dir / f"{role}-{index}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
    return helpers_fork.popen(
        ["-m", module], env=child_env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT
    )


async def drive_controller(cfg, run_dir: Path, job_id: str, out: io.StringIO):
    """The controller with real collaborators, built here as `roles/actor.py` builds them for rank 0 of a
    one-rank actor: the endpoints waited for, the torch engine, clients of the servers, the torch sync."""
    from transformers import AutoTokenizer

    from mopd_hpc.config.parallel import teacher_replicas
    from mopd_hpc.engines.rollout.client import RolloutClient
    from mopd_hpc.engines.teacher.replica_pool import TeacherPool
    from mopd_hpc.engines.torch.engine import TorchTrainEngine
    from mopd_hpc.mopd.plan import ExecutionPlan
    from mopd_hpc.roles.endpoints import wait_for_endpoints
    from mopd_hpc.trainer.controller import Controller
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.weight_sync import SyncSettings, TorchSync

    plan = ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids)
    replicas = {t: teacher_replicas(cfg, cfg.models.teacher(t)) for t in plan.teachers}
    endpoints = await wait_for_endpoints(run_dir, replicas, cfg.rollout.engines.count, job_id, 120.0)
    actor = cfg.models.actor
    engine = TorchTrainEngine.from_pretrained(
        actor.path, dtype=actor.dtype, device="cpu", optimizer=actor.optimizer, loss=cfg.loss,
        total_steps=cfg.steps,
    )  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        rollout = [
            await stack.enter_async_context(RolloutClient(url, token=TOKEN)) for url in endpoints.rollout
        ]
        teachers = {
            t: await stack.enter_async_context(TeacherPool(endpoints.teachers[t], token=TOKEN))
            for t in plan.teachers
        }
        controller = Controller(
            cfg,
            plan,
            engine,
            AutoTokenizer.from_pretrained(cfg.models.tokenizer.path),
            build_run_data(cfg),
            rollout=rollout,
            teachers=teachers,
            sync=TorchSync(engine, SyncSettings("127.0.0.1", free_port(), "gloo")),
            run_dir=run_dir,
            job_id=job_id,
            out=out,
        )
        outcome = await controller.run()
    return controller, outcome


def run_controller(config: Path, run_dir: Path, job_id: str):
    """Servers as subprocesses, the controller in-process; returns (controller, outcome, exit codes, stdout)."""
    from mopd_hpc.config.parallel import teacher_replicas
    from mopd_hpc.roles.env import load_run

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.read_text())
    write_run_dir_token(run_dir)  # the job's token, as the launcher creates it: every role reads it
    cfg = load_run(run_dir, {})
    procs = [start_role("mopd_hpc.roles.rollout", run_dir, "rollout", 0, job_id)]
    if cfg.loss.distillation_coefficient > 0:
        for teacher in cfg.models.teachers:
            for r in range(teacher_replicas(cfg, teacher)):
                env = {"MOPD_TEACHER_ID": teacher.id, "MOPD_TEACHER_REPLICA": str(r)}
                procs.append(
                    start_role("mopd_hpc.roles.teacher", run_dir, "teacher", len(procs), job_id, **env)
                )
    out = io.StringIO()
    try:
        controller, outcome = asyncio.run(drive_controller(cfg, run_dir, job_id, out))
    finally:
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                codes.append(proc.wait())
    return controller, outcome, codes, out.getvalue()


def assert_metrics(run_dir: Path, steps: int) -> list[dict]:
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    for line in lines:
        for key in CONTRACT_KEYS:
            assert isinstance(line[key], float) and math.isfinite(line[key]), (
                line["step"],
                key,
                line.get(key),
            )
        assert line["time/rollout_s"] > 0 and line["time/train_s"] > 0 and line["time/sync_s"] > 0
        parts = [line[f"time/train/{p}_s"] for p in ("prepare", "forward_backward", "optimizer")]
        assert min(parts) >= 0 and parts[1] > 0 and parts[2] > 0 and sum(parts) <= line["time/train_s"], parts
        assert 0 <= line["accuracy/chain"] <= 1 and 0 <= line["accuracy/legs"] <= 1
        assert line["perf/tokens_per_s"] > 0
    return lines


def test_three_steps_with_teachers(micro_models, tmp_path):
    run_dir = tmp_path / "run"
    config = micro_config(micro_models, run_dir, tmp_path / "c.yaml", **{"loss.estimator": "topk"})
    controller, outcome, codes, out = run_controller(config, run_dir, "job-a")
    assert (outcome.reason, outcome.step) == ("finished", 3) and codes == [0, 0, 0], out
    lines = assert_metrics(run_dir, 3)
    # step s samples with the weights synced after step s-1 (version "0" is the initial sync)
    assert [line["rollout/weight_version"] for line in lines] == [0.0, 1.0, 2.0]
    assert all(line["mopd/reverse_kl"] >= -1e-6 for line in lines)  # the top-k loss is an exact KL here
    assert all(line["time/teacher_s"] > 0 for line in lines)
    kinds = [(t.source, t.target) for t in controller.transitions]
    one_step = [
        (Phase.ROLLOUT, Phase.TEACHER),
        (Phase.TEACHER, Phase.DRAIN),
        (Phase.DRAIN, Phase.TRAIN),
        (Phase.TRAIN, Phase.SYNC),
        (Phase.SYNC, Phase.ROLLOUT),
    ]
    assert kinds == one_step * 3
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000002", "step_000003"]
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["step"] == 3 and state["data_state"]["position"] == 3 * 8
    record = json.loads((run_dir / "eval.json").read_text())
    assert set(record["routes"]) == {"chain", "legs"}
    for route in record["routes"].values():
        assert set(route) == {"teacher", "student_start", "student_end", "n"}
        assert route["n"] == 8
        assert all(0.0 <= route[k] <= 1.0 for k in ("teacher", "student_start", "student_end"))
    # the student was evaluated on the rollout engines after the first and after the last weight sync
    assert record["student_weights"] == {"start": "0", "end": "3"}
    assert "weight_version" not in out  # the engines answered with the expected versions: no remark
    assert (run_dir / "student_final" / "config.json").is_file()
    assert (run_dir / "student_final" / "tokenizer.json").is_file()
    assert json.loads((run_dir / "state" / "job_end.json").read_text())["reason"] == "finished"
    assert not list((run_dir / "endpoints").glob("*.json"))  # servers removed their endpoint files
    assert "evaluation at the end" in out and "step 3/3" in out


def test_no_distillation_scores_no_teacher(micro_models, tmp_path):
    run_dir = tmp_path / "run"
    changes = {
        "loss.distillation_coefficient": 0.0,
        "loss.rl_coefficient": 1.0,
        "data.samples_per_prompt": 2,
        "data.eval.size": 0,
        "steps": 2,
    }
    config = micro_config(micro_models, run_dir, tmp_path / "c.yaml", **changes)
    controller, outcome, codes, _ = run_controller(config, run_dir, "job-b")
    assert outcome.reason == "finished" and codes == [0]  # only the rollout server was started
    assert controller.plan.teachers == () and not controller.plan.requires_teacher_scoring
    assert Phase.TEACHER not in {t.target for t in controller.transitions}
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["time/teacher_s"] == 0.0 and line["time/drain_s"] == 0.0 and line["loss/mopd"] == 0.0
        assert math.isfinite(line["loss/rl"]) and line["loss/total"] == pytest.approx(
            line["loss/rl"], abs=1e-6
        )
        assert line["train/response_tokens"] > 0
        # every prompt counted once per sample (2 samples per prompt)
        assert line["train/prompt_tokens"] > 0 and line["train/prompt_tokens"] % 2 == 0
    assert not (run_dir / "eval.json").exists()


def test_metrics_rollback_keeps_one_line_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter.open(path, resume_step=0) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss/total": float(step), "x": float("nan")})
    with open(path, "a") as f:  # a repeated step and a torn line, as a killed run may leave
        f.write(json.dumps({"step": 3, "ts": time.time(), "loss/total": 30.0}) + "\n")
        f.write('{"step": 6, "ts": 1.0, "loss/tot')
    dropped = rollback_metrics(path, 3)
    lines = read_metrics(path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[2]["loss/total"] == 30.0  # the last line of a step wins
    assert lines[0]["x"] is None  # NaN is written as null
    assert dropped == 4  # steps 4, 5, the first step 3; the torn line is not counted as a line kept
    with MetricsWriter.open(path, resume_step=2) as writer:
        writer.write(3, {"loss/total": 3.5})
    assert [(line["step"], line["loss/total"]) for line in read_metrics(path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.5),
    ]
    with pytest.raises(ValueError, match="sets step and ts"):
        MetricsWriter.open(path, resume_step=3).write(4, {"step": 1})


def test_role_env_is_read_at_the_edge_and_names_what_is_missing(tmp_path):
    from mopd_hpc.roles.env import RoleEnv, RoleEnvError, master_address, resolve_path

    env = {
        "MOPD_RUN_DIR": str(tmp_path),
        "MOPD_ROLE": "rollout",
        "MOPD_INDEX": "1",
        "MOPD_JOB_ID": "77",
        "MOPD_HOST": "n2",
        "MOPD_BACKEND": "slurm",
        "MOPD_PORT_HTTP": "30001",
        "MOPD_PORT_DIST_INIT": "30003",
    }
    role = RoleEnv.from_env(env)
    assert (role.index, role.job_id, dict(role.ports)) == (1, "77", {"http": 30001, "dist_init": 30003})
    # servers bind the guard's address (MOPD_NODE_ADDR), never every interface, and advertise it
    on_node = RoleEnv.from_env({**env, "MOPD_NODE_ADDR": "10.0.0.2"})
    assert (on_node.bind_host, on_node.advertise_host, master_address(on_node)) == ("10.0.0.2",) * 3
    # an operator's every-interface guard: the endpoint advertises the node's name, the rendezvous its address
    wildcard = RoleEnv.from_env({**env, "MOPD_NODE_ADDR": "0.0.0.0", "MOPD_HOST": "localhost"})
    assert (wildcard.bind_host, wildcard.advertise_host, master_address(wildcard)) == (
        "0.0.0.0",
        "localhost",
        "127.0.0.1",
    )
    # without MOPD_NODE_ADDR: the node's name resolved; a name that does not resolve is named
    assert RoleEnv.from_env({**env, "MOPD_HOST": "localhost"}).bind_host == "127.0.0.1"
    with pytest.raises(
        RoleEnvError, match=r"MOPD_HOST='no-such-node\.invalid': host name .* does not resolve"
    ):
        _ = RoleEnv.from_env({**env, "MOPD_HOST": "no-such-node.invalid"}).bind_host
    assert role.token_file == tmp_path / "guard.token"
    with pytest.raises(RoleEnvError, match="MOPD_PORT_MASTER"):
        role.port("master")
    with pytest.raises(RoleEnvError, match="MOPD_JOB_ID is not set"):
        RoleEnv.from_env({k: v for k, v in env.items() if k != "MOPD_JOB_ID"})
    with pytest.raises(RoleEnvError, match="MOPD_INDEX='x'"):
        RoleEnv.from_env({**env, "MOPD_INDEX": "x"})
    (tmp_path / "sub" / "m").mkdir(parents=True)
    assert resolve_path("m", {"PWD": "/nonexistent", "MOPD_SUBMIT_DIR": str(tmp_path / "sub")}) == str(
        tmp_path / "sub" / "m"
    )
    assert resolve_path("/abs/x", {}) == "/abs/x"


def test_end_of_job_marker_counts_only_for_this_job_after_the_server_started(tmp_path):
    from mopd_hpc.atomic import atomic_write_json
    from mopd_hpc.records.job_end import job_ended, stop_on_job_end, write_job_end

    marker = write_job_end(tmp_path, "77", "checkpoint_signal", 5)  # the same job id before a requeue
    started = time.time() + 60.0  # the requeued run's server starts a minute later
    assert not job_ended(tmp_path, "77", since=started)
    assert not job_ended(tmp_path, "other", since=0.0)

    async def scenario() -> bool:
        stop = asyncio.Event()
        watcher = asyncio.create_task(stop_on_job_end(tmp_path, "77", stop, poll_s=0.01, since=started))
        await asyncio.sleep(0.05)
        assert not stop.is_set()
        # the rerun's actor ends the job after the server started
        atomic_write_json(marker, {"job_id": "77", "reason": "finished", "step": 9, "ts": started + 1.0})
        await asyncio.wait_for(watcher, timeout=5)
        return stop.is_set()

    assert asyncio.run(scenario())
