"""A tensor-parallel teacher replica in the job (`models.teachers[i].tensor_parallel` > 1): the teacher role's
children of one replica form the replica's world, each builds its shard engine, the leader serves HTTP and the
followers run the same forwards (engines/teacher/tensor_parallel.py).

Who is who (plan/placement.py): one child per GPU of the replica, MOPD_RANK / MOPD_WORLD_SIZE its rank in the
replica's TP group (the world is the replica, nothing else); rank 0, the leader, leases the ports `http` and
`master`. `replica_spec` reads them (with the role's device and the config), None at tensor_parallel 1.

Forming the world (`join_replica`): the leader binds a TCP store to its advertised address (`master_address`)
on its `master` port, sets a random nonce in it and publishes
`run_dir/endpoints/teacher-<id>.r<replica>-rendezvous.json` (trainer/rendezvous.py: the actor group's rules,
a record counts only for this job and world size, and only when its store holds its nonce); a follower waits
for it as long as the actor waits for the servers (MOPD_ENDPOINT_TIMEOUT_S), connects and checks the nonce.
Every rank then joins the world with `init_process_group` on that store (keys under `mopd_teacher/world`): gloo
on CPU, NCCL on GPU (each rank on its own device, the gloo interface the one that carries the store's
address). A megatron shard engine initializes megatron's parallel state over that world
(`engines.teacher.process.build_engine`). Collectives time out after `models.actor.collective_timeout_s`, the job's
collective timeout.

The leader (`lead_replica`) serves as a one-process teacher does (`engines.teacher.process.serve_engine`: the endpoint
record with the job id, the job's token, stopped by the end of the job or SIGTERM/SIGINT) with `TPLeader` as
its engine, and a heartbeat thread sends HEARTBEAT every `ReplicaSpec.heartbeat_s` (the followers' wait for
the next header is a collective: it must not time out while the leader is idle). When the server stops, the
leader sends STOP, leaves the world and removes the rendezvous record. The followers (`follow_replica`) run
`follow` until STOP and exit 0.

Failure. A follower that dies makes the leader's next broadcast (a request's, or the heartbeat's at most
`heartbeat_s` later) fail: at once on gloo (the connection closed), after the collective timeout for a frozen
follower (NCCL's watchdog aborts the process then). The leader then stops serving, removes its endpoint and
rendezvous records and raises `ReplicaLostError` (exit non-zero: the guard ends the job, DESIGN.md §7). A
leader that dies ends each follower's wait the same way (`follow` raises: exit non-zero). SIGTERM/SIGINT do
not interrupt a following follower (the guard signals every child of the job, and the leader, stopping, sends
STOP); a follower signalled before it follows exits 0 at once, and one signalled while following exits 0 also
when its leader is gone rather than stopped (it was asked to stop). The guard's SIGKILL escalation bounds the
rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.teacher.process import TeacherArgs, serve_engine, set_threads, shutdown_parallel
from mopd_hpc.roles.endpoints import endpoint_timeout_s
from mopd_hpc.roles.env import RoleEnv, RoleEnvError, master_address
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.netif import bind_gloo_to, local_address_towards
from mopd_hpc.trainer.group import group_settings_problem
from mopd_hpc.trainer.rendezvous import RendezvousFile, connect_store, publish_store

log = logging.getLogger("mopd_hpc.teacher")

#: The leader's heartbeat period, seconds (at most a quarter of the collective timeout: `heartbeat_s`).
HEARTBEAT_S = 2.0
#: How long leaving the world may take before it is abandoned, seconds (after a lost peer the teardown can
#: block on a connection that never answers; the process must still exit with its error).
CLOSE_WAIT_S = 10.0
#: The prefix of torch.distributed's keys in the leader's store.
WORLD_PREFIX = "mopd_teacher/world"

#: Builds this rank's shard engine from the server's arguments (`engines.teacher.process.build_engine`).
EngineBuilder = Callable[[TeacherArgs], Any]


class ReplicaLostError(RuntimeError):
    """A rank of a tensor-parallel teacher replica is gone or silent: a broadcast of the leader/follower
    protocol failed or timed out (the message names the replica, the rank and torch's error)."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """This child's place in its teacher replica's TP world. Build with `replica_spec`.

    Attributes:
        teacher_id, replica: the replica (`models.teachers[i].id`, MOPD_TEACHER_REPLICA).
        rank, world_size: this child's TP rank (0: the leader) and the replica's tensor_parallel.
        backend: "gloo" (CPU) or "nccl" (GPU). device: this rank's device ("cpu", "cuda:0"), where the
            protocol's messages live.
        collective_timeout_s: the longest a collective waits for the other ranks, seconds.
        rendezvous_timeout_s: how long a follower waits for the leader's rendezvous record, seconds.
        master_host, master_port: the leader's advertised address and leased `master` port (None on a follower).
    """

    teacher_id: str
    replica: int
    rank: int
    world_size: int
    backend: str
    device: str
    collective_timeout_s: float
    rendezvous_timeout_s: float
    master_host: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 2 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank={self.rank}, world_size={self.world_size}: expected a TP group of 2 or more ranks and "
                "0 <= rank < world_size"
            )
        problem = group_settings_problem(self.backend, self.collective_timeout_s, self.rendezvous_timeout_s)
        if problem is not None:
            raise ValueError(problem)
        if self.rank == 0 and (self.master_host is None or self.master_port is None):
            raise ValueError("the leader (rank 0) needs its advertised host and its `master` port")

    @property
    def name(self) -> str:
        return f"teacher {self.teacher_id} replica {self.replica} rank {self.rank}/{self.world_size}"

    @property
    def heartbeat_s(self) -> float:
        """The leader's heartbeat period: HEARTBEAT_S, at most a quarter of the collective timeout."""
        return min(HEARTBEAT_S, self.collective_timeout_s / 4)


def replica_spec(
    role: RoleEnv, cfg: RunConfig, args: TeacherArgs, environ: Mapping[str, str]
) -> ReplicaSpec | None:
    """This child's `ReplicaSpec` (module docstring), or None for a replica of tensor_parallel 1.

    Raises:
        RoleEnvError: MOPD_WORLD_SIZE is not the teacher's tensor_parallel (a plan of another config), or the
            leader has no `master` port; MOPD_ENDPOINT_TIMEOUT_S is not a number.
    """
    if role.world_size != args.tensor_parallel:
        raise RoleEnvError(
            f"{child_env.WORLD_SIZE}={role.world_size} but {args.field('tensor_parallel')} is "
            f"{args.tensor_parallel}: a replica's children are its TP group; expected the plan of this run's config"
        )
    if args.tensor_parallel == 1:
        return None
    try:
        rendezvous_timeout_s = endpoint_timeout_s(environ)
    except ValueError as exc:
        raise RoleEnvError(f"the servers' deadline: {exc}") from None
    leader = role.rank == 0
    device = role.device.torch_name
    return ReplicaSpec(
        teacher_id=args.teacher_id,
        replica=args.replica,
        rank=role.rank,
        world_size=role.world_size,
        backend="gloo" if device == "cpu" else "nccl",
        device=device,
        collective_timeout_s=cfg.models.actor.collective_timeout_s,
        rendezvous_timeout_s=rendezvous_timeout_s,
        master_host=master_address(role) if leader else None,
        master_port=role.port("master") if leader else None,
    )


def join_replica(spec: ReplicaSpec, run_dir: Path, job_id: str) -> Any:
    """Form the replica's world (module docstring) as torch.distributed's default group; returns the store
    (the leader's store server lives in it: keep it until `leave_replica`).

    Raises:
        RendezvousTimeoutError: no record in time (a follower); OSError: the port cannot be bound (the
        leader); NetworkInterfaceError: no interface carries the address; torch's DistError: the world did
        not form within the collective timeout.
    """
    import torch
    import torch.distributed as dist

    file = RendezvousFile.teacher(run_dir, spec.teacher_id, spec.replica)
    if spec.rank == 0:
        assert spec.master_host is not None and spec.master_port is not None  # ReplicaSpec checks it
        store, record = publish_store(
            file, job_id, spec.master_host, spec.master_port, spec.world_size, spec.collective_timeout_s
        )
        local = spec.master_host
    else:
        store, record = connect_store(file, job_id, spec.world_size, spec.rendezvous_timeout_s)
        local = local_address_towards(record.host, record.port)
    bind_gloo_to(local)
    device = torch.device(spec.device)
    if spec.backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(WORLD_PREFIX, store),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout_s),
        device_id=device if spec.backend == "nccl" else None,
    )
    log.info(
        "%s joined (%s on %s), store %s:%d", spec.name, spec.backend, spec.device, record.host, record.port
    )
    return store


def leave_replica(spec: ReplicaSpec, args: TeacherArgs) -> None:
    """Leave the world (megatron's parallel state first, `shutdown_parallel`), in a daemon thread given
    CLOSE_WAIT_S; the leader then removes its rendezvous record."""
    import torch.distributed as dist

    def destroy() -> None:
        with contextlib.suppress(Exception):
            shutdown_parallel(args)
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()

    closing = threading.Thread(target=destroy, name="teacher-replica-close", daemon=True)
    closing.start()
    closing.join(CLOSE_WAIT_S)
    if closing.is_alive():
        log.warning("%s: the process group did not close in %g s; leaving it", spec.name, CLOSE_WAIT_S)
    if spec.rank == 0 and args.run_dir:
        with contextlib.suppress(FileNotFoundError):
            RendezvousFile.teacher(Path(args.run_dir), spec.teacher_id, spec.replica).path.unlink()


async def lead_replica(
    args: TeacherArgs, spec: ReplicaSpec, token: str, stop: asyncio.Event, build: EngineBuilder
) -> int:
    """The leader (module docstring): join, build its shard, serve over `TPLeader` with a heartbeat until
    `stop`, then STOP and leave; returns the requests it broadcast.

    Raises:
        ReplicaLostError: a broadcast failed (a follower is gone or silent); the records are removed.
        What `join_replica` and `build` raise.
    """
    from mopd_hpc.engines.teacher.tensor_parallel import TPLeader

    set_threads(args)
    store = await asyncio.to_thread(join_replica, spec, Path(args.run_dir or "."), args.job_id or "")
    try:
        engine = await asyncio.to_thread(build, args)
        leader = TPLeader(engine, None, spec.device)
        lost: list[BaseException] = []
        done = threading.Event()
        loop = asyncio.get_running_loop()

        def beat() -> None:
            while not done.wait(spec.heartbeat_s):
                try:
                    leader.heartbeat()
                except Exception as exc:  # noqa: BLE001 - the replica is lost: stop serving, raise below
                    lost.append(exc)
                    loop.call_soon_threadsafe(stop.set)
                    return

        heart = threading.Thread(target=beat, name="teacher-replica-heartbeat", daemon=True)
        heart.start()
        try:
            await serve_engine(args, token, leader, stop)
        finally:
            done.set()
            await asyncio.to_thread(heart.join, spec.collective_timeout_s + CLOSE_WAIT_S)
        if lost:
            raise ReplicaLostError(
                f"{spec.name}: the heartbeat to the followers failed (a follower is gone or silent for "
                f"{spec.collective_timeout_s:g} s, models.actor.collective_timeout_s): {lost[0]}"
            ) from lost[0]
        try:
            await asyncio.to_thread(leader.stop)
        except RuntimeError as exc:
            raise ReplicaLostError(f"{spec.name}: STOP did not reach the followers: {exc}") from exc
        log.info("%s stopped the followers after %d request(s)", spec.name, leader.requests)
        return leader.requests
    finally:
        await asyncio.to_thread(leave_replica, spec, args)
        del store


class _FollowerSignals:
    """SIGTERM/SIGINT of a follower: exit 0 at once before it follows, afterwards only noted (`asked`)."""

    def __init__(self) -> None:
        self.following = False
        self.asked = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        del frame
        self.asked = True
        if not self.following:
            raise SystemExit(0)
        log.info("signal %d: waiting for the leader's STOP", signum)


def follow_replica(args: TeacherArgs, spec: ReplicaSpec, build: EngineBuilder) -> int:
    """A follower (module docstring): join, build its shard, `follow` until STOP, leave; returns the
    requests it served.

    Raises:
        ReplicaLostError: the leader is gone or silent (not after SIGTERM/SIGINT: then it returns -1).
        What `join_replica` and `build` raise.
    """
    from mopd_hpc.engines.teacher.tensor_parallel import follow

    signals = _FollowerSignals()
    signals.install()
    set_threads(args)
    store = join_replica(spec, Path(args.run_dir or "."), args.job_id or "")
    try:
        engine = build(args)
        signals.following = True
        try:
            served = follow(engine, None, spec.device)
        except RuntimeError as exc:
            if signals.asked:
                log.info("%s: asked to stop, and the leader is gone (%s)", spec.name, exc)
                return -1
            raise ReplicaLostError(
                f"{spec.name}: the leader is gone or silent (models.actor.collective_timeout_s = "
                f"{spec.collective_timeout_s:g} s): {exc}"
            ) from exc
        log.info("%s: STOP after %d request(s)", spec.name, served)
        return served
    finally:
        leave_replica(spec, args)
        del store
