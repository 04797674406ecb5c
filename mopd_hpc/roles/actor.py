"""The `actor` role entry point the guard runs: `python -m mopd_hpc.roles.actor`.

Every actor child is one rank of the actor group (DESIGN.md §7); rank 0 is the MOPD controller, the other
ranks follow it (trainer/follower.py). In order, on every rank:

1. read the guard-given environment (once, here: `RoleEnv.from_env`) and the run's resolved config
   `run_dir/config.yaml` (model paths made absolute); torch threads: MOPD_ACTOR_THREADS, else the node's
   CPU budget split between its actor ranks (MOPD_LOCAL_WORLD_SIZE: they train at the same time);
2. derive the `ExecutionPlan` (which teachers are scored) and check model compatibility before anything
   trains: every scored teacher shares the actor's tokenizer (`mopd.compatibility.check_models`);
3. join the actor group (`roles/actor_group.py`: a one-rank `SoloGroup` at world size 1);
4. wait for the teacher replicas' and rollout endpoints, this job's records only
   (`MOPD_ENDPOINT_TIMEOUT_S`, default 600 s; the error names what is missing; every rank waits for the same
   servers, so they build their engines together);
5. build the train engine `models.actor.engine` names (the loss section bound once, the data-parallel rank
   of the group; `build_train_engine`), with a KL penalty its reference model (`build_reference`: the
   starting actor from models.actor.path, offloaded between uses), open a client per teacher over its
   replicas (`teacher_pool`: each request bounded by `models.teachers[].request_timeout_s`; every rank
   scores its own rows);
6. rank 0: the tokenizer, the routed data, the rollout clients (`rollout_clients`: each request bounded by
   `rollout.request_timeout_s`) and the weight sync (the `nccl` port), the
   SIGUSR2 checkpoint handler, on a GPU the residency decision (`roles/residency.py`: which teachers leave
   the GPU between phases; printed with the memory plan), then `Controller.run()`; a rank > 0: SIGUSR2 ignored (rank 0 decides when to
   checkpoint and sends the stop record), then `Follower.run()`, with weight_sync.backend awex its own AWEX
   writer at transfer rank infer_world + rank (`trainer/rank_writer.py`: every trainer rank writes; the
   MetaServer runs on rank 0 only).

Engines: torch (transformers on the child's device `RoleEnv.device`: the GPU the plan gives it, else CPU;
DDP over the actor group's gloo world on CPU at world > 1) or megatron (megatron-core on the child's GPU; at
world 1 a one-rank NCCL group, no port; at world DP × TP the actor group's NCCL world, megatron's TP and DP
groups derived from it, rank 0 the controller, the other ranks of its TP group joining its weight gathers).
Several GPU ranks (torch DDP over NCCL; megatron at TP > 1 or DP > 1) are refused by `config/capabilities.py`
alone until they have run on GPUs: the code path exists, the capability limit selects it. With weight_sync.backend awex, `main` puts the variables awex reads
itself into os.environ before anything imports it (`AwexJobConfig.trainer_env`, on every trainer rank: AWEX_MASTER_ADDR =
this child's own address, `master_address(role)`; DEVICE = the child's device index).

Exit codes: 0 finished or checkpointed on SIGUSR2; 2 a config or environment error; 3 a model
compatibility error; 1 anything else (the traceback is in the child's .err log; a rank that lost its peers
raises `PeerLostError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.config import ConfigError, RunConfig
from mopd_hpc.config.actor_refusals import actor_refusals, loss_refusals
from mopd_hpc.config.capabilities import ACTOR_ENGINES, standing
from mopd_hpc.config.parallel import teacher_replicas
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.micro_batch import MicroBatching
from mopd_hpc.engines.reference import ReferenceModel
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.teacher.replica_pool import TeacherPool
from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexUnavailableError
from mopd_hpc.mopd.compatibility import CompatibilityError, ModelFiles, check_models
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.roles.env import RoleEnv, RoleEnvError, cpu_threads, load_run, master_address, read_job_token
from mopd_hpc.roles.residency import teachers_to_offload
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.child_device import ChildDevice
from mopd_hpc.runtime.signals import CHECKPOINT_SIGNAL, CheckpointRequest
from mopd_hpc.trainer.controller import Controller, RunOutcome
from mopd_hpc.trainer.follower import Follower
from mopd_hpc.trainer.group import Group
from mopd_hpc.trainer.rank_step import ShardStep
from mopd_hpc.trainer.rank_writer import build_rank_writer
from mopd_hpc.trainer.weight_sync import SyncSettings, build_sync

log = logging.getLogger("mopd_hpc.trainer")

EXIT_CONFIG = 2
EXIT_INCOMPATIBLE = 3


def check_compatibility(cfg: RunConfig, plan: ExecutionPlan) -> None:
    """Every scored teacher shares the actor's tokenizer; each model's config.json is readable (teachers may
    differ in architecture and size: each runs its own servers).

    Raises:
        CompatibilityError: naming both models and the first difference.
    """
    actor = ModelFiles("actor", cfg.models.actor.path, cfg.models.tokenizer.path)
    teachers = [ModelFiles(t, cfg.models.teacher(t).path) for t in plan.teachers]
    report = check_models(actor, teachers)
    log.info("models compatible: tokenizer %s", report.tokenizer_digest[:16])


def check_actor_engine(cfg: RunConfig, role: RoleEnv, environ: Mapping[str, str]) -> str:
    """The engine `models.actor.engine` names, if this child can run it; checked before waiting for servers,
    from the declarations `mopd-submit --check` used (`config/capabilities.py` `actor_refusals`): this child's
    device (a GPU when the plan gives it one: `RoleEnv.device`, or CUDA_VISIBLE_DEVICES set), the actor
    world size (MOPD_WORLD_SIZE), the engine's tensor_parallel / pipeline_parallel, and the loss terms the job
    trains with it (`loss_refusals`: e.g. the KL penalty while no role scores a reference model); with
    `allow_unverified` the unverified ones pass, as at --check (`capabilities.standing`).

    Raises:
        RoleEnvError: an unknown engine, or one problem per refused field (the field, its value, the way
            out), e.g. megatron without a GPU (models.actor.engine), at tensor_parallel 2
            (models.actor.tensor_parallel), or torch on several GPU ranks (models.actor.engine).
    """
    actor = cfg.models.actor
    if actor.engine not in ACTOR_ENGINES:
        raise RoleEnvError(
            f"models.actor.engine={actor.engine!r}: expected one of {', '.join(ACTOR_ENGINES)}"
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    device = "gpu" if role.device.is_cuda or visible else "cpu"
    problems = actor_refusals(
        actor.engine,
        device,
        role.world_size,
        actor.tensor_parallel,
        actor.pipeline_parallel,
    ) + loss_refusals(actor.engine, cfg.loss)
    if problems := standing(problems, cfg.allow_unverified):  # what --check let through, as it did
        here = f" (this child: {child_env.WORLD_SIZE} {role.world_size}, CUDA_VISIBLE_DEVICES {visible!r})"
        raise RoleEnvError("; ".join(p.render() for p in problems) + here)
    return actor.engine


def build_train_engine(
    cfg: RunConfig,
    kind: str,
    device: ChildDevice,
    data_parallel: DataParallel | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Any:
    """The actor's train engine of `kind` (`check_actor_engine`), with the checkpoint loaded, on the child's
    `device` (`RoleEnv.device`): `TorchTrainEngine` (on `device.torch_name`: cuda:<index>, or cpu;
    `data_parallel` its rank of the actor group, default one rank) or `MegatronTrainEngine` (after
    `initialize_parallel(rank=rank, world_size=world_size, tensor_parallel=models.actor.tensor_parallel,
    device_index=device.index, expert_parallel=models.actor.expert_parallel)`: at world size > 1 on the actor group's NCCL world, which `join_group` has
    initialized; megatron's TP and DP groups are derived from it, TP innermost as config/parallel.py orders
    the ranks). Which shapes run is `config/capabilities.py`'s (`check_actor_engine`), nothing here.

    Raises:
        RoleEnvError: megatron-core does not import (naming models.actor.engine).
        EngineError: what the engine's constructor raises (dtype, device, loss section, checkpoint).
    """
    actor = cfg.models.actor
    if kind == "torch":
        from mopd_hpc.engines.torch.engine import TorchTrainEngine

        return TorchTrainEngine.from_pretrained(
            actor.path,
            dtype=actor.dtype,
            device=device.torch_name,
            optimizer=actor.optimizer,
            loss=cfg.loss,
            total_steps=cfg.steps,
            micro_batching=MicroBatching.from_actor(actor),
            data_parallel=data_parallel or DataParallel.single(),
        )
    try:
        from mopd_hpc.engines.megatron.build import build_from_hf
        from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
        from mopd_hpc.engines.megatron.parallel import initialize_parallel
    except ImportError as err:
        raise RoleEnvError(
            f"models.actor.engine='megatron' needs megatron-core, which does not import here ({err}); "
            "expected the megatron extra installed, or engine: torch"
        ) from None
    cuda = initialize_parallel(
        rank=rank,
        world_size=world_size,
        tensor_parallel=actor.tensor_parallel,
        device_index=device.index or 0,
        expert_parallel=actor.expert_parallel,
    )
    hf_config = json.loads((Path(actor.path) / "config.json").read_text(encoding="utf-8"))
    model, shape = build_from_hf(actor.path, hf_config, actor.dtype, cuda)
    return MegatronTrainEngine(
        model, shape, hf_config, cfg.loss, actor.optimizer, cuda, actor.dtype, MicroBatching.from_actor(actor),
        total_steps=cfg.steps,
    )  # fmt: skip


def build_reference(cfg: RunConfig, kind: str, engine: Any) -> ReferenceModel:
    """This rank's reference model for the KL penalty: a scoring engine of the actor's `kind` loaded from
    models.actor.path (never a run checkpoint: the starting weights, also after a resume), in the actor's
    dtype, on the actor engine's device (`engine.device`; megatron: after the engine's `initialize_parallel`),
    as many rows per forward as a teacher of the run would score (`roles.teacher.scoring_rows`).

    Raises:
        EngineError: what `ReferenceModel.load` raises.
    """
    from mopd_hpc.roles.teacher import scoring_rows

    actor = cfg.models.actor
    rows = scoring_rows(cfg, actor.path)
    return ReferenceModel.load(kind, actor.path, dtype=actor.dtype, device=engine.device, max_batch_rows=rows)


def awex_environment(role: RoleEnv, cfg: RunConfig) -> dict[str, str]:
    """The variables awex reads itself in the actor (its trainer rank, on its device): `AwexJobConfig.
    trainer_env(role.rank, master_address(role), role.device.index)` (device 0 for a CPU child, which awex
    refuses later); {} unless weight_sync.backend is awex.

    Raises:
        AwexConfigError: the AWEX settings of the job (`trainer.awex_job.awex_job_config`).
        AwexUnavailableError: awex (or megatron.core, which `import awex` needs) is not installed.
    """
    if cfg.weight_sync.backend != "awex":
        return {}
    from mopd_hpc.engines.weight_sync.awex import require_awex
    from mopd_hpc.trainer.awex_job import awex_job_config

    require_awex()

    return awex_job_config(cfg).trainer_env(role.rank, master_address(role), role.device.index or 0)


async def run_actor(role: RoleEnv, cfg: RunConfig, environ: Mapping[str, str], out: TextIO) -> int:
    """Steps 2-6 of the module docstring; returns the exit code."""
    from mopd_hpc.roles.actor_group import join_group
    from mopd_hpc.roles.endpoints import DEFAULT_TIMEOUT_S, wait_for_endpoints

    plan = ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids)
    check_compatibility(cfg, plan)
    kind = check_actor_engine(cfg, role, environ)
    token = read_job_token(role)  # the servers' token, read once here (before waiting for them)
    timeout_s = float(environ.get(child_env.ENDPOINT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)
    group = join_group(role, cfg, environ, timeout_s)
    try:
        replicas = {t: teacher_replicas(cfg, cfg.models.teacher(t)) for t in plan.teachers}
        endpoints = await wait_for_endpoints(
            role.run_dir, replicas, cfg.rollout.engines.count, role.job_id, timeout_s
        )
        print(
            f"servers ready: rollout {list(endpoints.rollout)}, teachers {dict(endpoints.teachers)}", file=out
        )
        dp = DataParallel(group.dp_rank, group.dp_size) if group.dp_size > 1 else DataParallel.single()
        engine = build_train_engine(cfg, kind, role.device, dp, group.rank, group.world_size)
        reference = build_reference(cfg, kind, engine) if plan.requires_reference else None
        async with contextlib.AsyncExitStack() as stack:
            teachers = {
                t: await stack.enter_async_context(teacher_pool(cfg, t, endpoints.teachers[t], token))
                for t in plan.teachers
            }
            if role.rank == 0:
                outcome = await _lead(
                    role, cfg, plan, engine, endpoints.rollout, teachers, group, token, out, reference
                )
            else:
                signal.signal(CHECKPOINT_SIGNAL, signal.SIG_IGN)  # rank 0 decides when to checkpoint
                shard_step = ShardStep(
                    engine,
                    teachers,
                    plan,
                    cfg.loss,
                    cfg.used_route_weights(),
                    group,
                    reference,
                    steps=cfg.steps,
                )
                writer = build_rank_writer(cfg, engine, role.run_dir)  # AWEX: its own shards at each sync
                outcome = await Follower(engine, shard_step, group, role.run_dir, writer).run()
    finally:
        group.close()
    log.info("actor rank %d ended: %s at step %d", role.rank, outcome.reason, outcome.step)
    return 0


def teacher_pool(cfg: RunConfig, teacher_id: str, urls: Sequence[str], token: str | None) -> TeacherPool:
    """The actor's client of one teacher's replicas (`urls`, in replica order): each request bounded by
    `models.teachers[].request_timeout_s` seconds, its errors naming the teacher, the replica and the URL."""
    timeout_s = cfg.models.teacher(teacher_id).request_timeout_s
    return TeacherPool(urls, name=teacher_id, token=token, timeout_s=timeout_s)


def rollout_clients(cfg: RunConfig, urls: Sequence[str], token: str | None) -> list[RolloutClient]:
    """Rank 0's clients of the rollout engines (`urls`, in engine order): each request bounded by
    `rollout.request_timeout_s` seconds (the answer's reading included), its errors naming the engine's
    index and URL ("rollout engine 0 at http://...")."""
    timeout_s = cfg.rollout.request_timeout_s
    return [
        RolloutClient(url, token=token, timeout_s=timeout_s, name=f"engine {i}") for i, url in enumerate(urls)
    ]


async def _lead(
    role: RoleEnv,
    cfg: RunConfig,
    plan: ExecutionPlan,
    engine: Any,
    rollout_urls: Sequence[str],
    teachers: Mapping[str, TeacherPool],
    group: Group,
    token: str | None,
    out: TextIO,
    reference: ReferenceModel | None = None,
) -> RunOutcome:
    """Rank 0: the controller with its collaborators (step 6 of the module docstring)."""
    from transformers import AutoTokenizer

    from mopd_hpc.roles.actor_group import sync_port
    from mopd_hpc.trainer.data_setup import build_run_data

    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    data = build_run_data(cfg)
    gpu = role.device.is_cuda
    sync = build_sync(
        cfg,
        engine,
        SyncSettings(master_address(role), sync_port(role), "nccl" if gpu else "gloo"),
        role.run_dir,
    )
    request = CheckpointRequest(lambda signum: log.info("signal %d: checkpoint after this step", signum))
    request.install()
    async with contextlib.AsyncExitStack() as stack:
        rollout = [
            await stack.enter_async_context(client) for client in rollout_clients(cfg, rollout_urls, token)
        ]
        controller = Controller(
            cfg,
            plan,
            engine,
            tokenizer,
            data,
            rollout=rollout,
            teachers=teachers,
            sync=sync,
            run_dir=role.run_dir,
            job_id=role.job_id,
            out=out,
            group=group,
            checkpoint_request=request,
            reference=reference,
            offload_teachers=teachers_to_offload(role, cfg, out),
        )
        outcome = await controller.run()
    # Its end is written: a late USR2 (the batch shell TERMs the trainer step once the servers' step ended on
    # the end record; the guard forwards it as USR2) has nothing left to checkpoint, and once the interpreter
    # finalizes, CPython resets a Python handler to USR2's default action: death by the signal.
    signal.signal(CHECKPOINT_SIGNAL, signal.SIG_IGN)
    return outcome


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
        threads = (
            int(environ[child_env.ACTOR_THREADS])
            if environ.get(child_env.ACTOR_THREADS)
            else cpu_threads(environ, share=role.local_world_size)  # the node's actor ranks train together
        )
    except (RoleEnvError, ConfigError) as exc:
        print(f"actor: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError:
        print(
            f"actor: {child_env.ACTOR_THREADS}={environ[child_env.ACTOR_THREADS]!r}: expected a positive integer",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        awex_env = awex_environment(role, cfg)
    except (AwexConfigError, AwexUnavailableError, OSError) as exc:
        print(f"actor: weight_sync.backend 'awex': {exc}", file=sys.stderr)
        return EXIT_CONFIG
    os.environ.update(awex_env)  # the edge: awex reads AWEX_MASTER_ADDR and DEVICE from os.environ itself
    environ.update(awex_env)
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
