"""The `teacher` role entry point the guard runs: `python -m mopd_hpc.engines.teacher_main`.

    python -m mopd_hpc.engines.teacher_main --teacher-id ID --model PATH [--port N] [--host 127.0.0.1]
        [--engine torch|megatron] [--device auto|cpu|cuda|cuda:N] [--dtype float32|bfloat16|float16]
        [--run-dir DIR] [--max-batch-rows 64] [--num-threads N]

Each flag not given falls back to its variable of `ENV` (read once, in `main`). The scoring engine
(`build_engine`): `torch` (transformers, CPU or GPU) or `megatron` (megatron-core GPTModel, CUDA only,
tensor parallel 1: a one-rank NCCL group rendezvoused in memory, torn down when the server stops). The
checkpoint is loaded once; when the server listens and `--run-dir` is known, it writes
`run_dir/endpoints/teacher-<id>.json` atomically ({teacher_id, host, port, url, pid, model_path,
fingerprint}) and logs "teacher server ready". SIGTERM or SIGINT stops it cleanly (exit 0) and removes the
endpoint file. Routes: `teacher_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.serving import start_app

if TYPE_CHECKING:
    import torch

log = logging.getLogger("mopd_hpc.teacher")

#: Logical key → environment variable (read at the edge, in `main`).
ENV = {
    "teacher_id": "MOPD_TEACHER_ID",
    "model_path": "MOPD_MODEL_PATH",
    "port": "MOPD_PORT_HTTP",
    "run_dir": "MOPD_RUN_DIR",
    "host": "MOPD_BIND_HOST",
    "advertise_host": "MOPD_HOST",
    "device": "MOPD_DEVICE",
    "dtype": "MOPD_DTYPE",
    "engine": "MOPD_TEACHER_ENGINE",
}
#: Scoring engines this server builds (`TeacherConfig.engine`).
ENGINES = ("torch", "megatron")
#: Bind addresses that cannot be connected to as given: the endpoint file advertises MOPD_HOST instead.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class TeacherArgs:
    """The resolved command line. Build with `TeacherArgs.from_argv(argv, environ)` (or, in a job,
    `trainer.teacher_role.teacher_args`).

    `engine` is "torch" or "megatron"; `tensor_parallel` must be 1 (one process, no follower ranks);
    `source` is where the engine settings came from, for error messages: the teacher's config path
    (`models.teachers[0]`), or "" for the command line (errors then name `--engine`).
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
    source: str = ""

    def field(self, name: str) -> str:
        """How the user set `name` (`engine`, `tensor_parallel`): its config path, or `--engine` / the bare
        name (tensor_parallel has no flag: the command line always serves at 1)."""
        if self.source:
            return f"{self.source}.{name}"
        return "--engine" if name == "engine" else name

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, environ: Mapping[str, str]) -> TeacherArgs:
        """Parse `argv` with `environ` as fallback; exits with status 2 naming the missing flag/variable."""
        p = argparse.ArgumentParser(
            prog="python -m mopd_hpc.engines.teacher_main", description=__doc__.split("\n")[0]
        )
        p.add_argument("--teacher-id", help=f"teacher id (env {ENV['teacher_id']})")
        p.add_argument("--model", dest="model_path", help=f"HF checkpoint dir (env {ENV['model_path']})")
        p.add_argument("--host", default=None, help=f"bind address (env {ENV['host']}; default 127.0.0.1)")
        p.add_argument("--port", type=int, default=None, help=f"TCP port, 0 = any (env {ENV['port']})")
        p.add_argument(
            "--engine", default=None, choices=ENGINES, help=f"scoring engine (env {ENV['engine']})"
        )
        p.add_argument("--device", default=None, help=f"auto | cpu | cuda | cuda:N (env {ENV['device']})")
        p.add_argument(
            "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help=f"env {ENV['dtype']}"
        )
        p.add_argument(
            "--run-dir", default=None, help=f"run directory for the endpoint file (env {ENV['run_dir']})"
        )
        p.add_argument("--max-batch-rows", type=int, default=64, help="rows per forward pass at most")
        p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        ns = p.parse_args(argv)
        teacher_id = ns.teacher_id or environ.get(ENV["teacher_id"])
        model_path = ns.model_path or environ.get(ENV["model_path"])
        if not teacher_id:
            p.error(f"no teacher id: pass --teacher-id or set {ENV['teacher_id']}")
        if not model_path:
            p.error(f"no model: pass --model or set {ENV['model_path']}")
        port = ns.port
        if port is None:
            raw = environ.get(ENV["port"])
            if raw is None:
                p.error(f"no port: pass --port or set {ENV['port']}")
            try:
                port = int(raw)
            except ValueError:
                p.error(f"{ENV['port']}={raw!r}: expected a TCP port number")
        if not 0 <= port <= 65535:
            p.error(f"port={port}: expected a TCP port in [0, 65535]")
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
        return cls(
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
        )


def endpoint_path(run_dir: str | Path, teacher_id: str) -> Path:
    """`run_dir/endpoints/teacher-<id>.json`."""
    return Path(run_dir) / "endpoints" / f"teacher-{teacher_id}.json"


def build_engine(args: TeacherArgs) -> Any:
    """The scoring engine `args` names, with the checkpoint loaded: `TorchScoringEngine` (engine "torch") or
    `MegatronScoringEngine` (engine "megatron", after a one-rank NCCL group and megatron's parallel state on
    its CUDA device). Both serve `TeacherServer`: score(batch, k), vocab_size, residency, offload/onload,
    load_weights(path).

    Raises:
        EngineError: tensor_parallel != 1, an unknown engine, megatron without a CUDA device or without
            megatron-core (the message names the field: `models.teachers[i].engine` in a job, `--engine` on
            the command line), or what the engine's `from_pretrained` raises (dtype, device, checkpoint).
    """
    from mopd_hpc.engines.torch_engine import TorchScoringEngine

    if args.tensor_parallel != 1:
        raise EngineError(
            f"{args.field('tensor_parallel')}={args.tensor_parallel}: the teacher server is one process "
            "(no follower ranks); expected 1"
        )
    if args.engine == "torch":
        return TorchScoringEngine.from_pretrained(
            args.model_path, dtype=args.dtype, device=args.device, max_batch_rows=args.max_batch_rows
        )
    if args.engine != "megatron":
        raise EngineError(f"{args.field('engine')}={args.engine!r}: expected one of {', '.join(ENGINES)}")
    device = megatron_device(args)
    try:
        from mopd_hpc.engines.megatron.engine import MegatronScoringEngine, initialize_parallel
    except ImportError as err:
        raise EngineError(
            f"{args.field('engine')}='megatron' needs megatron-core, which does not import here ({err}); "
            "expected the megatron extra installed, or engine 'torch'"
        ) from None
    initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=device.index or 0)
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
    group); nothing for torch."""
    if args.engine != "megatron":
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


async def serve(args: TeacherArgs, stop: asyncio.Event | None = None) -> None:
    """Load the checkpoint, listen, write the endpoint file, and serve until `stop` (or SIGTERM/SIGINT);
    then remove the endpoint file and tear down what `build_engine` set up (`shutdown_parallel`).

    Raises:
        EngineError: from `build_engine` (before anything listens).
    """
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        engine = await asyncio.to_thread(build_engine, args)
        await _serve_engine(args, engine, stop)
    finally:
        shutdown_parallel_quietly(args)


async def _serve_engine(args: TeacherArgs, engine: Any, stop: asyncio.Event | None) -> None:
    from mopd_hpc.engines.teacher_server import TeacherServer

    server = TeacherServer(engine, args.teacher_id, args.model_path, pad_id=pad_token_id(engine))
    runner, port, stop = await start_app(server.app(), args.host, args.port, stop)
    url = f"http://{args.advertise_host}:{port}"
    if args.run_dir:
        path = endpoint_path(args.run_dir, args.teacher_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "teacher_id": args.teacher_id,
            "host": args.advertise_host,
            "port": port,
            "url": url,
            "pid": os.getpid(),
            "model_path": args.model_path,
            "fingerprint": server.fingerprint,
        }
        atomic_write_json(path, record)
    log.info(
        "teacher server ready: %s on %s (model %s, engine %s, device %s)",
        args.teacher_id,
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
                endpoint_path(args.run_dir, args.teacher_id).unlink()
        await runner.cleanup()


def shutdown_parallel_quietly(args: TeacherArgs) -> None:
    """`shutdown_parallel`, logging (not raising) a failure: the server is stopping either way."""
    try:
        shutdown_parallel(args)
    except Exception:
        log.exception("teacher server %s: tearing down the megatron process group failed", args.teacher_id)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: reads os.environ once, here, and passes it down."""
    environ = dict(os.environ)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    args = TeacherArgs.from_argv(argv, environ)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
