"""The `teacher` role of a run: `python -m mopd_hpc.roles.teacher` (the guard's role table runs it).

Without arguments it is a job's teacher child: the scoring server (`engines/teacher/process.py`) takes its
settings from the run. MOPD_TEACHER_ID (the job plan sets it) names the entry of `models.teachers` in
`run_dir/config.yaml`, and MOPD_TEACHER_REPLICA which of its replicas this child serves (each a scoring
server with its own endpoint record, `teacher-<id>.r<replica>.json`, carrying the job id); the config gives
the checkpoint path, the scoring engine (torch, or megatron on the child's GPU), its dtype and tensor_parallel;
the port is the named port `http`, bound on the guard's address (`RoleEnv.bind_host`). This module resolves
them (env read once, in `main`; the job's token once, in `run`) and serves until SIGTERM/SIGINT or until the
actor announces the end of the job (`records/job_end.py`), then exits 0. SIGUSR2 is ignored (a teacher has
nothing to checkpoint).

At tensor_parallel 1 a replica is this one process (`engines.teacher.process.serve`). Above, the replica is
tensor_parallel children, MOPD_RANK / MOPD_WORLD_SIZE their rank in its TP group (plan/placement.py): they
form the replica's world over the leader's rendezvous, each builds its shard engine, the leader (rank 0)
serves HTTP and the followers run the same forwards until the leader's STOP (roles/teacher_replica.py; a rank
lost ends the replica with a non-zero exit). What each engine serves, tensor_parallel included, is declared in
`config/capabilities.py` (`teacher_refusals`, checked here as by `--check`); the engines are built through
`TeacherEngines` (the declarations and the builder, `engines.teacher.process.build_engine`), which `main` takes as its
one seam: tests pass a stand-in shard engine that runs on CPU (tests/engines/teacher_replica_prog.py).

Rows scored per forward (`scoring_rows`): a forward materializes [rows, tokens, vocab] logits (and their
float32 log-softmax), which for a production vocabulary (Qwen3: 151,936) and a long response is gigabytes per
row: 256 rows × 1,280 tokens would need ~200 GB. The role caps the rows so that one chunk's float32 logits stay
within `SCORING_BUDGET_BYTES`; a step's rows are then scored in chunks (same results).

With arguments it is a standalone teacher server (tests, debugging), outside any job:

    python -m mopd_hpc.roles.teacher --teacher-id ID --model PATH [--port N] [--host 127.0.0.1]
        [--engine torch|megatron] [--device auto|cpu|cuda|cuda:N] [--dtype float32|bfloat16|float16]
        [--run-dir DIR] [--max-batch-rows 64] [--num-threads N] [--token-file FILE]

Each flag not given falls back to its variable of `ENV` (read once, in `main`). Every route but the liveness
probe requires the token of `--token-file` (default: the run dir's token file, else a new one in a private
temporary directory; a missing file is created, mode 0600, and its path logged). SIGTERM or SIGINT stops
either cleanly (exit 0) and removes the endpoint file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from mopd_hpc.config import RunConfig
from mopd_hpc.config.capabilities import TEACHER_ENGINES, standing
from mopd_hpc.config.capability_specs import TeacherEngineSpec
from mopd_hpc.config.parallel import teacher_replicas
from mopd_hpc.config.serving_refusals import teacher_refusals
from mopd_hpc.engines.serving import cli_port
from mopd_hpc.engines.teacher.process import ENGINES, TeacherArgs, build_engine
from mopd_hpc.records.job_end import stop_on_job_end
from mopd_hpc.roles.env import RoleEnv, RoleEnvError, cpu_threads, read_job_token, start_server_role
from mopd_hpc.roles.teacher_replica import (
    EngineBuilder,
    ReplicaSpec,
    follow_replica,
    lead_replica,
    replica_spec,
)
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.http_auth import standalone_token

#: Bytes of float32 logits one scoring forward may materialize (module docstring).
SCORING_BUDGET_BYTES = 4 << 30
#: Logical key → environment variable of the standalone server (read at the edge, in `main`).
ENV = {
    "teacher_id": child_env.TEACHER_ID,
    "model_path": child_env.MODEL_PATH,
    "port": child_env.port_env_name("http"),
    "run_dir": child_env.RUN_DIR,
    "host": child_env.BIND_HOST,
    "advertise_host": child_env.HOST,
    "device": child_env.DEVICE,
    "dtype": child_env.DTYPE,
    "engine": child_env.TEACHER_ENGINE,
}
#: Bind addresses that cannot be connected to as given: the endpoint file advertises MOPD_HOST instead.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class TeacherEngines:
    """The scoring engines a job's teacher child builds: what each serves (`specs`: engine name → its
    declaration, `config/capabilities.py` TEACHER_ENGINES, which `mopd-submit --check` used) and how this
    rank's engine is built (`build(args)`, `engines.teacher.process.build_engine`: at tensor_parallel > 1 its shard, the
    replica's world formed already). The default is the job's; tests replace both together with a stand-in."""

    specs: Mapping[str, TeacherEngineSpec] = field(default_factory=lambda: MappingProxyType(TEACHER_ENGINES))
    build: EngineBuilder = build_engine


def scoring_rows(cfg: RunConfig, model_path: str, budget_bytes: int = SCORING_BUDGET_BYTES) -> int:
    """Rows per scoring forward: all of a step's rows (data.batch_size · samples_per_prompt, at least 64) unless
    their float32 logits — rows × (max_prompt_tokens + max_new_tokens) × vocab_size × 4 bytes — exceed
    `budget_bytes`; then the most rows that fit (at least 1). vocab_size from `model_path`/config.json; when
    it cannot be read the step's rows are kept (the server's load reports the checkpoint's problem)."""
    rows = max(64, cfg.data.batch_size * cfg.data.samples_per_prompt)
    try:
        vocab = int(json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return rows
    tokens = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    return max(1, min(rows, budget_bytes // (tokens * vocab * 4)))


def teacher_args(
    role: RoleEnv,
    cfg: RunConfig,
    environ: Mapping[str, str],
    specs: Mapping[str, TeacherEngineSpec] = TEACHER_ENGINES,
) -> TeacherArgs:
    """The scoring server's arguments for this child (its TP rank: MOPD_RANK).

    Raises:
        RoleEnvError: no or unknown teacher id; what `specs` (`config/capabilities.py`) declares the
            teacher's engine does not serve (`teacher_refusals`: a tensor_parallel above the engine's, engine
            megatron while CUDA_VISIBLE_DEVICES is empty). The message names the config field
            (`models.teachers[i].tensor_parallel`, `models.teachers[i].engine`) and its value.
    """
    teacher_id = environ.get(child_env.TEACHER_ID)
    if not teacher_id:
        raise RoleEnvError(f"{child_env.TEACHER_ID} is not set: the job plan names the teacher of each child")
    try:
        teacher = cfg.models.teacher(teacher_id)
    except KeyError as exc:
        raise RoleEnvError(f"{child_env.TEACHER_ID}={teacher_id!r}: {exc.args[0]}") from None
    index = cfg.models.teacher_ids.index(teacher.id)
    here = f"models.teachers[{index}]"
    replica = _replica(environ, here, teacher_replicas(cfg, teacher))
    gpu = role.device.is_cuda
    # the declarations `mopd-submit --check` used (config/capabilities.py): device and tensor_parallel
    device = "gpu" if gpu else "cpu"
    problems = teacher_refusals(index, teacher.engine, device, teacher.tensor_parallel, table=specs)
    if problems := standing(problems, cfg.allow_unverified):  # what --check let through, as it did
        where = f" (CUDA_VISIBLE_DEVICES {environ.get('CUDA_VISIBLE_DEVICES')!r})"
        raise RoleEnvError("; ".join(p.render() for p in problems) + where)
    return TeacherArgs(
        teacher_id=teacher.id,
        model_path=teacher.path,
        host=role.bind_host,
        port=role.port("http") if role.rank == 0 else 0,  # a follower serves nothing (its plan leases none)
        advertise_host=role.advertise_host,
        device=role.device.torch_name,
        dtype=teacher.dtype,
        run_dir=str(role.run_dir),
        max_batch_rows=scoring_rows(cfg, teacher.path),
        # on CPU the teachers' replicas of a step score concurrently: each takes its share of the cores
        num_threads=None if gpu else cpu_threads(environ, share=_replica_count(cfg)),
        engine=teacher.engine,
        tensor_parallel=teacher.tensor_parallel,
        allow_unverified=cfg.allow_unverified,
        source=here,
        replica=replica,
        job_id=role.job_id,
        rank=role.rank,
    )


def _replica_count(cfg: RunConfig) -> int:
    """Every rank of every replica of every teacher: the teacher children that score a step at the same time."""
    return sum(teacher_replicas(cfg, t) * t.tensor_parallel for t in cfg.models.teachers)


def _replica(environ: Mapping[str, str], here: str, replicas: int) -> int:
    """This child's replica (MOPD_TEACHER_REPLICA; unset = 0). Raises RoleEnvError outside 0..replicas − 1."""
    raw = environ.get(child_env.TEACHER_REPLICA) or "0"
    try:
        replica = int(raw)
    except ValueError:
        replica = -1
    if not 0 <= replica < replicas:
        raise RoleEnvError(
            f"{child_env.TEACHER_REPLICA}={raw!r}: {here} has {replicas} replica(s); expected 0..{replicas - 1} "
            "(the plan of this run's config)"
        )
    return replica


async def run(
    role: RoleEnv, args: TeacherArgs, replica: ReplicaSpec | None = None, build: EngineBuilder = build_engine
) -> None:
    """Serve until SIGTERM/SIGINT or the end of the job: one process (`replica` None: tensor_parallel 1) or
    the leader of a TP replica (`lead_replica`). `build`: the engine builder (`TeacherEngines.build`)."""
    from mopd_hpc.engines.teacher.process import serve

    token = read_job_token(role)
    stop = asyncio.Event()
    watcher = asyncio.create_task(stop_on_job_end(role.run_dir, role.job_id, stop))
    try:
        if replica is None:
            await serve(args, token, stop, build)
        else:
            await lead_replica(args, replica, token, stop, build)
    finally:
        watcher.cancel()


def args_from_argv(argv: Sequence[str] | None, environ: Mapping[str, str]) -> TeacherArgs:
    """Parse `argv` with `environ` as fallback; exits with status 2 naming the missing flag/variable."""
    p = argparse.ArgumentParser(prog="python -m mopd_hpc.roles.teacher", description=__doc__.split("\n")[0])
    p.add_argument("--teacher-id", help=f"teacher id (env {ENV['teacher_id']})")
    p.add_argument("--model", dest="model_path", help=f"HF checkpoint dir (env {ENV['model_path']})")
    p.add_argument("--host", default=None, help=f"bind address (env {ENV['host']}; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help=f"TCP port, 0 = any (env {ENV['port']})")
    p.add_argument("--engine", default=None, choices=ENGINES, help=f"scoring engine (env {ENV['engine']})")
    p.add_argument("--device", default=None, help=f"auto | cpu | cuda | cuda:N (env {ENV['device']})")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help=f"env {ENV['dtype']}"
    )
    p.add_argument(
        "--run-dir", default=None, help=f"run directory for the endpoint file (env {ENV['run_dir']})"
    )
    p.add_argument("--max-batch-rows", type=int, default=64, help="rows per forward pass at most")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--token-file",
        default=None,
        help="0600 file of the token every route but /health requires (default: RUN_DIR/guard.token, else a "
        "new one; created when missing)",
    )
    ns = p.parse_args(argv)
    teacher_id = ns.teacher_id or environ.get(ENV["teacher_id"])
    model_path = ns.model_path or environ.get(ENV["model_path"])
    if not teacher_id:
        p.error(f"no teacher id: pass --teacher-id or set {ENV['teacher_id']}")
    if not model_path:
        p.error(f"no model: pass --model or set {ENV['model_path']}")
    port = cli_port(p, ns.port, environ, ENV["port"])
    dtype = ns.dtype or environ.get(ENV["dtype"]) or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        p.error(f"{ENV['dtype']}={dtype!r}: expected float32, bfloat16 or float16")
    engine = ns.engine or environ.get(ENV["engine"]) or "torch"
    if engine not in ENGINES:
        p.error(f"{ENV['engine']}={engine!r}: expected one of {', '.join(ENGINES)}")
    host = ns.host or environ.get(ENV["host"]) or "127.0.0.1"
    advertise = (
        host if host not in WILDCARD_HOSTS else environ.get(ENV["advertise_host"]) or socket.gethostname()
    )
    return TeacherArgs(
        teacher_id=teacher_id,
        model_path=model_path,
        host=host,
        port=port,
        advertise_host=advertise,
        device=ns.device or environ.get(ENV["device"]) or "auto",
        dtype=dtype,
        run_dir=ns.run_dir or environ.get(ENV["run_dir"]),
        max_batch_rows=ns.max_batch_rows,
        num_threads=ns.num_threads,
        engine=engine,
        token_file=ns.token_file,
    )


def main(argv: Sequence[str] | None = None, engines: TeacherEngines | None = None) -> int:
    """Entry point: reads os.environ once, here. No arguments: a job's teacher child (a one-process replica,
    or a TP replica's leader or follower); arguments: a standalone server (`args_from_argv`). `engines`: the
    job child's engines (None: the job's, `TeacherEngines()`). Exit 0 after a clean stop.

    Raises:
        ReplicaLostError: a rank of this child's TP replica is gone or silent (exit non-zero).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = dict(os.environ)
    if argv:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        from mopd_hpc.engines.teacher.process import serve

        args = args_from_argv(argv, environ)
        token, token_file = standalone_token(args.token_file, args.run_dir)
        logging.getLogger("mopd_hpc.teacher").info("teacher server token file: %s", token_file)
        asyncio.run(serve(args, token))
        return 0
    engines = engines or TeacherEngines()
    role, cfg = start_server_role(environ)
    args = teacher_args(role, cfg, environ, engines.specs)
    replica = replica_spec(role, cfg, args, environ)
    if replica is not None and replica.rank > 0:
        follow_replica(args, replica, engines.build)
        return 0
    asyncio.run(run(role, args, replica, engines.build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
