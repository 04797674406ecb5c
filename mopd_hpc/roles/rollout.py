"""The `rollout` role entry point the guard runs: `python -m mopd_hpc.roles.rollout`.

It wraps the hf rollout server (`engines/rollout/hf_server.py`) for one engine of a run (with
`rollout.backend: sglang`, an in-process sglang.Engine instead: roles/rollout_sglang.py): everything comes
from the guard-given environment (read once, in `main`; `roles/env.py`) and the run's resolved
config `run_dir/config.yaml`:

    model        models.actor.path (the student: the rollout samples from the behavior policy μ = π_θ)
    port         the named port `http` (MOPD_PORT_HTTP), bound on the guard's address (`RoleEnv.bind_host`:
                 127.0.0.1 locally, the node's address on Slurm); every route but /health requires the job's
                 token (read once, in `run`)
    dtype        models.actor.dtype;  device: the child's (`RoleEnv.device`: the plan's GPU, else cpu)
    rows/batch   data.batch_size · data.samples_per_prompt (one step's rollouts decode together)
    seed         run seed + engine index (rows without a sampling_seed)
    AWEX         weight_sync.backend awex: AWEX_MASTER_ADDR is set in this process's environment (awex reads
                 it itself; unset, it probes 8.8.8.8 for its own address): `awex_env`
    allocator    hf: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the environment sets it
                 (`allocator_env`): the KV cache grows by one position per decode step, and with fixed
                 segments the caching allocator reserved 4× the cache (36 GiB for an 8.75 GiB cache at
                 64 × 4 × 256 on an H200, 120 GiB at 64 × 4 × 1024: the whole GPU of a colocated job). The
                 rollout engine only opens the actor's CUDA IPC handles (AWEX colocate), never exports its own.
                 sglang: nothing is added (torch_memory_saver disables itself with expandable segments), and
                 the environment the Engine starts in (this process's, after these additions) is the one
                 `sglang_backend.check_environment` checks.

Once the server listens it writes `run_dir/endpoints/rollout-<index>.json` atomically
({url, host, port, pid, index, job_id, model_path, backend}: roles/rollout_record.py) and serves until SIGTERM/SIGINT or until the actor
announces the end of the job (`records/job_end.py`); then it removes the endpoint file and exits 0.
SIGUSR2 (Slurm's checkpoint signal, sent to every process of the step) is ignored: a rollout server has
no state to save, and the actor and the guard decide when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.serving_refusals import rollout_refusals
from mopd_hpc.engines.rollout.graph_shape import graph_length, graph_rows
from mopd_hpc.engines.rollout.hf_server import ServerArgs
from mopd_hpc.records.job_end import stop_on_job_end
from mopd_hpc.records.run_dir import rollout_ready_file
from mopd_hpc.roles.env import (
    RoleEnv,
    RoleEnvError,
    cpu_threads,
    master_address,
    read_job_token,
    start_server_role,
)
from mopd_hpc.roles.rollout_record import publish_rollout_endpoint, rollout_endpoint

log = logging.getLogger("mopd_hpc.rollout")

#: The variable awex 0.9.0 reads for this node's address (AwexJobConfig.trainer_env sets it on the actor).
AWEX_MASTER_ADDR_ENV = "AWEX_MASTER_ADDR"


def engines_per_node(cfg: RunConfig) -> int:
    """Rollout engines that share a node: the engine count over the rollout group's nodes (rounded up)."""
    nodes = max(1, cfg.cluster.rollout_group.nodes)
    return -(-cfg.rollout.engines.count // nodes)


def server_args(role: RoleEnv, cfg: RunConfig, environ: Mapping[str, str]) -> ServerArgs:
    """The hf server's arguments for this engine (module docstring).

    Raises:
        RoleEnvError: what `config/capabilities.py` declares the rollout role does not run (`rollout_refusals`,
            the declaration `mopd-submit --check` used: another backend, an engine wider than one device).
    """
    if problems := rollout_refusals(cfg.rollout.backend, cfg.rollout.engines.tensor_parallel):
        raise RoleEnvError("; ".join(p.render() for p in problems))
    gpu = role.device.is_cuda
    return ServerArgs(
        model_path=cfg.models.actor.path,
        host=role.bind_host,
        port=role.port("http"),
        device=role.device.torch_name,
        dtype=cfg.models.actor.dtype,
        # rollout.graph_rows bounds the rows decoded together (the static KV cache), else a step's whole rows
        max_batch_rows=cfg.rollout.graph_rows or cfg.data.batch_size * cfg.data.samples_per_prompt,
        # CUDA: every batch (this engine's share of the step's rollouts, the evaluation's greedy rows) that
        # fits replays one compiled shape (plan/memory_plan.py counts its KV cache)
        graph_rows=graph_rows(
            cfg.data.batch_size,
            cfg.data.samples_per_prompt,
            cfg.rollout.engines.count,
            cfg.rollout.graph_rows,
        ),
        graph_length=graph_length(cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens),
        compile_decode=cfg.rollout.compile_decode,
        random_seed=cfg.seed + role.index,
        ready_file=str(rollout_ready_file(role.run_dir, role.index)),
        # the engines of a node sample at the same time; the other phases time-slice the node's cores
        num_threads=None if gpu else cpu_threads(environ, share=engines_per_node(cfg)),
    )


def awex_env(role: RoleEnv, cfg: RunConfig) -> dict[str, str]:
    """The variables awex reads in this process: {} unless weight_sync.backend is awex; then
    AWEX_MASTER_ADDR = 127.0.0.1 on the local backend, else this node's address (as the actor computes
    its rendezvous address: `roles.env.master_address`)."""
    if cfg.weight_sync.backend != "awex":
        return {}
    return {AWEX_MASTER_ADDR_ENV: master_address(role)}


async def _publish(role: RoleEnv, args: ServerArgs, stop: asyncio.Event) -> None:
    """Wait for the server's ready file, then write the endpoint record others connect to."""
    ready = Path(args.ready_file or "")
    while not stop.is_set() and not ready.exists():
        await asyncio.sleep(0.05)
    if stop.is_set():
        return
    info = json.loads(ready.read_text(encoding="utf-8"))
    publish_rollout_endpoint(role, int(info["port"]), args.model_path, "hf")


async def run(role: RoleEnv, args: ServerArgs) -> None:
    """Serve until SIGTERM/SIGINT or the end of the job; the endpoint file is removed on the way out."""
    from mopd_hpc.engines.rollout.hf_server import serve

    token = read_job_token(role)
    stop = asyncio.Event()
    endpoint = rollout_endpoint(role)
    endpoint.parent.mkdir(parents=True, exist_ok=True)
    Path(args.ready_file or "").unlink(missing_ok=True)
    tasks = [
        asyncio.create_task(_publish(role, args, stop)),
        asyncio.create_task(stop_on_job_end(role.run_dir, role.job_id, stop)),
    ]
    try:
        await serve(args, token, stop)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for path in (endpoint, Path(args.ready_file or "")):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                path.unlink()


#: torch's allocator settings variable (read by torch when CUDA first allocates).
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def allocator_env(environ: Mapping[str, str], backend: str = "hf") -> dict[str, str]:
    """{PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True} for the hf backend unless `environ` sets it; {} for
    sglang, whose memory saver (always on: `SGLangLaunch.enable_memory_saver`) disables itself with
    expandable segments (module docstring)."""
    if backend == "sglang" or environ.get(ALLOC_CONF_ENV):
        return {}
    return {ALLOC_CONF_ENV: "expandable_segments:True"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: reads os.environ once, here. Exit 0 after a clean stop."""
    del argv
    environ = dict(os.environ)
    role, cfg = start_server_role(environ)
    # before anything allocates on the GPU; awex reads its variable from os.environ itself
    added = allocator_env(environ, cfg.rollout.backend) | awex_env(role, cfg)
    os.environ.update(added)
    environ |= added  # what the in-process Engine (and the processes it spawns) start with
    if cfg.rollout.backend == "sglang":
        from mopd_hpc.roles.rollout_sglang import run_sglang

        asyncio.run(run_sglang(role, cfg, environ))
    else:
        asyncio.run(run(role, server_args(role, cfg, environ)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
