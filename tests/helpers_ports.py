"""Free TCP ports for tests that start servers, rendezvous stores and process groups on a port of their own.

Each port is a node-wide lease of `mopd_hpc/runtime/ports.py` (the abstract Unix socket `\\0mopd-port-<P>`) held
by this test process until it exits: another pytest-xdist worker, and a job a test starts (its guards lease
their ports the same way), never gets it, where "bind port 0, close, hand the number out" could give two
workers the same port between the close and the server's bind. The ports lie outside the kernel's ephemeral
range (no outgoing connection takes one), and each was free for a TCP bind on every IPv4 address when leased.
The TCP port itself stays unbound: the test's server binds it.
"""

from __future__ import annotations

import itertools
import threading

from mopd_hpc.runtime.ports import LeasePolicy, PortLeaser, PortOwner, read_ephemeral_range

_OWNER = PortOwner.create("pytest", "test", 0)
_LOCK = threading.Lock()
_NAMES = itertools.count()
_LEASER: PortLeaser | None = None


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (module docstring), leased until this process exits.

    Raises:
        PortsExhaustedError: no free port is left in the lease range.
    """
    global _LEASER
    with _LOCK:
        if _LEASER is None:
            _LEASER = PortLeaser(LeasePolicy.create(ephemeral=read_ephemeral_range()))
        names = [f"p{next(_NAMES)}" for _ in range(n)]
        return [lease.port for lease in _LEASER.reserve(_OWNER, names).values()]


def free_port() -> int:
    """One free port (module docstring), leased until this process exits."""
    return free_ports(1)[0]
