"""Weight sync by torch.distributed broadcast: trainer (rank 0) → rollout servers (ranks 1..W-1).

Protocol (SGLang 0.5.23's, notes in ../shared/reference/algo_awex.md §3.2): the trainer POSTs
/init_weights_update_group to every server (server i joins as rank 1 + i) while it joins as rank 0 itself;
per sync it POSTs /update_weights_from_distributed {names, dtypes, shapes, ...} and, concurrently, broadcasts
the tensors from rank 0 in that order; each server receives them into fresh tensors, then loads them into its
model and answers the HTTP call. Backends: gloo (CPU tensors) and NCCL (CUDA tensors).

Group choice. The group is a dedicated `TCPStore` (hosted by rank 0 on `master_port`, one of the guard's named
ports, listening on `master_address` only: `engines/tcp_store.py`) wrapped in a `PrefixStore(group_name)`,
and a `ProcessGroupGloo` / `ProcessGroupNCCL` built directly on it; collectives are called on that object
(`pg.broadcast(...).wait()`), never through torch.distributed's
global functions. Why not `torch.distributed.new_group`: it can only group ranks of the default (WORLD)
group, and the trainer's WORLD is its own training job (data/tensor-parallel ranks) while the rollout
servers are other processes, often in another het group, with no WORLD at all; `init_process_group` can be
called only once per process. The dedicated group leaves the trainer's default group untouched, needs no
change to how the trainer initialises torch.distributed, and allows several groups side by side (one per
group_name). SGLang and verl reach the same end through the private `_new_process_group_helper`; the public
ProcessGroup constructors avoid that private API.

The gloo device of a rank binds the address this host uses to reach `master_address` (rank 0:
`master_address` itself), so no hostname resolution is involved.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.engines.daemon_thread import in_daemon_thread
from mopd_hpc.engines.tcp_store import tcp_store
from mopd_hpc.engines.weight_sync.requests import (
    DEFAULT_GROUP_NAME,
    DTYPE_NAMES,
    DistributedUpdateRequest,
    InitGroupRequest,
    WeightUpdateClient,
)

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
#: Default time a rank waits for the others (store connect, rendezvous, each broadcast), in seconds.
DEFAULT_TIMEOUT_S = 600.0


class WeightSyncConfigError(ValueError):
    """Bad weight-sync parameters: world size, backend, port, tensor dtype."""


class WeightSyncError(RuntimeError):
    """A sync failed: a server refused the update or a broadcast failed; the group is no longer usable."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype name (e.g. "bfloat16") and shape of one broadcast tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 → "float32" (the names SGLang's /update_weights_from_distributed takes)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise WeightSyncConfigError(f"dtype={dtype}: expected one of {list(DTYPE_NAMES)}")
    return name


def dtype_groups(specs: Sequence[TensorSpec]) -> dict[str, list[int]]:
    """Indices of `specs` per dtype name, dtypes in order of first appearance ("flattened_bucket" layout)."""
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec.dtype, []).append(i)
    return groups


def _local_address_towards(host: str, port: int) -> str:
    """The local IP address the kernel routes to (host, port) through (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class BroadcastGroup:
    """One rank's membership of a dedicated broadcast group. Build with `BroadcastGroup.join`."""

    def __init__(
        self, store: Any, pg: Any, rank: int, world_size: int, backend: str, device: torch.device
    ) -> None:
        self.store, self.pg = store, pg
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> BroadcastGroup:
        """Join as `rank`; blocks until all `world_size` ranks joined (or timeout_s passes).

        device: where this rank's tensors live (gloo: "cpu"; nccl: a CUDA device, default the current one).
        Raises:
            WeightSyncConfigError: bad backend/rank/world size/device.
            RuntimeError (torch's DistStoreError/DistError): a rank did not join in time.
        """
        if backend not in BACKENDS:
            raise WeightSyncConfigError(f"backend={backend!r}: expected one of {list(BACKENDS)}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise WeightSyncConfigError(
                f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size"
            )
        timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            dev = torch.device("cpu" if device is None else device)
            if dev.type != "cpu":
                raise WeightSyncConfigError(f"device={dev}: the gloo backend broadcasts CPU tensors")
        else:
            dev = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
            if dev.type != "cuda":
                raise WeightSyncConfigError(f"device={dev}: the nccl backend broadcasts CUDA tensors")
            if dev.index is None:  # "cuda": the current device (NCCL needs an index to bind the communicator)
                dev = torch.device("cuda", torch.cuda.current_device())
        # rank 0's store listens on master_address only (engines/tcp_store.py), not on every interface
        store = tcp_store(master_address, master_port, world_size, is_master=rank == 0, timeout_s=timeout_s)
        prefixed = dist.PrefixStore(f"mopd_weight_sync/{group_name}", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            local = master_address if rank == 0 else _local_address_towards(master_address, master_port)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:
            torch.cuda.set_device(dev)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        log.info("joined weight-sync group %r as rank %d/%d (%s)", group_name, rank, world_size, backend)
        return cls(store, pg, rank, world_size, backend, dev)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` (contiguous, on self.device) from rank 0 into every rank's tensor, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Leave the group without waiting for the other ranks.

        NCCL: `abort()` (ncclCommAbort, local) rather than `shutdown()`, whose finalize waits for the peers:
        a server closing while the trainer waits for its HTTP answer would deadlock. No collective may be in
        flight (the protocol guarantees it: destroy comes after the last update returned).
        """
        if self.pg is not None and self.backend == "nccl":
            self.pg.abort()
        self.pg = self.store = None


def receive_tensors(
    group: BroadcastGroup, specs: Sequence[TensorSpec], load_format: str | None
) -> dict[str, torch.Tensor]:
    """Receiver side (rank ≥ 1): fresh tensors filled by rank 0's broadcasts, in `specs` order.

    load_format None: one broadcast per tensor; "flattened_bucket": one per dtype (see `dtype_groups`).
    """
    out: dict[str, torch.Tensor] = {}
    if load_format == "flattened_bucket":
        for dtype, idx in dtype_groups(specs).items():
            sizes = [_numel(specs[i].shape) for i in idx]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device=group.device)
            group.broadcast(flat)
            for i, part in zip(idx, flat.split(sizes), strict=True):
                out[specs[i].name] = part.view(specs[i].shape)
        return {s.name: out[s.name] for s in specs}
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=group.device)
        group.broadcast(tensor)
        out[spec.name] = tensor
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


async def _together(what: str, blocking: asyncio.Future[Any], calls: Sequence[Any]) -> Any:
    """Await a blocking collective and the HTTP calls that pair with it; the first failure raises."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    done, pending = await asyncio.wait([blocking, *tasks], return_when=asyncio.FIRST_EXCEPTION)
    for fut in done:
        if fut.exception() is not None:
            for p in pending:
                p.cancel()
            raise WeightSyncError(f"{what} failed: {fut.exception()}") from fut.exception()
    return blocking.result()


class TorchBroadcastSender:
    """Trainer side of the weight sync: rank 0 of a dedicated group (see the module docstring).

    Usage::

        sender = TorchBroadcastSender("127.0.0.1", port, world_size=1 + len(clients), backend="gloo")
        await sender.init_group(clients)          # server i joins as rank 1 + i
        version = await sender.send(model.state_dict().items(), clients)   # "1", then "2", ...
        await sender.destroy(clients)
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
        ranks_per_server: int = 1,
    ) -> None:
        if ranks_per_server < 1:
            raise WeightSyncConfigError(f"ranks_per_server={ranks_per_server}: expected >= 1")
        if backend not in BACKENDS:
            raise WeightSyncConfigError(f"backend={backend!r}: expected one of {list(BACKENDS)}")
        if world_size < 2:
            raise WeightSyncConfigError(f"world_size={world_size}: expected >= 2 (trainer + >= 1 server)")
        if not 1 <= master_port <= 65535:
            raise WeightSyncConfigError(f"master_port={master_port}: expected a TCP port in [1, 65535]")
        self.master_addr, self.master_port, self.world_size = master_addr, master_port, world_size
        self.backend, self.group_name, self.timeout_s, self.device = backend, group_name, timeout_s, device
        #: Group ranks of one server: 1 (the hf server), or its tensor-parallel size (an sglang engine's
        #: TP workers each join, as rank_offset + tp_rank).
        self.ranks_per_server = ranks_per_server
        self.group: BroadcastGroup | None = None
        #: Number of completed syncs; each send publishes str(weight_version) unless told otherwise.
        self.weight_version = 0

    @staticmethod
    def _clients(clients: WeightUpdateClient | Sequence[WeightUpdateClient]) -> list[WeightUpdateClient]:
        return list(clients) if isinstance(clients, Sequence) else [clients]

    async def init_group(self, clients: WeightUpdateClient | Sequence[WeightUpdateClient]) -> None:
        """Join as rank 0 while every server joins (POST /init_weights_update_group): server i as ranks
        1 + i·ranks_per_server … (i + 1)·ranks_per_server."""
        clients = self._clients(clients)
        per = self.ranks_per_server
        if 1 + len(clients) * per != self.world_size:
            raise WeightSyncConfigError(
                f"world_size={self.world_size} but {len(clients)} servers of {per} rank(s) given: expected "
                "1 + servers × ranks_per_server"
            )
        joining = in_daemon_thread(
            BroadcastGroup.join,
            self.master_addr,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.backend,
            self.device,
            self.timeout_s,
        )
        calls = [
            c.init_weights_update_group(
                InitGroupRequest(
                    self.master_addr,
                    self.master_port,
                    1 + i * per,
                    self.world_size,
                    self.group_name,
                    self.backend,
                )
            )
            for i, c in enumerate(clients)
        ]
        self.group = await _together("init_weights_update_group", joining, calls)

    async def send(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        clients: WeightUpdateClient | Sequence[WeightUpdateClient],
        weight_version: str | None = None,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = True,
    ) -> str:
        """Broadcast `named_tensors` to every server and have them load it; returns the new weight version.

        The HTTP calls (POST /update_weights_from_distributed) run concurrently with the broadcasts, as
        SGLang requires. named_tensors: HF state_dict names → tensors (any device: copied to the group's).
        weight_version: default str(number of completed syncs + 1).
        Raises:
            WeightSyncError: a server refused or a broadcast failed (the group is then unusable).
        """
        if self.group is None:
            raise WeightSyncError("send before init_group: the weight-sync group is not joined")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not items:
            raise WeightSyncConfigError("named_tensors: expected at least one tensor")
        version = weight_version if weight_version is not None else str(self.weight_version + 1)
        dev = self.group.device
        tensors = [t.detach().to(dev).contiguous() for _, t in items]
        specs = [
            TensorSpec(n, dtype_name(t.dtype), tuple(t.shape))
            for (n, _), t in zip(items, tensors, strict=True)
        ]
        request = DistributedUpdateRequest(
            names=tuple(s.name for s in specs),
            dtypes=tuple(s.dtype for s in specs),
            shapes=tuple(s.shape for s in specs),
            group_name=self.group_name,
            weight_version=version,
            flush_cache=flush_cache,
            load_format=load_format,
        )
        sending = in_daemon_thread(self._broadcast_all, specs, tensors, load_format)
        calls = [c.update_weights_from_distributed(request) for c in self._clients(clients)]
        await _together("update_weights_from_distributed", sending, calls)
        self.weight_version += 1
        return version

    def _broadcast_all(
        self, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], load_format: str | None
    ) -> None:
        assert self.group is not None
        if load_format == "flattened_bucket":
            for idx in dtype_groups(specs).values():
                self.group.broadcast(torch.cat([tensors[i].reshape(-1) for i in idx]))
            return
        for tensor in tensors:
            self.group.broadcast(tensor)

    async def destroy(self, clients: WeightUpdateClient | Sequence[WeightUpdateClient]) -> None:
        """POST /destroy_weights_update_group to every server, then leave the group."""
        await asyncio.gather(
            *(c.destroy_weights_update_group(self.group_name) for c in self._clients(clients))
        )
        if self.group is not None:
            self.group.close()
            self.group = None
