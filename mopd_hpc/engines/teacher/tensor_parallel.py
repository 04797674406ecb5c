"""A tensor-parallel teacher replica: a leader serving HTTP plus followers, one process per rank of its TP
group, each holding its shard of the weights.

The leader (TP rank 0) runs the scoring server (`http_app.TeacherServer`) over `TPLeader(engine,
group)`; every other rank runs `follow(engine, group)`. For each call the server makes, the leader first
broadcasts the request to the group (torch.distributed, `group`; gloo on CPU, NCCL on GPUs), then runs its
own shard's forward; each follower receives the same request and runs the same forward, so that the
collectives inside the model's forward (megatron-core's TP all-reduce / all-gather) pair up. Only the
leader's result is answered; the followers drop theirs.

Messages, all broadcast from group rank 0 (`src = group_rank 0`), on `comm_device` (cpu for gloo, the rank's
CUDA device for NCCL):

    header  [6] int64  (op, B, L, T, k, pad_id)   op: SCORE 1, OFFLOAD 2, ONLOAD 3, HEARTBEAT 4, STOP 0;
                                                  k = −1: no top-k
    then for SCORE:
      input_ids       [B, L] int64
      attention_mask  [B, L] int64
      response_ids    [B, T] int64
      response_mask   [B, T] uint8   (bool on the leader; gloo broadcasts no bool)
      response_start  [B]    int64

`TPLeader.stop()` sends STOP: every follower's `follow` returns the number of requests it served.
`TPLeader.heartbeat()` sends HEARTBEAT (no work): a leader with no request to send calls it every few seconds
(roles/teacher_replica.py), so that an idle follower's wait for the next header, a collective bounded by the
group's timeout, never runs out while the leader is alive, and the leader learns of a dead follower between
requests (the heartbeat's broadcast fails). A follower that fails raises out of `follow` (its process exits
non-zero, and the leader's next broadcast fails); a leader that fails ends the followers' wait (the
connection closes, or the group's timeout runs out). Reloading weights is not part of the protocol yet
(`load_weights` raises EngineError on the leader).

The teacher role runs a replica of tensor_parallel > 1 this way (roles/teacher_replica.py); the GPU run
(megatron-core TP > 1 in the role) is the multi-GPU issue's: `config/capabilities.py` declares megatron's
teacher tensor_parallel 1 until it has run, so `--check` and the role refuse more. tests/engines/test_teacher_tp.py
runs the protocol on CPU with a vocabulary-parallel fake forward (its logits all-gathered over the group) in
real processes (gloo); tests/engines/test_teacher_replica_role.py runs it through the role.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.protocol import EngineError

SCORE, OFFLOAD, ONLOAD, HEARTBEAT, STOP = 1, 2, 3, 4, 0
HEADER_LEN = 6


def _broadcast(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return tensor


class TPLeader:
    """The scoring engine of a TP replica's leader, as `TeacherServer` uses it: each call broadcast to the
    followers first (module docstring), then run on this rank's shard.

    Args:
        engine: this rank's shard engine (`score(batch, k)`, `vocab_size`, `residency`, `offload`, `onload`,
            `device`).
        group: the replica's TP process group (None: the default group), this process its rank 0.
        comm_device: where the messages live ("cpu" for gloo, this rank's CUDA device for NCCL).
    """

    def __init__(self, engine: Any, group: Any = None, comm_device: str | torch.device = "cpu") -> None:
        self.engine, self.group, self.comm_device = engine, group, torch.device(comm_device)
        self._lock = threading.Lock()  # one request on the wire at a time (the server serializes too)
        self.requests = 0

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    @property
    def residency(self) -> Any:
        return self.engine.residency

    @property
    def device(self) -> Any:
        return self.engine.device

    def _header(self, op: int, batch: TokenBatch | None = None, k: int | None = None) -> None:
        b, length = batch.input_ids.shape if batch is not None else (0, 0)
        width = batch.response_width if batch is not None else 0
        pad = batch.pad_id if batch is not None else 0
        values = [op, b, length, width, -1 if k is None else k, pad]
        _broadcast(torch.tensor(values, dtype=torch.int64, device=self.comm_device), self.group)

    def score(
        self, batch: TokenBatch, k: int | None = None, *, host: bool = True
    ) -> tuple[torch.Tensor, Any]:
        """Broadcast the batch, then this shard's forward: ([B, T] float32 log-probs, top-k or None); host:
        the engine's (`score`)."""
        with self._lock:
            self._header(SCORE, batch, k)
            d = self.comm_device
            for t in (batch.input_ids, batch.attention_mask, batch.response_ids):
                _broadcast(t.to(d, torch.int64).contiguous(), self.group)
            _broadcast(batch.response_mask.to(d, torch.uint8).contiguous(), self.group)
            _broadcast(batch.response_start.to(d, torch.int64).contiguous(), self.group)
            self.requests += 1
            return self.engine.score(batch, k, host=host)

    def offload(self) -> Any:
        with self._lock:
            self._header(OFFLOAD)
            return self.engine.offload()

    def onload(self) -> Any:
        with self._lock:
            self._header(ONLOAD)
            return self.engine.onload()

    def load_weights(self, path: Any) -> None:
        raise EngineError(
            "reloading a tensor-parallel teacher replica is not part of the leader/follower protocol yet; "
            "restart the replica instead"
        )

    def heartbeat(self) -> None:
        """Tell every follower the leader is alive (HEARTBEAT; module docstring).

        Raises:
            RuntimeError: the broadcast failed (a follower is gone, or stayed away for the group's timeout).
        """
        with self._lock:
            self._header(HEARTBEAT)

    def stop(self) -> None:
        """Tell every follower to return (STOP)."""
        with self._lock:
            self._header(STOP)


def follow(engine: Any, group: Any = None, comm_device: str | torch.device = "cpu") -> int:
    """A follower's loop (module docstring): receive each request from the leader and run the same call on
    this rank's shard, until STOP; returns the number of SCORE requests served.

    Raises:
        EngineError: an unknown op in a header (a leader of another protocol version).
        What the engine raises.
    """
    device = torch.device(comm_device)
    served = 0
    while True:
        header = _broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64, device=device), group).tolist()
        op, b, length, width, k, pad = header
        if op == STOP:
            return served
        if op == HEARTBEAT:
            continue
        if op == OFFLOAD:
            engine.offload()
        elif op == ONLOAD:
            engine.onload()
        elif op == SCORE:
            ids, mask, rids = (
                _broadcast(torch.zeros(shape, dtype=torch.int64, device=device), group)
                for shape in ((b, length), (b, length), (b, width))
            )
            rmask = _broadcast(torch.zeros((b, width), dtype=torch.uint8, device=device), group)
            starts = _broadcast(torch.zeros(b, dtype=torch.int64, device=device), group)
            batch = TokenBatch(ids.cpu(), mask.cpu(), rids.cpu(), rmask.cpu().bool(), starts.cpu(), int(pad))
            engine.score(batch, None if k < 0 else int(k))
            served += 1
        else:
            raise EngineError(f"teacher TP follower: unknown op {op} in header {header}; expected 0..4")
