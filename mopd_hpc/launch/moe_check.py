"""What a mixture-of-experts actor checkpoint asks of the job that `--check` reads from its config.json
(issue 33): refusals, each naming its field and the way out.

- `weight_sync.backend` must move experts (`config.capabilities.WEIGHT_SYNCS[...].experts`): AWEX pairs the
  trainer's and the rollout's parameters name by name, and a megatron actor's per-expert tensors have no
  pair among the hf engine's fused ones;
- `loss.router_aux_loss_coefficient: null` means the checkpoint's `router_aux_loss_coef`: an actor engine
  that adds no router loss (`ActorEngineSpec.router_losses`, megatron) would silently leave it out, so a
  coefficient > 0 there is refused (set 0, or the torch engine).
"""

from __future__ import annotations

import json
from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.config.capabilities import ACTOR_ENGINES, WEIGHT_SYNCS
from mopd_hpc.config.problems import Problem


def moe_actor_problems(cfg: RunConfig, arch: str, directory: Path) -> list[Problem]:
    """The refusals of the module docstring for the MoE actor checkpoint `directory` (an `arch`)."""
    out, engine = [], cfg.models.actor.engine
    sync = cfg.weight_sync.backend
    if not WEIGHT_SYNCS[sync].experts:
        layout = (cfg.rollout.mode, "gpu" if cfg.cluster.trainer_group.gpus_per_node else "cpu")
        movers = (
            " / ".join(
                n
                for n, s in WEIGHT_SYNCS.items()
                if s.experts
                and engine in s.actor_engines
                and cfg.rollout.backend in s.rollout_backends
                and layout in s.layouts
            )
            or "none here"
        )
        out.append(
            Problem(
                "weight_sync.backend",
                f"the actor ({directory}) is a mixture-of-experts {arch}: {sync} does not move its experts "
                "(it pairs the trainer's and the rollout's parameters name by name; the hf engine holds a "
                "layer's experts fused)",
                sync,
                f"weight_sync.backend: {movers}",
            )
        )
    if cfg.loss.router_aux_loss_coefficient is None and not ACTOR_ENGINES[engine].router_losses:
        try:
            coef = float(json.loads((directory / "config.json").read_text()).get("router_aux_loss_coef") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            coef = 0.0  # an unreadable config.json is the file check's to report
        if coef > 0:
            out.append(
                Problem(
                    "loss.router_aux_loss_coefficient",
                    f"null takes the actor's router_aux_loss_coef ({coef} in {directory}/config.json), and the "
                    f"{engine} actor engine adds no router loss",
                    None,
                    "0 (no load-balancing loss), or models.actor.engine: "
                    + " / ".join(n for n, s in ACTOR_ENGINES.items() if s.router_losses),
                )
            )
    return out
