"""Serve one teacher: build its scoring engine, listen, publish its endpoint, stop cleanly.

`serve(args)` loads the checkpoint once with the scoring engine `args.engine` names (`build_engine`): `torch`
(transformers, CPU or GPU) or `megatron` (megatron-core GPTModel, CUDA only; at tensor parallel 1 a one-rank
NCCL group rendezvoused in memory, torn down when the server stops; at tensor parallel > 1 one shard per
rank of the replica's TP group, which roles/teacher_replica.py forms, its leader serving through
`serve_engine`). When the server listens and
`args.run_dir` is known, it writes `run_dir/endpoints/teacher-<id>.r<replica>.json` atomically
(records/endpoint.py `EndpointRecord`; job_id null for a standalone server, whose record no job accepts) and logs "teacher server ready". Setting `stop` (or SIGTERM/SIGINT) stops it
cleanly and removes the endpoint file. Routes: `http_app`; every one requires the job's token except
the bare liveness probe (`teacher_app`, `runtime/http_auth.py`). The programs that run it (a job's teacher
child, or a standalone server from flags) are `roles/teacher.py`; they read the token and pass it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopd_hpc.config.capabilities import TEACHER_ENGINES
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.serving import start_app
from mopd_hpc.records.endpoint import EndpointRecord
from mopd_hpc.records.run_dir import teacher_endpoint_file
from mopd_hpc.runtime.http_auth import protect

if TYPE_CHECKING:
    import torch
    from aiohttp import web

    from mopd_hpc.engines.teacher.http_app import TeacherServer

log = logging.getLogger("mopd_hpc.teacher")

#: Scoring engines this server builds (`TeacherConfig.engine`).
ENGINES = tuple(TEACHER_ENGINES)


@dataclass(frozen=True, slots=True)
class TeacherArgs:
    """What `serve` needs, resolved. Build with `roles.teacher.args_from_argv(argv, environ)` (a standalone
    server) or, in a job, `roles.teacher.teacher_args`.

    `engine` is "torch" or "megatron"; `tensor_parallel`: the replica's TP size, at most what
    `config/capabilities.py` declares for the engine, or above it where the declaration calls the larger size
    unverified and `allow_unverified` (the config's) is set (at 1 one process serves; above, `rank` is this process's
    rank in the replica's TP group, 0 the leader that serves HTTP, the others its followers:
    roles/teacher_replica.py); `source` is where the engine settings came from, for error messages: the teacher's config path
    (`models.teachers[0]`), or "" for the command line (errors then name `--engine`). `token_file`: the
    standalone server's `--token-file` (None: the run dir's, else a new one; `http_auth.standalone_token`);
    a job's teacher reads the run dir's. `replica`: which of the teacher's scoring servers this is
    (`models.teachers[i].replicas`); `job_id`: the job this server belongs to, written into its endpoint
    record (None for a standalone server: no job accepts its record).
    """

    teacher_id: str
    model_path: str
    host: str
    port: int
    advertise_host: str
    device: str = "auto"
    dtype: str = "float32"
    run_dir: str | None = None
    max_batch_rows: int = 64
    num_threads: int | None = None
    engine: str = "torch"
    tensor_parallel: int = 1
    allow_unverified: bool = False
    source: str = ""
    token_file: str | None = None
    replica: int = 0
    job_id: str | None = None
    rank: int = 0

    def field(self, name: str) -> str:
        """How the user set `name` (`engine`, `tensor_parallel`): its config path, or `--engine` / the bare
        name (tensor_parallel has no flag: the command line always serves at 1)."""
        if self.source:
            return f"{self.source}.{name}"
        return "--engine" if name == "engine" else name


def endpoint_path(run_dir: str | Path, teacher_id: str, replica: int = 0) -> Path:
    """`run_dir/endpoints/teacher-<id>.r<replica>.json` (`records/run_dir.py teacher_endpoint_file`)."""
    return teacher_endpoint_file(run_dir, teacher_id, replica)


def build_engine(args: TeacherArgs) -> Any:
    """The scoring engine `args` names, with the checkpoint loaded: `TorchScoringEngine` (engine "torch") or
    `MegatronScoringEngine` (engine "megatron", after megatron's parallel state on its CUDA device: over a
    one-rank NCCL group at tensor_parallel 1, over the replica's TP world — formed already, as the default
    group, by roles/teacher_replica.py — at tensor_parallel > 1, this rank `args.rank`'s shard). Both serve
    `TeacherServer`: score(batch, k), vocab_size, residency, offload/onload, load_weights(path).

    Raises:
        EngineError: tensor_parallel above the engine's declared size (`config/capabilities.py`
            TEACHER_ENGINES; unless it is unverified there and `allow_unverified` is set), an unknown engine, megatron without a CUDA device or without
            megatron-core (the message names the field: `models.teachers[i].engine` in a job, `--engine` on
            the command line), or what the engine's `from_pretrained` raises (dtype, device, checkpoint).
    """
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    spec = TEACHER_ENGINES.get(args.engine)  # the declaration `mopd-submit --check` used
    opted_in = spec is not None and args.allow_unverified and "tensor_parallel" in spec.unverified
    if spec is not None and args.tensor_parallel > spec.tensor_parallel and not opted_in:
        raise EngineError(
            f"{args.field('tensor_parallel')}={args.tensor_parallel}: the teacher server runs a {args.engine} "
            f"teacher at tensor_parallel ≤ {spec.tensor_parallel}; expected ≤ {spec.tensor_parallel}"
        )
    if args.engine == "torch":
        return TorchScoringEngine.from_pretrained(
            args.model_path, dtype=args.dtype, device=args.device, max_batch_rows=args.max_batch_rows
        )
    if args.engine != "megatron":
        raise EngineError(f"{args.field('engine')}={args.engine!r}: expected one of {', '.join(ENGINES)}")
    device = megatron_device(args)
    try:
        from mopd_hpc.engines.megatron.parallel import initialize_parallel
        from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine
    except ImportError as err:
        raise EngineError(
            f"{args.field('engine')}='megatron' needs megatron-core, which does not import here ({err}); "
            "expected the megatron extra installed, or engine 'torch'"
        ) from None
    tp = args.tensor_parallel  # > 1: the default group is the replica's world, kept by initialize_parallel
    initialize_parallel(rank=args.rank, world_size=tp, tensor_parallel=tp, device_index=device.index or 0)
    return MegatronScoringEngine.from_pretrained(
        args.model_path, dtype=args.dtype, device=device, max_batch_rows=args.max_batch_rows
    )


def megatron_device(args: TeacherArgs) -> torch.device:
    """The CUDA device of a megatron teacher: `args.device` ("auto" and "cuda" → cuda:0, the first visible).

    Raises:
        EngineError: no CUDA device is available, or `args.device` is not a CUDA device; the message
            names the engine field.
    """
    import torch

    name = args.field("engine")
    if not torch.cuda.is_available():
        raise EngineError(
            f"{name}='megatron' needs a CUDA device, but none is available to this process (no GPU, or "
            "CUDA_VISIBLE_DEVICES empty); expected a GPU node, or engine 'torch'"
        )
    try:
        device = torch.device("cuda" if args.device == "auto" else args.device)
    except RuntimeError as err:
        raise EngineError(f"device={args.device!r}: {err}; expected 'cuda:N'") from None
    if device.type != "cuda":
        raise EngineError(
            f"{name}='megatron' runs on CUDA only, but the device is {args.device!r}; "
            "expected 'auto', 'cuda' or 'cuda:N'"
        )
    return torch.device("cuda", device.index or 0)


def pad_token_id(engine: Any) -> int:
    """The engine's padding id: its `pad_token_id` (megatron) or its transformers config's; 0 when none."""
    pad = getattr(engine, "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(getattr(engine, "model", None), "config", None), "pad_token_id", None)
    return int(pad or 0)


def shutdown_parallel(args: TeacherArgs) -> None:
    """Tear down what `build_engine` set up for a megatron teacher (megatron's parallel state, the NCCL
    group); nothing for torch. Megatron's state exists only when megatron was imported (it is not imported
    here for nothing: a slow import, seconds)."""
    if args.engine != "megatron":
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def teacher_app(server: TeacherServer, token: str) -> web.Application:
    """The server's app as it is served: `TeacherServer.app()` behind the job's token
    (`http_auth.protect`)."""
    return protect(server.app(), token)


async def serve(
    args: TeacherArgs,
    token: str,
    stop: asyncio.Event | None = None,
    build: Callable[[TeacherArgs], Any] = build_engine,
) -> None:
    """Load the checkpoint (`build(args)`: `build_engine`; tests pass a stand-in), listen (every route but the
    liveness probe requires `token`), write the endpoint file, and serve until `stop` (or SIGTERM/SIGINT);
    then remove the endpoint file and tear down what `build_engine` set up (`shutdown_parallel`).

    Raises:
        EngineError: from `build_engine` (before anything listens).
    """
    set_threads(args)
    try:
        engine = await asyncio.to_thread(build, args)
        await serve_engine(args, token, engine, stop)
    finally:
        shutdown_parallel_quietly(args)


def set_threads(args: TeacherArgs) -> None:
    """torch's CPU threads: `args.num_threads` when given."""
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)


async def serve_engine(args: TeacherArgs, token: str, engine: Any, stop: asyncio.Event | None) -> None:
    """Serve `engine` (built already; a TP replica's leader passes its `TPLeader`) as `serve` does, from the
    listening socket to the endpoint file's removal; the caller tears the engine down."""
    from mopd_hpc.engines.teacher.http_app import TeacherServer

    server = TeacherServer(engine, args.teacher_id, args.model_path, pad_id=pad_token_id(engine))
    runner, port, stop = await start_app(teacher_app(server, token), args.host, args.port, stop)
    url = f"http://{args.advertise_host}:{port}"
    if args.run_dir:
        record = EndpointRecord.teacher(
            args.teacher_id,
            args.replica,
            host=args.advertise_host,
            port=port,
            pid=os.getpid(),
            job_id=args.job_id,
            model_path=args.model_path,
            fingerprint=server.fingerprint,
        )
        record.write(args.run_dir)
    log.info(
        "teacher server ready: %s replica %d on %s (model %s, engine %s, device %s)",
        args.teacher_id,
        args.replica,
        url,
        args.model_path,
        args.engine,
        engine.device,
    )
    try:
        await stop.wait()
    finally:
        log.info("teacher server %s stopping", args.teacher_id)
        if args.run_dir:  # a stale endpoint would send the controller to a closed port
            with contextlib.suppress(FileNotFoundError):
                endpoint_path(args.run_dir, args.teacher_id, args.replica).unlink()
        await runner.cleanup()


def shutdown_parallel_quietly(args: TeacherArgs) -> None:
    """`shutdown_parallel`, logging (not raising) a failure: the server is stopping either way."""
    try:
        shutdown_parallel(args)
    except Exception:
        log.exception("teacher server %s: tearing down the megatron process group failed", args.teacher_id)
