"""Where the job listens on a node: the guard, its children's servers and the torch rendezvous bind one
address.

That address is the node's cluster address (its host name resolved to IPv4) on Slurm and loopback on the
local backend; never every interface unless an operator configures it (`mopd-guard --bind 0.0.0.0`). The
guard binds it and hands it to each child as MOPD_NODE_ADDR (`runtime/child_env.py`), so the servers and the
rendezvous of its children bind exactly the address the guard does, and advertise it in their endpoint
records.
"""

from __future__ import annotations

import socket

#: The local backend's address (every process of a local run is on this machine).
LOOPBACK = "127.0.0.1"
#: Bind addresses that mean "every interface": nobody can connect to them as given.
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


class NodeAddressError(ValueError):
    """A host name does not resolve to an IPv4 address (named, with the resolver's error)."""


def node_address(host: str) -> str:
    """The IPv4 address `host` resolves to (the first `getaddrinfo` answer), e.g. "n1" → "10.200.0.11".

    Raises:
        NodeAddressError: `host` does not resolve; the message names it and the way out.
    """
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise NodeAddressError(
            f"host name {host!r} does not resolve ({exc}); expected this node's name as the cluster "
            "resolves it (or start the guard with --bind ADDR)"
        ) from None
    return str(infos[0][4][0])


def is_wildcard(address: str) -> bool:
    """True for an every-interface bind address ("0.0.0.0", "::", "")."""
    return address in WILDCARD_ADDRESSES
