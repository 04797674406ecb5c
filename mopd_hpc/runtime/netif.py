"""Network interfaces and addresses of this node, for binding collectives to the address the job uses.

`local_address_towards(host, port)` is the IPv4 address the kernel routes to (host, port) through (a UDP
connect sends no packet). `interface_of(address)` is the name of the interface that carries an IPv4
address (SIOCGIFADDR on each interface of `socket.if_nameindex()`): gloo is told where to bind only by
interface name (GLOO_SOCKET_IFNAME), never by address, and its default (the address the host name
resolves to) is wrong on nodes whose /etc/hosts maps their name to 127.0.1.1.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

#: ioctl number of SIOCGIFADDR (linux/sockios.h).
SIOCGIFADDR = 0x8915
#: The variable gloo reads for the interface to bind.
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

log = logging.getLogger("mopd_hpc.runtime")


class NetworkInterfaceError(OSError):
    """No interface of this node carries the address (named, with the addresses the interfaces have)."""


def local_address_towards(host: str, port: int) -> str:
    """The local IPv4 address the kernel routes to (host, port) through."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def interface_addresses() -> dict[str, str]:
    """Interface name → its IPv4 address, for the interfaces that have one."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def interface_of(address: str) -> str:
    """The name of the interface that carries IPv4 `address` (loopback: "lo").

    Raises:
        NetworkInterfaceError: no interface has it.
    """
    addresses = interface_addresses()
    for name, addr in addresses.items():
        if addr == address:
            return name
    raise NetworkInterfaceError(
        f"no network interface of {socket.gethostname()} carries {address} (interfaces: "
        f"{', '.join(f'{n}={a}' for n, a in sorted(addresses.items())) or 'none'}); expected the address "
        "this node is reached at"
    )


def bind_gloo_to(address: str) -> str:
    """Have gloo bind the interface carrying `address` (GLOO_SOCKET_IFNAME in this process's environment,
    which gloo reads itself), unless the user set another; returns the interface gloo will use.

    Raises:
        NetworkInterfaceError: no interface carries `address`.
    """
    name = interface_of(address)
    chosen = os.environ.get(GLOO_IFNAME_ENV)
    if chosen and chosen != name:
        log.warning(
            "%s=%s set by the user: kept (the job's address %s is on %s)",
            GLOO_IFNAME_ENV,
            chosen,
            address,
            name,
        )
        return chosen
    os.environ[GLOO_IFNAME_ENV] = name  # the edge: gloo reads it from the process environment itself
    return name
