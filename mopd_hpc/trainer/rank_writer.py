"""A follower's own part in the weight sync: which trainer ranks write, per backend (issue 18).

    backend   who takes part in a sync (actor group at DP × TP; rank 0 the controller)
    torch     rank 0 sends (`TorchSync`: one broadcast per HF tensor, or bucket); at TP > 1 the other ranks of
              DP rank 0's TP group join each HF tensor's all-gather (`engine.join_weight_gather`,
              engines/megatron/tp_gather.py): the weights are gathered per tensor, never as a whole model
    ipc       the same ranks as torch: rank 0 fills the shared buffers from the per-tensor gather
    awex      every trainer rank r writes its own shards at transfer rank infer_world + r (awex's mcore writer
              reads r and the TP/DP ranks from megatron's parallel state on the actor group's world): rank 0
              through `AwexSync` (which also runs the MetaServer and drives the readers), every other rank
              through the `AwexRankWriter` here; no rank gathers

The controller's `weights` record with reason "sync" (sent when the engine gathers over TP, or the sync needs
every rank: `AwexSync.every_rank`) tells a follower to take part: its writer publishes, if it has one
(`build_rank_writer`), else it joins the gather (trainer/follower.py).

`AwexRankWriter` builds its awex writer at the first sync, after rank 0 has started the MetaServer and written
its address to the run directory (rank 0 starts the sync before its first `weights` record). Its environment
(AWEX_MASTER_ADDR: this rank's own address; DEVICE: its GPU) is put in place by the actor role's `main`, at
the edge, from `AwexJobConfig.trainer_env(rank, ...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mopd_hpc.engines.weight_sync.awex import AwexJobConfig, read_meta_server_address

if TYPE_CHECKING:
    from mopd_hpc.config import RunConfig


class RankWriter(Protocol):
    """A follower's writer: `publish(step)` sends this rank's weights as step `step` (blocks until the
    readers took them); returns the seconds taken."""

    def publish(self, step: int) -> float: ...


class AwexRankWriter:
    """One follower's AWEX writer (module docstring).

    Args:
        config: the job's AWEX settings (`awex_job_config`), MetaServer address still empty.
        engine: this rank's `MegatronTrainEngine`.
        run_dir: where rank 0 writes the MetaServer address. address_timeout_s: how long the first publish
            waits for that file, seconds.
    """

    def __init__(
        self, config: AwexJobConfig, engine: Any, run_dir: str | Path, address_timeout_s: float
    ) -> None:
        self.config, self.engine, self.run_dir = config, engine, Path(run_dir)
        self.address_timeout_s = address_timeout_s
        self.publisher: Any = None

    def publish(self, step: int) -> float:
        """Build the writer on the first call (MetaServer address from the run directory, then awex's
        `initialize()`), then send this rank's shards of step `step` (`AwexActorPublisher.publish`).

        Raises:
            AwexConfigError: the MetaServer address file is absent after address_timeout_s, or malformed.
            AwexUnavailableError: awex (or megatron.core) is not importable.
        """
        if self.publisher is None:
            from mopd_hpc.engines.weight_sync.awex_actor import AwexActorPublisher

            address = read_meta_server_address(self.run_dir, timeout_s=self.address_timeout_s)
            self.publisher = AwexActorPublisher(self.config.with_meta_server(address), self.engine)
            self.publisher.initialize()
        return self.publisher.publish(step)


def build_rank_writer(cfg: RunConfig, engine: Any, run_dir: str | Path) -> RankWriter | None:
    """A follower's writer for weight_sync.backend awex (`AwexRankWriter`, waiting up to the collective
    timeout for the MetaServer address); None for torch and ipc (rank 0 alone sends).

    Raises:
        AwexConfigError: AWEX settings the job cannot have (`awex_job_config`).
    """
    if cfg.weight_sync.backend != "awex":
        return None
    from mopd_hpc.trainer.awex_job import awex_job_config

    return AwexRankWriter(awex_job_config(cfg), engine, run_dir, cfg.models.actor.collective_timeout_s)
