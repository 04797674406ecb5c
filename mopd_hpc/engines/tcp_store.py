"""A torch `TCPStore` whose server listens on one address, never on every interface.

torch's TCPStore server binds the wildcard address whatever host it is given (torch 2.x: `*:<port>`), so
a rendezvous port would be open on every interface of the node. `tcp_store` binds the listening socket
itself, on `host` (the node's address the job uses: `runtime/node_address.py`, `roles/env.master_address`),
and hands it to torch (`master_listen_fd`, which takes ownership of the descriptor). Clients connect as
usual. Used by the weight-sync group (`weight_sync/torch.py`) and meant for every store a rank of the job
hosts.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any


def listening_socket_fd(host: str, port: int) -> int:
    """A TCP socket bound to (host, port), not yet listening, detached: the caller owns the descriptor.

    Raises:
        OSError: the address cannot be bound (EADDRINUSE, an address this node does not have, ...).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def tcp_store(
    host: str,
    port: int,
    world_size: int | None,
    *,
    is_master: bool,
    timeout_s: float,
    wait_for_workers: bool = False,
) -> Any:
    """A `torch.distributed.TCPStore`: the server (is_master) listens on `host` only; a client connects to it.

    Args:
        host: the store's address (IPv4/IPv6 literal or a name), bound by the server, connected to by clients.
        port: its TCP port (the server's leased named port).
        world_size: store users (clients + the server), None for any number.
        timeout_s: how long to wait for the server (a client) and for keys, in seconds.
    Raises:
        OSError: the server cannot bind (host, port).
        torch's DistStoreError: a client found no server in time.
    """
    import torch.distributed as dist

    fd = listening_socket_fd(host, port) if is_master else None
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=wait_for_workers,
        master_listen_fd=fd,
    )
