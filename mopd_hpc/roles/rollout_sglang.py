"""The rollout role with `rollout.backend: sglang`: one in-process `sglang.Engine` per rollout child, behind
the same HTTP surface as the hf server (engines/rollout/sglang_server.py), so the trainer cannot tell them apart.

From the guard-given environment and the run's config (roles/rollout.py reads both once, in `main`):

    ports        the child's named leases: `http` (our aiohttp server), `nccl`, `dist_init` (the Engine's):
                 `SGLangLaunch.from_ports`, never positional
    tp_size      rollout.engines.tensor_parallel (the child's CUDA_VISIBLE_DEVICES holds the engine's GPUs;
                 base_gpu_id is its device index there)
    model        models.actor.path, dtype models.actor.dtype, seed run seed + engine index
    graphs       decode CUDA graphs up to the rows this engine decodes in a step (`graph_rows`)
    memory       rollout.mem_fraction_static (null: config/rollout.py SGLANG_MEM_FRACTION) of the GPU for
                 weights + KV pool
    AWEX         weight_sync.backend awex: AWEX's worker hooks installed before the Engine; the instance starts
                 with its weights released, so readiness is /model_info instead of the generating /health
                 (`readiness_path`)
    environment  `check_environment` refuses SGLANG_RETURN_ORIGINAL_LOGPROB=1 (μ would be T = 1 log-probs)
                 and expandable_segments (the memory saver would be off), in the environment the Engine
                 starts with (roles/rollout.py `main` adds nothing to it for sglang)
    version      an installed sglang outside the versions the role has run with
                 (`config/capabilities.py` ROLLOUT_BACKENDS["sglang"].versions) is refused, naming both
    weights      weight_sync.backend torch: the Engine's TP workers join the broadcast group; ipc (colocated):
                 the actor's shared buffers reach SGLang's `update_weights_from_tensor` as references
                 (engines/rollout/sglang_ipc.py); the server answers the step's weight_version with every
                 rollout

Memory: with `rollout.mode: colocated` the controller has the engine release kv_cache, weights and cuda_graph
when the step leaves ROLLOUT and resume weights before, kv_cache and cuda_graph after the weight sync
(trainer/rollout_memory.py, through the server's /release_memory_occupation and /resume_memory_occupation).

Readiness: once our server listens, the role probes `readiness_path` with the job's token until it answers
200, and only then writes the endpoint record (roles/rollout_record.py). It serves until SIGTERM/SIGINT or the
end of the job, then removes the record and shuts the Engine down.

Tested in CI with a stand-in that has sglang.Engine's Python API as SGLang 0.5.17 defines it
(tests/engines/test_rollout_role_sglang.py; the ipc weight path: tests/engines/test_sglang_ipc.py; the memory calls over three
controller steps: tests/engines/test_sglang_phase_memory.py); SGLang 0.5.17 itself runs on the GPU machines (torch
2.11). Every call to the Engine is made on one thread, the one that built it (engine_thread.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from mopd_hpc.config import RunConfig
from mopd_hpc.config.job_gaps import installed_version
from mopd_hpc.config.serving_refusals import version_refusals
from mopd_hpc.engines.rollout.engine_thread import EngineThread
from mopd_hpc.engines.rollout.graph_shape import graph_rows
from mopd_hpc.engines.rollout.sglang_backend import (
    SGLangBackendError,
    SGLangLaunch,
    check_environment,
    readiness_path,
)
from mopd_hpc.engines.rollout.sglang_server import SGLangRolloutServer, sglang_app, start_engine
from mopd_hpc.engines.serving import start_app
from mopd_hpc.records.job_end import stop_on_job_end
from mopd_hpc.roles.env import RoleEnv, read_job_token
from mopd_hpc.roles.rollout_record import publish_rollout_endpoint, rollout_endpoint
from mopd_hpc.runtime.http_auth import auth_headers

log = logging.getLogger("mopd_hpc.rollout")

#: Seconds between readiness probes, and the longest a probe may take (SGLang's own health timeout is 20 s).
PROBE_PERIOD_S, PROBE_TIMEOUT_S = 0.2, 30.0


def sglang_launch(role: RoleEnv, cfg: RunConfig) -> SGLangLaunch:
    """The Engine's arguments for this child (module docstring).

    Raises:
        SGLangBackendError: a named port missing, or a launch value out of range.
    """
    return SGLangLaunch.from_ports(
        cfg.models.actor.path,
        role.ports,
        host=role.bind_host,
        tp_size=cfg.rollout.engines.tensor_parallel,
        base_gpu_id=role.device.index or 0,
        random_seed=cfg.seed + role.index,
        dtype=cfg.models.actor.dtype,
        mem_fraction_static=cfg.rollout.sglang_mem_fraction,
        awex=cfg.weight_sync.backend == "awex",
        cuda_graph_max_bs=graph_rows(
            cfg.data.batch_size, cfg.data.samples_per_prompt, cfg.rollout.engines.count
        ),
    )


async def wait_ready(url: str, token: str, stop: asyncio.Event) -> bool:
    """Probe `url` with the job's token until it answers 200 (True), or until `stop` is set (False)."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession(headers=auth_headers(token), timeout=timeout) as http:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(url) as answer:
                    if answer.status == 200:
                        return True
            await asyncio.sleep(PROBE_PERIOD_S)
    return False


async def run_sglang(
    role: RoleEnv,
    cfg: RunConfig,
    environ: Mapping[str, str],
    engine_factory: Callable[[SGLangLaunch], Any] = start_engine,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve one sglang rollout engine until SIGTERM/SIGINT, `stop`, or the end of the job.

    `engine_factory` builds the Engine from the launch (`sglang.Engine`; tests pass a stand-in).

    Raises:
        SGLangBackendError: the environment, the installed sglang's version, a launch value, or sglang
            missing (named, with the way out).
    """
    check_environment(environ)
    if problems := version_refusals("sglang", installed_version("sglang"), where=f"node {role.host}"):
        raise SGLangBackendError(problems[0].render())
    launch = sglang_launch(role, cfg)
    token = read_job_token(role)
    thread = EngineThread()  # builds the Engine and makes every call to it (engine_thread.py)
    engine = await thread.call(engine_factory, launch)
    endpoint = rollout_endpoint(role)
    endpoint.parent.mkdir(parents=True, exist_ok=True)
    runner, port, stop = await start_app(
        sglang_app(SGLangRolloutServer(launch, engine, thread), token), launch.host, launch.port, stop
    )
    ender = asyncio.create_task(stop_on_job_end(role.run_dir, role.job_id, stop))
    try:
        probe = f"http://{launch.host}:{port}{readiness_path(launch.awex)}"
        if await wait_ready(probe, token, stop):
            publish_rollout_endpoint(role, port, launch.model_path, "sglang")
        await stop.wait()
    finally:
        ender.cancel()
        with contextlib.suppress(FileNotFoundError):
            endpoint.unlink()
        await runner.cleanup()
        if hasattr(engine, "shutdown"):
            await thread.call(engine.shutdown)
        thread.close()
        log.info("sglang rollout engine %d stopped", role.index)
