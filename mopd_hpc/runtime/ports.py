"""Node-wide, kernel-held, named port leases (DESIGN.md §4, Port leases).

A lease on TCP port P is the abstract Unix socket `\\0mopd-port-<P>` (see `ports_registry`): node-wide
across jobs and users, freed by the kernel when its last holder dies, with no shared writable directory.
Taking a lease:

1. pick a candidate P from `LeasePolicy` (inside [lo, hi], never inside the kernel's ephemeral range,
   where `connect()` picks source ports and any outgoing connection could take P);
2. bind the abstract name (fails at once if another process holds the lease);
3. check P with a real TCP bind on the configured host (no SO_REUSEADDR): if a foreign process, one that
   does not use leases, has P bound (or in TIME_WAIT), drop the lease and try the next candidate.

Never "bind :0, close, hand out later": the lease is held from step 2 until `release`. Ports are NAMED
(`http`, `nccl`, `dist_init`, `master`, ...), never positional; `reserve` and `release` are idempotent per
owner. Leases are held per (owner, generation): a lease reserved without a generation (`/ports/reserve`
ahead of a spawn) is adopted by the generation whose spawn names it; a new generation never shares a lease
an older one holds (it gets its own port), and `release(owner, up_to_generation=g)` (a kill of generation
g) drops g's leases and older ones only, never those a newer generation of the slot took meanwhile. A lease is handed to a child by passing `lease.fd` (`subprocess.Popen(pass_fds=...)`): the child
then holds the lease while it lives, even if this process releases it or dies.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from mopd_hpc.runtime.child_env import port_env_name
from mopd_hpc.runtime.ports_registry import OwnerRecordServer, bind_lease_socket

#: Where Linux keeps the ephemeral port range ("lo<TAB>hi"); read at the edge, passed in.
EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
#: Default search range for leases (the ephemeral range is cut out of it).
DEFAULT_LEASE_RANGE = (20000, 65535)

_PORT_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_ROLE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


class PortLeaseError(ValueError):
    """A port lease could not be taken or the request was malformed."""


class PortsExhaustedError(PortLeaseError):
    """No port of the policy's range is free (leased elsewhere or bound by a foreign process)."""


class PortInUseError(PortLeaseError):
    """A specific port asked for is leased by another process or bound by a foreign process."""


def read_ephemeral_range(path: str = EPHEMERAL_RANGE_PATH) -> tuple[int, int]:
    """The kernel's ephemeral port range `(lo, hi)`, both inclusive. Call at the edge; pass the result in."""
    with open(path, encoding="ascii") as f:
        lo, hi = (int(x) for x in f.read().split())
    return lo, hi


def validate_port_name(name: object) -> str:
    if not isinstance(name, str) or not _PORT_NAME_RE.match(name):
        raise PortLeaseError(
            f"port name {name!r} is invalid: expected lowercase [a-z][a-z0-9_]* of at most 32 characters "
            "(e.g. 'http', 'nccl', 'dist_init', 'master')"
        )
    return name


@dataclass(frozen=True, slots=True)
class PortOwner:
    """Who holds a lease: a child slot (job, role, index) on this node. Build with `PortOwner.create`."""

    job_id: str
    role: str
    index: int

    @classmethod
    def create(cls, job_id: str, role: str, index: int) -> PortOwner:
        """Raises PortLeaseError naming the bad field."""
        if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
            raise PortLeaseError(f"owner job_id={job_id!r} is invalid: expected [A-Za-z0-9][A-Za-z0-9_.+-]*")
        if not isinstance(role, str) or not _ROLE_RE.match(role):
            raise PortLeaseError(f"owner role={role!r} is invalid: expected lowercase [a-z][a-z0-9_-]*")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise PortLeaseError(f"owner index={index!r} is invalid: expected an integer >= 0")
        return cls(job_id, role, index)

    def __str__(self) -> str:
        return f"{self.job_id}/{self.role}/{self.index}"


@dataclass(frozen=True, slots=True)
class PortLease:
    """A held lease: TCP `port` under `name` for `owner`, held by socket `fd` of process `pid`, for the
    child generation `generation` of the owner's slot (None: reserved ahead of any spawn)."""

    port: int
    name: str
    owner: PortOwner
    pid: int
    fd: int
    generation: int | None = None

    @property
    def env_key(self) -> str:
        return port_env_name(self.name)


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """Where leases are searched. Build with `LeasePolicy.create(ephemeral=read_ephemeral_range())`.

    Attributes:
        lo, hi: search range, inclusive.
        ephemeral: the kernel's ephemeral range (inclusive), never handed out.
        bind_host: address of the real-bind check ("0.0.0.0" catches a foreign bind on any IPv4 address).
    """

    lo: int
    hi: int
    ephemeral: tuple[int, int]
    bind_host: str = "0.0.0.0"

    @classmethod
    def create(
        cls,
        ephemeral: tuple[int, int],
        lo: int = DEFAULT_LEASE_RANGE[0],
        hi: int = DEFAULT_LEASE_RANGE[1],
        bind_host: str = "0.0.0.0",
    ) -> LeasePolicy:
        """Raises PortLeaseError when the range is empty, out of 1..65535, or entirely ephemeral."""
        if not (1 <= lo <= hi <= 65535):
            raise PortLeaseError(f"lease range lo={lo}, hi={hi} is invalid: expected 1 <= lo <= hi <= 65535")
        e_lo, e_hi = ephemeral
        if e_lo > e_hi:
            raise PortLeaseError(f"ephemeral range {ephemeral} is invalid: expected lo <= hi")
        policy = cls(lo, hi, (e_lo, e_hi), bind_host)
        if not policy.size:
            raise PortLeaseError(
                f"lease range [{lo}, {hi}] lies inside the ephemeral range [{e_lo}, {e_hi}]: "
                "choose a range outside it (see /proc/sys/net/ipv4/ip_local_port_range)"
            )
        return policy

    def allowed(self, port: int) -> bool:
        return self.lo <= port <= self.hi and not (self.ephemeral[0] <= port <= self.ephemeral[1])

    @property
    def size(self) -> int:
        overlap = max(0, min(self.hi, self.ephemeral[1]) - max(self.lo, self.ephemeral[0]) + 1)
        return self.hi - self.lo + 1 - overlap

    def candidates(self, start: int) -> Iterator[int]:
        """Every allowed port once, from `start` upwards, wrapping around."""
        span = self.hi - self.lo + 1
        for i in range(span):
            port = self.lo + (start - self.lo + i) % span
            if self.allowed(port):
                yield port


def tcp_port_free(port: int, host: str = "0.0.0.0") -> bool:
    """A real bind check (no SO_REUSEADDR): True when `host:port` can be bound right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortLeaser:
    """Takes and holds named port leases for owners; answers owner-record queries for them.

    Thread-safe. `reserve` and `release` are idempotent per owner. `close()` releases everything.
    """

    def __init__(self, policy: LeasePolicy, *, seed: int | None = None) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        #: (owner, generation) → name → (lease, its socket); generation None: reserved ahead of a spawn.
        self._held: dict[tuple[PortOwner, int | None], dict[str, tuple[PortLease, socket.socket]]] = {}
        self._child_pid: dict[tuple[PortOwner, int | None], int] = {}
        self._records = OwnerRecordServer()
        rng = random.Random(
            seed if seed is not None else os.getpid() ^ int.from_bytes(os.urandom(4), "little")
        )
        self._cursor = rng.randint(policy.lo, policy.hi)

    def reserve(
        self, owner: PortOwner, names: Iterable[str], generation: int | None = None
    ) -> dict[str, PortLease]:
        """Lease one port per name for `owner` (for its child `generation`, when given); names already
        held for the same generation keep their port, and a name reserved without a generation is adopted
        by `generation` (same port).

        Returns:
            name → PortLease for every name asked for, in the order asked.
        Raises:
            PortLeaseError: a name is invalid or repeated. PortsExhaustedError: the range is full.
        """
        names = list(names)
        for name in names:
            validate_port_name(name)
        if len(set(names)) != len(names):
            raise PortLeaseError(f"port names {names} repeat a name: each named port is leased once")
        with self._lock:
            held = self._held.setdefault((owner, generation), {})
            pending = self._held.get((owner, None), {}) if generation is not None else {}
            for name in names:
                if name in held:
                    continue
                if name in pending:  # reserved ahead of this spawn: this generation's now, same port
                    lease, sock = pending.pop(name)
                    held[name] = (replace(lease, generation=generation), sock)
                    self._records.remove(sock)
                    self._records.add(sock, self._recorder(held[name][0]))
                else:
                    held[name] = self._take(owner, name, None, generation)
            if generation is not None and not pending:
                self._held.pop((owner, None), None)
            return {name: held[name][0] for name in names}

    def reserve_port(self, owner: PortOwner, name: str, port: int) -> PortLease:
        """Lease exactly `port` under `name` (idempotent when `owner` already holds it so).

        Raises:
            PortInUseError: leased by another process, bound by a foreign one, or `owner` holds `name`
                on another port. PortLeaseError: `port` is outside the policy or ephemeral.
        """
        validate_port_name(name)
        if not self.policy.allowed(port):
            raise PortLeaseError(
                f"port {port} for {name!r} is outside the lease range [{self.policy.lo}, {self.policy.hi}] "
                f"or inside the ephemeral range {list(self.policy.ephemeral)}"
            )
        with self._lock:
            held = self._held.setdefault((owner, None), {})
            if name in held:
                if held[name][0].port != port:
                    raise PortInUseError(f"owner {owner} already holds {name!r} on port {held[name][0].port}")
                return held[name][0]
            held[name] = self._take(owner, name, port, None)
            return held[name][0]

    def release(self, owner: PortOwner, up_to_generation: int | None = None) -> list[PortLease]:
        """Drop `owner`'s leases (a child that inherited one keeps it while it lives). Idempotent.

        Args:
            up_to_generation: drop only those of this generation, older ones and those reserved without
                a generation (a kill of that generation); None: every lease of `owner`.
        Returns:
            the leases dropped.
        """
        with self._lock:
            keys = [
                key
                for key in self._held
                if key[0] == owner
                and (up_to_generation is None or key[1] is None or key[1] <= up_to_generation)
            ]
            dropped = []
            for key in keys:
                self._child_pid.pop(key, None)
                for lease, sock in self._held.pop(key).values():
                    self._records.remove(sock)
                    sock.close()
                    dropped.append(lease)
        return dropped

    def note_child(self, owner: PortOwner, pid: int, generation: int | None = None) -> None:
        """Record that `owner`'s leases of `generation` were handed to child `pid` (in owner records)."""
        with self._lock:
            self._child_pid[(owner, generation)] = pid

    def leases(self, owner: PortOwner | None = None) -> list[PortLease]:
        with self._lock:
            return [
                lease
                for key, held in self._held.items()
                if owner is None or key[0] == owner
                for lease, _ in held.values()
            ]

    def close(self) -> None:
        for owner in {key[0] for key in list(self._held)}:
            self.release(owner)
        self._records.close()

    def __enter__(self) -> PortLeaser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(
        self, owner: PortOwner, name: str, port: int | None, generation: int | None
    ) -> tuple[PortLease, socket.socket]:
        if port is not None:
            got = self._try(owner, name, port, generation)
            if got is None:
                raise PortInUseError(f"port {port} for {owner}/{name} is leased by another process or bound")
            return got
        for candidate in self.policy.candidates(self._cursor):
            got = self._try(owner, name, candidate, generation)
            if got is not None:
                self._cursor = candidate + 1 if candidate < self.policy.hi else self.policy.lo
                return got
        raise PortsExhaustedError(
            f"no free port for {owner}/{name} in [{self.policy.lo}, {self.policy.hi}] outside the ephemeral "
            f"range {list(self.policy.ephemeral)}: widen the range or release leases (`mopd-debug ports`)"
        )

    def _try(
        self, owner: PortOwner, name: str, port: int, generation: int | None
    ) -> tuple[PortLease, socket.socket] | None:
        sock = bind_lease_socket(port)
        if sock is None:
            return None
        if not tcp_port_free(port, self.policy.bind_host):
            sock.close()
            return None
        lease = PortLease(port, name, owner, os.getpid(), sock.fileno(), generation)
        self._records.add(sock, self._recorder(lease))
        return lease, sock

    def _recorder(self, lease: PortLease) -> Callable[[], dict[str, Any]]:
        return lambda: self._record(lease)

    def _record(self, lease: PortLease) -> dict[str, Any]:
        return {
            "port": lease.port,
            "name": lease.name,
            "job_id": lease.owner.job_id,
            "role": lease.owner.role,
            "index": lease.owner.index,
            "pid": lease.pid,
            "generation": lease.generation,
            "child_pid": self._child_pid.get((lease.owner, lease.generation)),
            "uid": os.getuid(),
        }
