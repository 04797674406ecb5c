"""Node-wide lease names and owner records: one abstract Unix socket per leased port.

A lease on TCP port P is a listening `AF_UNIX` stream socket bound to the abstract name
`\\0mopd-port-<P>` (man 7 unix, "Abstract sockets"). Abstract names live in the network namespace, not in
the file system: every job and user on the node sees the same names, no shared writable directory is
needed, and the kernel frees the name the moment the last process holding the socket exits (SIGKILL
included). Only one socket can hold a name, so binding it *is* taking the lease.

Owner records are discoverable through the socket itself: a process that takes leases answers every
connection on them with one JSON line (port, name, job_id, role, index, generation, pid, child_pid, uid) and
closes it.
`list_node_leases()` finds the names in `/proc/net/unix` and connects to each. A lease held only by a
process that does not answer (a child that inherited it after its guard died) is listed with
`answered=False`. Records are ephemeral metadata: nothing is written to disk.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Prefix of the abstract socket name of a lease (after the leading NUL byte).
LEASE_NAME_PREFIX = "mopd-port-"
#: Where Linux lists the Unix sockets of this network namespace.
PROC_NET_UNIX = "/proc/net/unix"
#: `/proc/net/unix` Flags bit of a listening socket (__SO_ACCEPTCON).
_SO_ACCEPTCON = 0x10000
#: Backlog of a lease socket: only owner-record queries ever connect.
_LEASE_BACKLOG = 16


def lease_address(port: int) -> str:
    """The abstract socket address of the lease on TCP `port`: `"\\0mopd-port-<port>"`."""
    return f"\0{LEASE_NAME_PREFIX}{port}"


def bind_lease_socket(port: int) -> socket.socket | None:
    """Take the node-wide lease on `port`: bind and listen on its abstract name.

    Returns:
        the listening socket (non-blocking, close-on-exec), or None when another process holds the lease.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(lease_address(port))
    except OSError:
        sock.close()
        return None
    sock.listen(_LEASE_BACKLOG)
    sock.setblocking(False)
    return sock


class OwnerRecordServer:
    """Answers owner-record queries on the lease sockets of this process, from one daemon thread.

    `add(sock, record)` registers a listening lease socket and a callable that returns its record;
    `remove(sock)` unregisters it (call it before closing the socket). Thread-safe.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, sock: socket.socket, record: Callable[[], dict[str, Any]]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("OwnerRecordServer is closed")
            self._selector.register(sock, selectors.EVENT_READ, record)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="mopd-port-owner", daemon=True)
                self._thread.start()

    def remove(self, sock: socket.socket) -> None:
        with self._lock, contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(timeout=1.0)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.data is None:
                    return  # woken by close()
                self._answer(key.fileobj, key.data)  # type: ignore[arg-type]

    @staticmethod
    def _answer(sock: socket.socket, record: Callable[[], dict[str, Any]]) -> None:
        try:
            conn, _ = sock.accept()
        except OSError:
            return  # no pending connection, or the lease was released meanwhile
        with conn:
            conn.settimeout(0.5)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(record(), sort_keys=True).encode() + b"\n")


@dataclass(frozen=True, slots=True)
class NodeLease:
    """A lease seen on this node by `list_node_leases()`.

    `answered` is False when the holder did not answer the owner-record query (then only `port` is known).
    """

    port: int
    answered: bool
    name: str | None = None
    job_id: str | None = None
    role: str | None = None
    index: int | None = None
    pid: int | None = None
    child_pid: int | None = None
    uid: int | None = None
    generation: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


def read_owner_record(port: int, timeout_s: float = 0.5) -> NodeLease | None:
    """Ask the holder of the lease on `port` for its owner record.

    Returns:
        None when nobody holds the lease; a `NodeLease` with `answered=False` when the holder is silent.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(lease_address(port))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        except OSError:
            return NodeLease(port=port, answered=False)
        chunks = []
        try:
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        except OSError:
            return NodeLease(port=port, answered=False)
    finally:
        sock.close()
    try:
        record = json.loads(b"".join(chunks))
    except ValueError:
        return NodeLease(port=port, answered=False)
    keys = ("name", "job_id", "role", "index", "pid", "child_pid", "uid", "generation")
    fields = {k: record.get(k) for k in keys}
    return NodeLease(port=port, answered=True, **fields)


def leased_ports(proc_net_unix_text: str) -> list[int]:
    """Ports whose lease name is bound by a listening socket in a `/proc/net/unix` listing, sorted.

    Args:
        proc_net_unix_text: the text of `/proc/net/unix` (columns Num RefCount Protocol Flags Type St
            Inode Path; abstract names start with `@`).
    """
    ports = set()
    marker = "@" + LEASE_NAME_PREFIX
    for line in proc_net_unix_text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8 or not cols[7].startswith(marker):
            continue
        with contextlib.suppress(ValueError):
            if int(cols[3], 16) & _SO_ACCEPTCON:
                ports.add(int(cols[7][len(marker) :]))
    return sorted(ports)


def list_node_leases(proc_net_unix_text: str | None = None, timeout_s: float = 0.5) -> list[NodeLease]:
    """Every port lease on this node (this network namespace) with its owner record, sorted by port."""
    if proc_net_unix_text is None:
        with open(PROC_NET_UNIX, encoding="utf-8", errors="replace") as f:
            proc_net_unix_text = f.read()
    leases = []
    for port in leased_ports(proc_net_unix_text):
        lease = read_owner_record(port, timeout_s)
        if lease is not None:
            leases.append(lease)
    return leases
