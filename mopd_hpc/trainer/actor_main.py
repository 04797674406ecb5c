"""The `actor` role entry point the guard runs: `python -m mopd_hpc.trainer.actor_main`.

Rank 0 of the actor is the MOPD controller. In order:

1. read the guard-given environment (once, here: `RoleEnv.from_env`) and the run's resolved config
   `run_dir/config.yaml` (model paths made absolute);
2. derive the `ExecutionPlan` (which teachers are scored) and check model compatibility before anything
   trains: every scored teacher shares the actor's tokenizer (`mopd.compatibility.check_models`);
3. wait for the teacher and rollout endpoints (`MOPD_ENDPOINT_TIMEOUT_S`, default 600 s; the error names
   what is missing);
4. build the train engine (the loss section bound once), the tokenizer and the routed data, install the
   SIGUSR2 checkpoint handler, and run `Controller.run()`.

Exit codes: 0 finished or checkpointed on SIGUSR2; 2 a config or environment error; 3 a model
compatibility error; 1 anything else (the traceback is in the child's .err log).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from mopd_hpc.config import ConfigError, RunConfig
from mopd_hpc.mopd.compatibility import CompatibilityError, ModelFiles, check_models
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.runtime.signals import CheckpointRequest
from mopd_hpc.trainer.role_env import RoleEnv, RoleEnvError, cpu_threads, load_run

log = logging.getLogger("mopd_hpc.trainer")

EXIT_CONFIG = 2
EXIT_INCOMPATIBLE = 3
#: Variables read at the edge besides the guard's (`role_env.ENV`).
ENDPOINT_TIMEOUT_ENV = "MOPD_ENDPOINT_TIMEOUT_S"
THREADS_ENV = "MOPD_ACTOR_THREADS"


def check_compatibility(cfg: RunConfig, plan: ExecutionPlan) -> None:
    """Every scored teacher shares the actor's tokenizer (and the teachers one architecture).

    Raises:
        CompatibilityError: naming both models and the first difference.
    """
    actor = ModelFiles("actor", cfg.models.actor.path, cfg.models.tokenizer.path)
    teachers = [ModelFiles(t, cfg.models.teacher(t).path) for t in plan.teachers]
    report = check_models(actor, teachers)
    log.info("models compatible: tokenizer %s", report.tokenizer_digest[:16])


def master_address(role: RoleEnv) -> str:
    """The weight-sync rendezvous address: loopback locally, this node's address on a cluster."""
    if role.backend == "local":
        return "127.0.0.1"
    return socket.gethostbyname(role.host)


async def run_actor(role: RoleEnv, cfg: RunConfig, environ: Mapping[str, str], out: TextIO) -> int:
    """Steps 2-4 of the module docstring; returns the exit code."""
    from transformers import AutoTokenizer

    from mopd_hpc.engines.torch_engine import TorchTrainEngine
    from mopd_hpc.trainer.controller import Controller, SyncSettings
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.endpoints import DEFAULT_TIMEOUT_S, wait_for_endpoints

    plan = ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids)
    check_compatibility(cfg, plan)
    if role.world_size > 1:
        raise RoleEnvError(
            f"actor world size {role.world_size}: the torch engine trains on one process; "
            "use one trainer slot (cluster.<group>.nodes = 1, gpus_per_node <= 1) or engine: megatron"
        )
    timeout_s = float(environ.get(ENDPOINT_TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    endpoints = await wait_for_endpoints(
        role.run_dir, plan.teachers, cfg.rollout.engines.count, role.job_id, timeout_s
    )
    print(f"servers ready: rollout {list(endpoints.rollout)}, teachers {dict(endpoints.teachers)}", file=out)
    gpu = bool(environ.get("CUDA_VISIBLE_DEVICES"))
    engine = TorchTrainEngine.from_pretrained(
        cfg.models.actor.path,
        dtype=cfg.models.actor.dtype,
        device="cuda" if gpu else "cpu",
        optimizer=cfg.models.actor.optimizer,
        loss=cfg.loss,
        total_steps=cfg.steps,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    data = build_run_data(cfg)
    request = CheckpointRequest(lambda signum: log.info("signal %d: checkpoint after this step", signum))
    request.install()
    controller = Controller(
        cfg,
        plan,
        engine,
        tokenizer,
        data,
        endpoints,
        SyncSettings(master_address(role), role.port("master"), "nccl" if gpu else "gloo"),
        role.run_dir,
        role.job_id,
        out,
        checkpoint_request=request,
    )
    outcome = await controller.run()
    log.info("controller ended: %s at step %d", outcome.reason, outcome.step)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: reads os.environ once, here."""
    del argv
    environ = dict(os.environ)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        role = RoleEnv.from_env(environ)
        cfg = load_run(role.run_dir, environ)
        threads = int(environ[THREADS_ENV]) if environ.get(THREADS_ENV) else cpu_threads(environ)
    except (RoleEnvError, ConfigError) as exc:
        print(f"actor: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError:
        print(f"actor: {THREADS_ENV}={environ[THREADS_ENV]!r}: expected a positive integer", file=sys.stderr)
        return EXIT_CONFIG
    import torch

    torch.set_num_threads(max(1, threads))
    torch.manual_seed(cfg.seed)
    try:
        return asyncio.run(run_actor(role, cfg, environ, sys.stdout))
    except CompatibilityError as exc:
        print(f"actor: model compatibility check failed: {exc}", file=sys.stderr)
        return EXIT_INCOMPATIBLE
    except RoleEnvError as exc:
        print(f"actor: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
