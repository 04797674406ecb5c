"""The reference model π_ref of the KL penalty (loss.kl_coefficient > 0 inside L_RL): a frozen copy of the
STARTING actor (models.actor.path), scored like a teacher by the actor's own process.

    KL_k3(π_θ ‖ π_ref)_t = exp(ref_t − lp_t) − (ref_t − lp_t) − 1,   ref_t = log π_ref(y_t)   (`mopd/grpo.py`)

Where it runs — the actor's own process, not a server of its own. Each actor rank builds one
`ReferenceModel` (a scoring engine of the actor's kind: `TorchScoringEngine`, `MegatronScoringEngine`) from
the checkpoint at models.actor.path, always that path and never a run checkpoint, so after a resume it is
still the initial weights. Between uses its weights are offloaded to host memory (`engines/memory/residency.py`,
`engines/megatron/residency.py`: a real move on GPU, a no-op on CPU); `logprobs` onloads them, scores this
rank's rows and offloads them again before it returns. Why this and not a reference server (a teacher role
serving the actor's path):

- every data-parallel rank needs log π_ref for its own shard only: computed where the shard is, they never
  cross a socket, and no rank waits on one server scoring every rank's rows in turn;
- colocated GPU memory: the reference holds device memory only while it scores (after the rollout, before
  the train step, the actor's activations and gradients not yet allocated), then gives it back; a server
  would need its own GPU (separated) or its own residency protocol and port (colocated), and the job plan
  (`plan/placement.py`) a child more;
- the drain: the reference's device memory is released inside the TEACHER phase of the step, before the
  rank's drain receipt (`trainer/rank_step.py`), so "drained like every other consumer" holds by
  construction, and TRAIN (the phase machine leaves DRAIN only after every receipt) never overlaps it.

The price: host memory of one more copy of the actor's weights per rank (its dtype: 1.2 GB for a 0.6B
model in bf16), and the reference's forward in the actor's step time (a server's forward would be there too:
TRAIN needs its answer).

Shape legend: B rows, T response positions.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.protocol import EngineError

log = logging.getLogger("mopd_hpc.engines.reference")

#: Rows per forward of the reference by default (the scoring engines' `max_batch_rows`).
REFERENCE_BATCH_ROWS = 64


class ReferenceModel:
    """The frozen starting actor, offloaded except inside `logprobs` (module docstring). Build with `load`.

    Args:
        engine: a forward-only scoring engine (`logprobs`, `onload`, `offload`, `residency`) holding the
            starting weights; offloaded here.
        path: the checkpoint it was loaded from (models.actor.path).

    Attributes:
        last_seconds: wall seconds of the last `logprobs` call (onload, forward, offload).
    """

    def __init__(self, engine: Any, path: str | Path) -> None:
        self.engine = engine
        self.path = str(path)
        self.last_seconds = 0.0
        report = engine.offload()
        log.info("reference model from %s (the starting actor): %s", self.path, report.message)

    @classmethod
    def load(
        cls,
        kind: str,
        path: str | Path,
        *,
        dtype: str,
        device: torch.device | str,
        max_batch_rows: int = REFERENCE_BATCH_ROWS,
    ) -> ReferenceModel:
        """The reference of an actor engine of `kind` ("torch" or "megatron"), from the checkpoint at `path`
        (models.actor.path) in the actor's `dtype`, computing on `device` (the actor's), `max_batch_rows` rows
        per forward. Megatron: after `initialize_parallel` (the actor engine's own set-up), CUDA only.

        Raises:
            EngineError: another kind, or what the scoring engine's loader raises (dtype, device, files).
            OSError: no checkpoint at `path`.
        """
        if kind == "torch":
            from mopd_hpc.engines.torch.scoring import TorchScoringEngine

            engine: Any = TorchScoringEngine.from_pretrained(
                path, dtype=dtype, device=str(device), max_batch_rows=max_batch_rows
            )
        elif kind == "megatron":
            from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine

            engine = MegatronScoringEngine.from_pretrained(
                path, dtype=dtype, device=device, max_batch_rows=max_batch_rows
            )
        else:
            raise EngineError(f"reference model for engine {kind!r}: expected 'torch' or 'megatron'")
        return cls(engine, path)

    @property
    def on_device(self) -> bool:
        """True only inside `logprobs` on a GPU (on CPU the weights never move: always True there)."""
        return bool(self.engine.residency.on_device)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π_ref(y_t) of the response tokens on the CPU (0 at padded positions; B = 0 gives
        [0, T]): onload, one no-grad forward per `max_batch_rows` rows, offload (also on error)."""
        t0 = time.perf_counter()
        if batch.batch_size == 0:
            self.last_seconds = 0.0
            return torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        self.engine.onload()
        try:
            out = self.engine.logprobs(batch).float().cpu()
        finally:
            self.engine.offload()
        self.last_seconds = time.perf_counter() - t0
        return out
