"""The actor group: every actor child of the job is one rank of one torch.distributed world (DESIGN.md §7).

Joining (`ActorGroup.join`):

- rank 0 binds a TCP store to the address it advertises (loopback locally, its node's address on a cluster)
  on its leased `master` port, sets a random nonce in it, and publishes the rendezvous record
  (`trainer/rendezvous.py`); every other rank waits for the record of ITS job, connects, and checks the
  nonce (a stale record of an earlier run names a port that is gone or another job's: read again);
- every rank joins the world with `init_process_group` on that store (gloo on CPU; NCCL on GPU, each
  rank on its own device) and a gloo group for the control objects (receipts, statistics), with the
  collective timeout of the config (`models.actor.collective_timeout_s`); gloo binds the interface that
  carries the address the job uses (GLOO_SOCKET_IFNAME, set here unless the user set it).

Control messages (`publish` / `receive`): rank 0 orchestrates the step's I/O and sends each rank the step's
record (`trainer/step_record.py`) as the value of a store key, `mopd_actor/control/<seq>`, instead of a
collective broadcast. A follower waits for the next key by polling the store, with no deadline of its
own, because rank 0 may legitimately be busy for long between two records (the start-of-run evaluation,
a checkpoint save, a slow rollout): a collective with the collective timeout would end a healthy job. The
wait is liveness-checked instead: rank 0 increments a heartbeat key every HEARTBEAT_S from a thread of its
own; a follower fails with `PeerLostError` when rank 0's store is gone (rank 0 died: the store lives in
it) or its heartbeat did not move for the collective timeout (rank 0 frozen). A key is deleted once every
rank has been through a collective after it.

Collectives (`gather_receipts`, `all_reduce_sum`, `barrier`) run on the control group and fail after the
collective timeout, or at once when a peer's connection closes; either raises `PeerLostError` with gloo's
message (`logs/causes.py` reads it as a consequence: the summarizer names the rank that failed first).

TP groups (tp_size > 1): the ranks of one tensor-parallel group, consecutive (rank = tp_rank + tp·(dp_rank +
dp·pp_rank), config/parallel.py), hold the same rows; `tp_broadcast` sends TP rank 0's tensors to the others
of its group over the group's own process group (the world's backend: gloo on CPU, NCCL on GPU), which
`join` creates on every rank, one per TP group, in rank order. At TP 1 no such group exists.

The interface the step loop uses (`Group`), the group's errors and the one-rank group (`SoloGroup`) are
trainer/group.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.engines.daemon_thread import in_daemon_thread
from mopd_hpc.engines.tcp_store import tcp_store
from mopd_hpc.runtime.netif import bind_gloo_to, local_address_towards
from mopd_hpc.trainer.group import ActorGroupError, PeerLostError, Receipts, group_settings_problem
from mopd_hpc.trainer.rendezvous import Rendezvous, RendezvousFile, connect_store, publish_store
from mopd_hpc.trainer.step_record import ControlRecord

log = logging.getLogger("mopd_hpc.trainer")

#: Keys of the store (besides torch.distributed's own, under mopd_actor/world/).
HEARTBEAT_KEY = "mopd_actor/heartbeat"
CONTROL_KEY = "mopd_actor/control/{seq}"
#: Rank 0's heartbeat period, seconds.
HEARTBEAT_S = 2.0
#: How long `close` waits for the process group's teardown, seconds.
CLOSE_WAIT_S = 10.0
#: A follower's poll period while it waits for a control record grows from the first value to the second.
POLL_S = (0.002, 0.05)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Who this rank is in the actor group.

    Attributes:
        rank, world_size: this rank and the actor world (MOPD_RANK / MOPD_WORLD_SIZE).
        dp_rank, dp_size: its data-parallel index and size (= rank, world for the torch engine: TP 1).
        backend: "gloo" (CPU) or "nccl" (GPU). device: this rank's device ("cpu", "cuda:0").
        collective_timeout_s: the longest a collective waits for the other ranks, seconds.
        rendezvous_timeout_s: how long a rank > 0 waits for rank 0's rendezvous record, seconds.
        tp_rank, tp_size: its tensor-parallel index and size (megatron at TP > 1; 0 and 1 otherwise). The
            ranks of one TP group hold the same rows: only TP rank 0 counts in `all_reduce_sum`.
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    backend: str
    device: str
    collective_timeout_s: float
    rendezvous_timeout_s: float
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size or self.world_size % (self.dp_size * self.tp_size):
            raise ActorGroupError(
                f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, dp_size={self.dp_size} in a world of "
                f"{self.world_size}: expected 0 <= tp_rank < tp_size and dp_size·tp_size dividing the world"
            )
        if not 0 <= self.rank < self.world_size:
            raise ActorGroupError(
                f"rank={self.rank}, world_size={self.world_size}: expected 0 <= rank < world"
            )
        if not 0 <= self.dp_rank < self.dp_size or self.world_size % self.dp_size:
            raise ActorGroupError(
                f"dp_rank={self.dp_rank}, dp_size={self.dp_size} in a world of {self.world_size}: expected "
                "0 <= dp_rank < dp_size and dp_size dividing the world"
            )
        problem = group_settings_problem(self.backend, self.collective_timeout_s, self.rendezvous_timeout_s)
        if problem is not None:
            raise ActorGroupError(problem)


def tp_groups(world_size: int, tp_size: int) -> list[list[int]]:
    """The world ranks of each TP group (consecutive blocks of tp_size, config/parallel.py); [] at TP 1.

    Raises:
        ActorGroupError: tp_size < 1 or not dividing the world.
    """
    if tp_size < 1 or world_size % tp_size:
        raise ActorGroupError(
            f"tp_size={tp_size} in a world of {world_size}: expected a divisor of the world"
        )
    if tp_size == 1:
        return []
    return [list(range(k, k + tp_size)) for k in range(0, world_size, tp_size)]


class ActorGroup:
    """One rank's membership of the actor world. Build with `ActorGroup.join`."""

    def __init__(
        self, spec: GroupSpec, store: Any, control: Any, run_dir: Path, tp_group: Any = None
    ) -> None:
        self.spec, self.store, self.control, self.run_dir = spec, store, control, run_dir
        self.rank, self.world_size = spec.rank, spec.world_size
        self.dp_rank, self.dp_size = spec.dp_rank, spec.dp_size
        self.tp_rank, self.tp_size = spec.tp_rank, spec.tp_size
        #: This rank's TP group's process group (None at TP 1), and the world rank of its TP rank 0.
        self.tp_group, self.tp_source = tp_group, spec.rank - spec.tp_rank
        self._seq = 0
        self._acknowledged = 0  # keys below this sequence number every rank has been through
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ----------------------------------------------------------------------------------- joining

    @classmethod
    def join(
        cls, spec: GroupSpec, run_dir: Path, job_id: str, host: str | None = None, port: int | None = None
    ) -> ActorGroup:
        """Form the world (module docstring). host, port: rank 0's advertised address and its leased
        `master` port (ignored on the other ranks, which read them from the rendezvous record).

        Raises:
            ActorGroupError: rank 0 without host/port; RendezvousTimeoutError: no record in time (rank > 0);
            NetworkInterfaceError: no interface carries the address; OSError: the port cannot be bound;
            torch's DistError: the world did not form within the collective timeout.
        """
        timeout = timedelta(seconds=spec.collective_timeout_s)
        file = RendezvousFile.actor(run_dir)
        if spec.rank == 0:
            if host is None or port is None:
                raise ActorGroupError("actor rank 0 joins with its advertised host and its `master` port")
            # the server listens on `host` only (engines/tcp_store.py), not on every interface
            store, record = publish_store(
                file, job_id, host, port, spec.world_size, spec.collective_timeout_s, {HEARTBEAT_KEY: "0"}
            )
            local = host
        else:
            store, record = connect_store(file, job_id, spec.world_size, spec.rendezvous_timeout_s)
            local = local_address_towards(record.host, record.port)
        bind_gloo_to(local)
        if spec.backend == "nccl":
            torch.cuda.set_device(torch.device(spec.device))
        dist.init_process_group(
            spec.backend,
            store=dist.PrefixStore("mopd_actor/world", store),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
            device_id=torch.device(spec.device) if spec.backend == "nccl" else None,
        )
        control = (
            dist.new_group(backend="gloo", timeout=timeout) if spec.backend == "nccl" else dist.group.WORLD
        )
        tp_group = None
        for ranks in tp_groups(spec.world_size, spec.tp_size):  # every rank creates every TP group, in order
            made = dist.new_group(ranks, backend=spec.backend, timeout=timeout)
            if spec.rank in ranks:
                tp_group = made
        group = cls(spec, store, control, run_dir, tp_group)
        if spec.rank == 0:
            group._start_heartbeat(record)
        log.info(
            "actor group: rank %d/%d (dp %d/%d, tp %d/%d, %s on %s), store %s:%d",
            spec.rank, spec.world_size, spec.dp_rank, spec.dp_size, spec.tp_rank, spec.tp_size, spec.backend,
            spec.device, record.host, record.port,
        )  # fmt: skip
        return group

    def _start_heartbeat(self, record: Rendezvous) -> None:
        client = tcp_store(
            record.host,
            record.port,
            self.world_size,
            is_master=False,
            timeout_s=self.spec.collective_timeout_s,
        )

        def beat() -> None:
            count = 0
            while not self._stop.wait(HEARTBEAT_S):
                count += 1
                try:
                    client.set(HEARTBEAT_KEY, str(count))
                except RuntimeError:  # the store is closing
                    return

        self._heartbeat = threading.Thread(target=beat, name="actor-group-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---------------------------------------------------------------------------- control records

    async def publish(self, record: ControlRecord) -> None:
        """Rank 0: make `record` the next control record of every other rank."""
        if self.rank != 0:
            raise ActorGroupError(f"actor rank {self.rank} publishes a control record; only rank 0 does")
        self.store.set(CONTROL_KEY.format(seq=self._seq), record.to_bytes())
        self._seq += 1

    async def receive(self) -> ControlRecord:
        """A rank > 0: the next control record, waiting as long as rank 0 is alive (module docstring).

        Each look at the store runs in a daemon thread, bounded by the collective timeout: the store lives
        in rank 0's process, and a frozen process (SIGSTOP, a node that stopped scheduling it) keeps the
        connection open without answering, where a store call would block for ever.

        Raises:
            PeerLostError: rank 0's store is unreachable or silent, or its heartbeat stood still, for the
                collective timeout.
        """
        key = CONTROL_KEY.format(seq=self._seq)
        timeout = self.spec.collective_timeout_s
        delay, beat, moved = POLL_S[0], None, time.monotonic()
        next_beat_check = 0.0
        while True:
            now = time.monotonic()
            want_beat = now >= next_beat_check
            try:
                data, value = await asyncio.wait_for(
                    in_daemon_thread(self._look, key, want_beat, name="actor-group-receive"), timeout
                )
            except TimeoutError:
                raise PeerLostError(
                    f"actor rank {self.rank}: rank 0's store did not answer for {timeout:g} s "
                    f"(models.actor.collective_timeout_s) while waiting for control record {self._seq}: rank 0 "
                    "is frozen"
                ) from None
            except RuntimeError as exc:
                raise PeerLostError(
                    f"actor rank {self.rank}: rank 0's store is unreachable while waiting for control record "
                    f"{self._seq} (rank 0 failed or ended): {exc}"
                ) from exc
            if data is not None:
                break
            now = time.monotonic()
            if want_beat:
                if value != beat:
                    beat, moved = value, now
                next_beat_check = now + HEARTBEAT_S
            if now - moved > timeout:
                raise PeerLostError(
                    f"actor rank {self.rank}: rank 0's heartbeat stood still for {now - moved:.0f} s "
                    f"(models.actor.collective_timeout_s = {timeout:g}) while waiting for control record "
                    f"{self._seq}: rank 0 is frozen"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_S[1])
        self._seq += 1
        return ControlRecord.from_bytes(bytes(data))

    def _look(self, key: str, want_beat: bool) -> tuple[bytes | None, bytes | None]:
        """(the record under `key` or None, the heartbeat value when asked for) from the store."""
        data = self.store.get(key) if self.store.check([key]) else None
        return data, self.store.get(HEARTBEAT_KEY) if want_beat and data is None else None

    def forget_read_records(self) -> None:
        """Rank 0: delete the records published so far. Call it only after a collective that every rank
        enters after reading them (a drain gather, a barrier, the gradient all-reduce of a train step)."""
        if self.rank != 0:
            return
        for seq in range(self._acknowledged, self._seq):
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(CONTROL_KEY.format(seq=seq))
        self._acknowledged = self._seq

    # ------------------------------------------------------------------------------- collectives

    def _collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, group=self.control, **kwargs)
        except RuntimeError as exc:
            raise PeerLostError(f"actor rank {self.rank}: {what} failed: {exc}") from exc
        self.forget_read_records()
        return out

    def tp_broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """TP rank 0's `tensors` on every rank of its TP group (CPU tensors in, CPU tensors out).

        At TP rank 0 each tensor is sent and returned as given; at the other TP ranks each is a buffer of the
        sender's shape and dtype (its values unused) and the received tensors are returned, new CPU tensors
        equal bit for bit to the sender's. On NCCL the tensors travel through this rank's device. A no-op at
        TP 1. Every rank of the TP group calls it with the same shapes and dtypes, in the same order. Unlike
        the control collectives it does not forget the read control records: the other TP groups' ranks
        take no part in it.

        Raises:
            PeerLostError: a rank of the TP group failed or stayed away for the collective timeout (`what`
                names the broadcast in the message).
        """
        if self.tp_size == 1:
            return list(tensors)
        device = torch.device(self.spec.device)
        out = []
        try:
            for tensor in tensors:
                if tensor.numel() == 0:  # nothing to send: the shape (agreed) is the whole message
                    out.append(tensor)
                    continue
                buffer = tensor.contiguous().to(device)
                dist.broadcast(buffer, src=self.tp_source, group=self.tp_group)
                out.append(tensor if self.tp_rank == 0 else buffer.cpu())
        except RuntimeError as exc:
            raise PeerLostError(
                f"actor rank {self.rank}: the TP broadcast of {what} from rank {self.tp_source} failed: {exc}"
            ) from exc
        return out

    def gather_receipts(self, step: int, rows: int) -> Receipts | None:
        """Every rank's drain receipt (rank, step, rows scored) at rank 0 (None on the others)."""
        mine = torch.tensor([step, rows], dtype=torch.int64)
        if self.rank != 0:
            self._collective(f"the drain gather of step {step}", dist.gather, mine, None, dst=0)
            return None
        got = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
        self._collective(f"the drain gather of step {step}", dist.gather, mine, got, dst=0)
        return [(r, int(t[0]), int(t[1])) for r, t in enumerate(got)]

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """The element-wise sum of `values` over the data-parallel ranks (float64): every rank takes part,
        TP ranks > 0 add zeros (the ranks of one TP group hold the same rows)."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if self.tp_rank:
            tensor.zero_()
        self._collective("the statistics all-reduce", dist.all_reduce, tensor)
        return tensor.tolist()

    def barrier(self, what: str) -> None:
        """Every rank reaches this point (`what` names it in the error)."""
        self._collective(f"the barrier {what}", dist.barrier)

    def close(self) -> None:
        """Leave the world; rank 0 removes its rendezvous record and stops its store last.

        The process group is destroyed in a daemon thread, given CLOSE_WAIT_S: after a lost peer the
        teardown can block on a store or a connection that never answers, and a failing rank must still
        exit (with its error) instead of hanging in its cleanup."""
        self._stop.set()

        def destroy() -> None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

        closing = threading.Thread(target=destroy, name="actor-group-close", daemon=True)
        closing.start()
        closing.join(CLOSE_WAIT_S)
        if closing.is_alive():
            log.warning(
                "actor rank %d: the process group did not close in %g s; leaving it", self.rank, CLOSE_WAIT_S
            )
        if self.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                RendezvousFile.actor(self.run_dir).path.unlink()
        self.store = None
