"""Cross-section rules of the AWEX weight sync (`weight_sync.backend: awex`, engines/weight_sync/), registered in
config/rules.py.

- the HF rollout engine's AWEX reader is one process: rollout.engines.tensor_parallel 1 with rollout.backend hf;
- the AWEX writer runs on a megatron actor;
- weight_sync.awex_mode, when set, is the mode rollout.mode implies;
- colocate mode pairs each of the actor's GPUs with one rollout rank (count·tensor_parallel = actor GPUs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mopd_hpc.config.parallel import actor_world
from mopd_hpc.config.problems import Problem
from mopd_hpc.config.rollout import AWEX_MODES


def awex_backend(c: Any) -> Iterator[Problem]:
    if c.weight_sync.backend != "awex":
        return
    if c.rollout.backend == "hf" and c.rollout.engines.tensor_parallel != 1:
        yield Problem(
            "rollout.engines.tensor_parallel",
            "the HF rollout engine's AWEX reader (engines/weight_sync/awex_hf.py) is one process",
            c.rollout.engines.tensor_parallel,
            "expected 1, or rollout.backend: sglang",
        )
    if c.models.actor.engine != "megatron":
        yield Problem(
            "weight_sync.backend",
            f"the AWEX writer needs a megatron actor; models.actor.engine is {c.models.actor.engine!r}",
            "awex",
            "models.actor.engine: megatron, or weight_sync.backend: torch",
        )
    expected = AWEX_MODES[c.rollout.mode]
    if c.weight_sync.awex_mode not in (None, expected):
        yield Problem(
            "weight_sync.awex_mode",
            f"does not match rollout.mode {c.rollout.mode!r}",
            c.weight_sync.awex_mode,
            f"{expected!r}, or null to follow rollout.mode",
        )


def awex_colocate(c: Any) -> Iterator[Problem]:
    """AWEX colocate mode pairs every trainer rank with one rollout rank on the same GPU (its reader
    requires that bijection, algo_awex.md §2.3): the rollout ranks must cover the actor's GPUs exactly.
    Colocate mode is weight_sync.awex_mode, or rollout.mode colocated when it is null; an awex_mode that
    contradicts rollout.mode is `awex_backend`'s problem alone (one cause, one problem)."""
    if c.weight_sync.backend != "awex" or c.rollout.mode != "colocated":
        return
    if c.weight_sync.awex_mode not in (None, "colocate"):
        return
    group, engines = c.cluster.trainer_group, c.rollout.engines
    infer_world, actor_gpus = engines.count * engines.tensor_parallel, actor_world(c.cluster, c.rollout).size
    if group.gpus_per_node and infer_world != actor_gpus:
        yield Problem(
            "rollout.engines",
            f"AWEX colocate pairs each of the actor's {actor_gpus} GPUs with one rollout rank, but "
            f"count·tensor_parallel = {engines.count}·{engines.tensor_parallel} = {infer_world}",
            infer_world,
            f"count·tensor_parallel = {actor_gpus}, or rollout.mode: separated (AWEX separate mode)",
        )
