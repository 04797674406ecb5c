"""The actor role's side of the actor group: who this child is in it, from its guard-given environment.

`join_group(role, cfg, environ)` is `SoloGroup()` for an actor world of one rank (no torch.distributed at
all, as before the group existed) and otherwise `ActorGroup.join` (trainer/actor_group.py) with:

- rank, world: MOPD_RANK / MOPD_WORLD_SIZE; dp and tp rank and size from `ActorParallel` (config/parallel.py:
  rank = tp_rank + tp·(dp_rank + dp·pp_rank));
- backend and device: gloo on "cpu" when the child has no GPU, else nccl on its `RoleEnv.device` (the
  device the placement gave it among those it sees);
- rank 0's advertised address (`master_address`: loopback locally, its node's address on a cluster) and its
  leased `master` port; the collective timeout `models.actor.collective_timeout_s`; a rank > 0 waits for
  rank 0's rendezvous record as long as for the servers (MOPD_ENDPOINT_TIMEOUT_S).

`sync_port(role)`: the port of the weight-sync group (TorchSync's store): the leased `nccl` port of rank 0,
or, for a one-rank actor whose plan gives it none, `master` (nothing else uses it then).
"""

from __future__ import annotations

from collections.abc import Mapping

from mopd_hpc.config import RunConfig
from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.roles.env import RoleEnv, RoleEnvError, master_address
from mopd_hpc.runtime import child_env
from mopd_hpc.trainer.actor_group import ActorGroup, GroupSpec
from mopd_hpc.trainer.group import Group, SoloGroup


def group_spec(
    role: RoleEnv, cfg: RunConfig, environ: Mapping[str, str], rendezvous_timeout_s: float
) -> GroupSpec:
    """This child's place in the actor group (module docstring).

    Raises:
        RoleEnvError: MOPD_WORLD_SIZE differs from the config's actor world (a plan of another config).
    """
    shape = ActorParallel.from_config(cfg)
    if shape.world != role.world_size:
        raise RoleEnvError(
            f"{child_env.WORLD_SIZE}={role.world_size} but the run's config gives the actor {shape.world} rank(s) "
            f"({shape.source}); expected the plan of this run's config"
        )
    device = role.device.torch_name
    return GroupSpec(
        rank=role.rank,
        world_size=role.world_size,
        dp_rank=shape.dp_rank(role.rank),
        dp_size=shape.dp,
        backend="gloo" if device == "cpu" else "nccl",
        device=device,
        collective_timeout_s=cfg.models.actor.collective_timeout_s,
        rendezvous_timeout_s=rendezvous_timeout_s,
        tp_rank=shape.tp_rank(role.rank),
        tp_size=shape.tp,
    )


def join_group(
    role: RoleEnv, cfg: RunConfig, environ: Mapping[str, str], rendezvous_timeout_s: float
) -> Group:
    """`SoloGroup()` for one rank, else this child joined to the actor world (module docstring).

    Raises:
        RoleEnvError: a mismatched world size, or rank 0 without a `master` port.
        RendezvousTimeoutError / ActorGroupError / torch's DistError: the world did not form.
    """
    if role.world_size == 1:
        return SoloGroup()
    spec = group_spec(role, cfg, environ, rendezvous_timeout_s)
    if role.rank == 0:
        return ActorGroup.join(spec, role.run_dir, role.job_id, master_address(role), role.port("master"))
    return ActorGroup.join(spec, role.run_dir, role.job_id)


def sync_port(role: RoleEnv) -> int:
    """The weight-sync group's port (module docstring).

    Raises:
        RoleEnvError: neither `nccl` nor (at world 1) `master` is leased for this child.
    """
    if "nccl" in role.ports or role.world_size > 1:
        return role.port("nccl")
    return role.port("master")
