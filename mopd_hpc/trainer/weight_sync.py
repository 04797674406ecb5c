"""The controller's weight sync, actor → rollout engines (DESIGN.md §5): one interface, two backends.

    await sync.start(clients)        # once, before the first push
    await sync.push(step, clients)   # the rollout engines then sample with the weights of `step`
    await sync.close(clients)        # at the end of the run

`TorchSync` (weight_sync.backend torch): `TorchBroadcastSender` — the rollout servers join a dedicated
group (gloo on CPU, NCCL on GPU) and every push broadcasts `engine.named_weights()` with
weight_version = str(step).

`IpcSync` (weight_sync.backend ipc; rollout.mode colocated, one node: `engines/weight_sync/ipc.py`): the
first push allocates one persistent flat buffer per dtype of `engine.named_weights()` (HF names, bucketed
past `bucket_bytes`, a tied weight once under both of its names) on the actor's device, shared by handle (CUDA IPC on GPU, a /dev/shm file on CPU);
every push copies the weights into it and POSTs the layout (/update_weights_from_ipc) to every server,
which maps the buffers once and copies them into its parameters.

Every sync keeps `spans`: the sub-phase seconds of its last push (`time/sync/<span>_s` in the metrics
line; torch: export, send; ipc: export, fill, post, copy (the slowest server's); awex: publish, the writer's
sub-phases and reader<i>_<span> of each server's: `engines/weight_sync/awex_spans.py`).

`AwexSync` (weight_sync.backend awex; awex 0.9.0, `engines/weight_sync/awex_actor.py`): start runs the
MetaServer on this process (its address in run_dir/awex_meta_server.json), builds the actor's writer
(`AwexActorPublisher`, then `initialize()`; at an actor world > 1 every other trainer rank builds its own at
the first push, trainer/rank_writer.py), and has every rollout server build its reader
(`RolloutClient.awex_init(inference_config(i))`, in engine order). A push runs the writer's `publish(step)`
and every server's `awex_update(step)` at the same time: each side blocks until the other has taken part
(colocate: CUDA IPC handles through the MetaServer; separate: one NCCL group). In colocate mode awex
leaves the actor's memory released (offloaded) after `initialize()` and after every publish: the
controller onloads it before the next train step, checkpoint, evaluation or save.

The publish runs in a daemon thread (not an executor thread as `asyncio.to_thread` would use): a publish
blocked on readers that failed cannot be cancelled, and must not keep the process from exiting after the
error has been raised (the same reason as `TorchBroadcastSender`'s broadcasts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mopd_hpc.engines.daemon_thread import in_daemon_thread
from mopd_hpc.engines.expert_names import CheckpointNames
from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexJobConfig
from mopd_hpc.engines.weight_sync.awex_actor import (
    AwexActorPublisher,
    start_run_meta_server,
    stop_run_meta_server,
)
from mopd_hpc.engines.weight_sync.ipc import DEFAULT_BUCKET_BYTES, SharedBuffers, tied_aliases
from mopd_hpc.engines.weight_sync.torch import TorchBroadcastSender, WeightSyncError
from mopd_hpc.trainer.awex_job import awex_job_config

if TYPE_CHECKING:
    from mopd_hpc.config import RunConfig
    from mopd_hpc.engines.rollout.client import RolloutClient

log = logging.getLogger("mopd_hpc.trainer")

#: Seconds a rank of the torch broadcast group waits for the others.
TORCH_SYNC_TIMEOUT_S = 600.0


class AwexSyncError(RuntimeError):
    """An AWEX start or push failed; the message names the step (or "start"), the side and the cause."""


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """The weight-sync rendezvous: the actor's address and its named `master` port; gloo or nccl (torch).
    AWEX uses the address only: its MetaServer binds it."""

    master_addr: str
    master_port: int
    backend: str = "gloo"


class WeightSync(Protocol):
    """What the controller calls (module docstring)."""

    async def start(self, clients: Sequence[RolloutClient]) -> None: ...

    async def push(self, step: int, clients: Sequence[RolloutClient]) -> None: ...

    async def close(self, clients: Sequence[RolloutClient]) -> None: ...

    #: Sub-phase seconds of the last push (module docstring).
    spans: dict[str, float]
    #: Whether every trainer rank writes its own shards in a push (the followers publish with rank 0).
    every_rank: bool


# ----------------------------------------------------------------------------------------------- torch


class TorchSync:
    """torch.distributed broadcast (module docstring). `engine` gives `named_weights()`; each server joins
    with `ranks_per_server` ranks (rollout.engines.tensor_parallel: an sglang engine's TP workers)."""

    every_rank = False  # rank 0 sends; at TP > 1 its TP group joins the per-tensor gather

    def __init__(
        self,
        engine: Any,
        settings: SyncSettings,
        timeout_s: float = TORCH_SYNC_TIMEOUT_S,
        ranks_per_server: int = 1,
    ) -> None:
        self.engine, self.settings, self.timeout_s = engine, settings, timeout_s
        self.ranks_per_server = ranks_per_server
        self.sender: TorchBroadcastSender | None = None
        self.spans: dict[str, float] = {}

    async def start(self, clients: Sequence[RolloutClient]) -> None:
        """Every server joins the group after this process (rank 0), with its ranks_per_server ranks."""
        self.sender = TorchBroadcastSender(
            self.settings.master_addr,
            self.settings.master_port,
            world_size=1 + len(clients) * self.ranks_per_server,
            backend=self.settings.backend,
            timeout_s=self.timeout_s,
            ranks_per_server=self.ranks_per_server,
        )
        await self.sender.init_group(list(clients))

    async def push(self, step: int, clients: Sequence[RolloutClient]) -> None:
        """Broadcast the actor's weights; the servers' weight_version becomes str(step).

        Raises:
            WeightSyncError: push before start, a server refused, or a broadcast failed.
        """
        if self.sender is None:
            raise WeightSyncError(f"step {step}: push before start: the torch broadcast group is not joined")
        t0 = time.perf_counter()
        weights = list(self.engine.named_weights())
        t1 = time.perf_counter()
        await self.sender.send(weights, list(clients), weight_version=str(step))
        self.spans = {"export": t1 - t0, "send": time.perf_counter() - t1}

    async def close(self, clients: Sequence[RolloutClient]) -> None:
        """The servers leave the group, then this process does (no-op before start)."""
        if self.sender is not None:
            await self.sender.destroy(list(clients))


# ------------------------------------------------------------------------------------------------- ipc


class IpcSync:
    """Shared buffers on one node (module docstring). `engine` gives `named_weights()` (HF names, on the
    actor's device); bucket_bytes: the largest buffer."""

    every_rank = False  # rank 0 fills the buffers; at TP > 1 its TP group joins the per-tensor gather

    def __init__(self, engine: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.engine, self.bucket_bytes = engine, bucket_bytes
        self.buffers: SharedBuffers | None = None
        self.spans: dict[str, float] = {}
        #: How many times the buffers were allocated (once, unless the weights' layout changes).
        self.allocations = 0

    async def start(self, clients: Sequence[RolloutClient]) -> None:
        """Nothing to join: the buffers are allocated by the first push (the weights must be resident)."""
        del clients

    async def push(self, step: int, clients: Sequence[RolloutClient]) -> None:
        """Copy the actor's weights into the shared buffers; every server loads them; weight_version str(step).

        Raises:
            WeightSyncError: a server refused the update (its message names the weight), naming the step.
        """
        t0 = time.perf_counter()
        items = list(self.engine.named_weights())
        t1 = time.perf_counter()
        if self.buffers is None or not self.buffers.matches(items):
            if self.buffers is not None:
                self.buffers.close()
            specs = [(n, t.dtype, tuple(t.shape)) for n, t in items]
            self.buffers = SharedBuffers.allocate(
                specs, items[0][1].device, self.bucket_bytes, aliases=tied_aliases(items)
            )
            self.allocations += 1
            log.info("weight sync: %d shared buffer(s), %.3f GB", len(self.buffers.handles),
                     self.buffers.nbytes / 1e9)  # fmt: skip
        self.buffers.fill(items)
        t2 = time.perf_counter()
        body = self.buffers.request(str(step)).to_json()
        calls = [c.update_weights_from_ipc(body) for c in clients]
        try:
            answers = await asyncio.gather(*calls)
        except Exception as exc:
            raise WeightSyncError(f"weight sync of step {step}: {type(exc).__name__}: {exc}") from exc
        copy_s = max((float(a.get("seconds", {}).get("copy", 0.0)) for a in answers), default=0.0)
        self.spans = {"export": t1 - t0, "fill": t2 - t1, "post": time.perf_counter() - t2, "copy": copy_s}

    async def close(self, clients: Sequence[RolloutClient]) -> None:
        """Free the buffers (the CPU files are unlinked)."""
        del clients
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None


# ------------------------------------------------------------------------------------------------ awex


async def _together(what: str, labelled: Sequence[tuple[str, asyncio.Future[Any]]]) -> list[Any]:
    """Await every (label, future) at once; the first failure cancels the rest (a thread's future only
    stops being awaited) and raises AwexSyncError naming `what`, the label and the cause."""
    futures = [f for _, f in labelled]
    label_of = {id(f): label for label, f in labelled}
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    failed = [f for f in futures if f in done and not f.cancelled() and f.exception() is not None]
    if failed:
        for p in pending:
            p.cancel()
        exc = failed[0].exception()
        assert exc is not None
        raise AwexSyncError(f"{what}: {label_of[id(failed[0])]} failed: {type(exc).__name__}: {exc}") from exc
    return [f.result() for f in futures]


class AwexSync:
    """AWEX weight sync of a megatron actor (module docstring).

    Args:
        config: the job's AWEX settings (`awex_job_config`), MetaServer address still empty.
        engine: the `MegatronTrainEngine` (its `.model`, `.hf_config`, `.residency`, `.device`).
        run_dir: where the MetaServer address file goes. host: the address the MetaServer binds (the
            actor's master address: loopback locally, the node's address on a cluster).
    """

    def __init__(self, config: AwexJobConfig, engine: Any, run_dir: str | Path, host: str) -> None:
        self.config, self.engine, self.run_dir, self.host = config, engine, Path(run_dir), host
        #: Every trainer rank writes its own shards (trainer/rank_writer.py): the followers publish with it.
        self.every_rank = config.train_world > 1
        self.address: str | None = None
        self.publisher: Any = None
        self.spans: dict[str, float] = {}

    def _on_device(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """`fn` under `torch.cuda.device(engine.device)`: a new thread's current CUDA device is 0, not the
        one `initialize_parallel` set (the same for the one-GPU actor, which sees one device)."""
        device = getattr(self.engine, "device", None)
        if device is None or getattr(device, "type", "cpu") != "cuda":
            return fn

        def scoped() -> Any:
            import torch

            with torch.cuda.device(device):
                return fn()

        return scoped

    async def start(self, clients: Sequence[RolloutClient]) -> None:
        """MetaServer (address written to the run dir) → the writer (`initialize()`) → every server's reader
        (`awex_init(inference_config(i))`, engine i = clients[i]).

        Raises:
            AwexConfigError: the number of clients is not rollout.engines.count.
            AwexSyncError: the writer's initialize or a server's init failed (naming which).
        """
        if len(clients) != self.config.num_engines:
            raise AwexConfigError(
                f"{len(clients)} rollout clients for rollout.engines.count = {self.config.num_engines}; "
                "expected one client per engine, in engine order"
            )
        self.address = start_run_meta_server(self.run_dir, self.host)
        log.info("AWEX MetaServer at %s (%s mode)", self.address, self.config.mode)
        config = self.config.with_meta_server(self.address)
        self.publisher = AwexActorPublisher(config, self.engine)
        initializing = in_daemon_thread(self._on_device(self.publisher.initialize), name="awex-initialize")
        await _together("AWEX start", [("the actor's writer initialize()", initializing)])
        for i, client in enumerate(clients):
            try:
                await client.awex_init(config.inference_config(i))
            except Exception as exc:
                raise AwexSyncError(
                    f"AWEX start: rollout engine {i} ({client.base_url}) /awex/init failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc

    async def push(self, step: int, clients: Sequence[RolloutClient]) -> None:
        """`publish(step)` and every server's `awex_update(step)` at the same time (each blocks until the
        other side takes part); returns when all are done.

        Raises:
            AwexSyncError: push before start, or the first failure of either side, naming the step.
        """
        if self.publisher is None:
            raise AwexSyncError(f"AWEX sync of step {step}: push before start (no writer)")
        publisher = self.publisher
        labelled: list[tuple[str, asyncio.Future[Any]]] = [
            (
                "the actor's publish",
                in_daemon_thread(
                    self._on_device(lambda: publisher.publish(step)), name=f"awex-publish-{step}"
                ),
            )
        ]
        labelled += [
            (f"rollout engine {i} ({c.base_url}) /awex/update_weights", _task(c.awex_update(step)))
            for i, c in enumerate(clients)
        ]
        results = await _together(f"AWEX sync of step {step}", labelled)
        log.info("AWEX step %d published in %.3f s", step, float(results[0]))
        self.spans = {"publish": float(results[0])} | dict(getattr(publisher, "last_spans", {}))
        for i, answer in enumerate(results[1:]):
            self.spans |= {f"reader{i}_{k}": float(v) for k, v in (answer or {}).get("spans", {}).items()}

    async def close(self, clients: Sequence[RolloutClient]) -> None:
        """Stop the MetaServer this process started (no-op before start)."""
        del clients
        if self.address is not None:
            stop_run_meta_server()
            self.address = None


def _task(coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    return asyncio.ensure_future(coro)


def build_sync(cfg: RunConfig, engine: Any, settings: SyncSettings, run_dir: str | Path) -> WeightSync:
    """The sync weight_sync.backend names: `TorchSync(engine, settings)`, `IpcSync(engine)` or
    `AwexSync(awex_job_config(cfg), engine, run_dir, host=settings.master_addr)`; into sglang engines the
    engine's fused experts go under their checkpoint names (`engines.expert_names.CheckpointNames`).

    Raises:
        AwexConfigError: AWEX settings the job cannot have (`awex_job_config`).
    """
    backend = cfg.weight_sync.backend
    if cfg.rollout.backend == "sglang":  # SGLang loads an MoE's experts under their checkpoint names
        engine = CheckpointNames(engine)
    if backend == "torch":
        return TorchSync(engine, settings, ranks_per_server=cfg.rollout.engines.tensor_parallel)
    if backend == "ipc":
        return IpcSync(engine)
    if backend == "awex":
        return AwexSync(awex_job_config(cfg), engine, run_dir, settings.master_addr)
    raise AwexConfigError(f"weight_sync.backend={backend!r}: expected 'torch', 'ipc' or 'awex'")
