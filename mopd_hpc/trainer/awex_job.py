"""The AWEX settings of a job (`AwexJobConfig`), from its run config and the actor checkpoint's architecture:
what `trainer/weight_sync.py` `AwexSync`, trainer/rank_writer.py and the actor role's environment are built with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.config.rollout import AWEX_MODES
from mopd_hpc.engines.weight_sync.awex import REGISTERED_ARCHITECTURES, AwexConfigError, AwexJobConfig

if TYPE_CHECKING:
    from mopd_hpc.config import RunConfig


def actor_architecture(actor_path: str | Path) -> str:
    """`architectures[0]` of the actor checkpoint's config.json.

    Raises:
        AwexConfigError: config.json is unreadable or names no architecture.
    """
    path = Path(actor_path) / "config.json"
    try:
        architectures = json.loads(path.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError) as exc:
        raise AwexConfigError(f"{path}: {exc}; AWEX needs the actor's architectures[0]") from None
    if not architectures:
        raise AwexConfigError(f"{path}: no 'architectures' entry; AWEX picks its converters by it")
    return str(architectures[0])


def awex_job_config(cfg: RunConfig, model_arch: str | None = None) -> AwexJobConfig:
    """The AWEX settings of this job's actor and rollout fleet, from the run config: mode =
    weight_sync.awex_mode, else from rollout.mode (colocated → colocate); num_engines, engine_tp =
    rollout.engines.count, .tensor_parallel; engine_pp 1; infer_world = count·tp; train_world = the actor
    group's world (`ActorParallel`: dp·tp·pp ranks, every one a writer at transfer rank infer_world + rank);
    model_arch = the actor's config.json architectures[0] (unless given); comm nccl, ipc cuda. The
    MetaServer address is empty until `AwexSync.start` fills it in.

    Raises:
        AwexConfigError: an architecture awex 0.9.0 does not register; colocate with infer_world !=
            train_world (colocate pairs each trainer rank with one rollout rank on its GPU).
    """
    arch = model_arch if model_arch is not None else actor_architecture(cfg.models.actor.path)
    if arch not in REGISTERED_ARCHITECTURES:
        raise AwexConfigError(
            f"models.actor.path architecture {arch!r} is not registered in awex 0.9.0 (known: "
            f"{', '.join(sorted(REGISTERED_ARCHITECTURES))}); use weight_sync.backend: torch"
        )
    mode = cfg.weight_sync.awex_mode or AWEX_MODES[cfg.rollout.mode]
    engines = cfg.rollout.engines
    infer_world = engines.count * engines.tensor_parallel
    actor = ActorParallel.from_config(cfg)
    if mode == "colocate" and infer_world != actor.world:
        raise AwexConfigError(
            f"rollout.engines count·tensor_parallel = {engines.count}·{engines.tensor_parallel}: AWEX colocate "
            f"pairs each of the actor's {actor.world} trainer rank(s) ({actor.source}) with one rollout rank on "
            f"its GPU; expected {actor.world}"
        )
    return AwexJobConfig(
        mode=mode,
        comm_backend="nccl",
        ipc_backend="cuda",
        meta_server_addr="",
        num_engines=engines.count,
        engine_tp=engines.tensor_parallel,
        engine_pp=1,
        infer_world=infer_world,
        train_world=actor.world,
        model_arch=arch,
    )
