"""Node-wide port leases with real processes and real sockets (DESIGN.md §4, Port leases)."""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from mopd_hpc.cli import debug_ports
from mopd_hpc.runtime.ports import (
    LeasePolicy,
    PortInUseError,
    PortLeaseError,
    PortLeaser,
    PortOwner,
    PortsExhaustedError,
    read_ephemeral_range,
    tcp_port_free,
)
from mopd_hpc.runtime.ports_registry import (
    bind_lease_socket,
    leased_ports,
    list_node_leases,
    read_owner_record,
)

EPHEMERAL = read_ephemeral_range()

#: A process that takes leases, prints them as JSON, and holds them until its stdin closes.
HOLDER = textwrap.dedent(
    """
    import json, sys
    from mopd_hpc.runtime.ports import LeasePolicy, PortLeaser, PortOwner, read_ephemeral_range
    job, owners, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    leaser = PortLeaser(LeasePolicy.create(read_ephemeral_range()))
    print("ready", flush=True)
    sys.stdin.readline()  # "go": every holder starts at once
    ports = [lease.port for i in range(owners)
             for lease in leaser.reserve(PortOwner.create(job, "worker", i), names).values()]
    print(json.dumps(ports), flush=True)
    sys.stdin.readline()
    """
)


def start_holders(count: int, owners: int, names: str) -> list[subprocess.Popen[str]]:
    procs = []
    for k in range(count):
        argv = [sys.executable, "-c", HOLDER, f"job{k}", str(owners), names]
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def go(procs: list[subprocess.Popen[str]]) -> list[list[int]]:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def leaser() -> Iterator[PortLeaser]:
    with PortLeaser(LeasePolicy.create(EPHEMERAL)) as lz:
        yield lz


def lease_free(port: int) -> bool:
    sock = bind_lease_socket(port)
    if sock is None:
        return False
    sock.close()
    return True


def released_by(port: int, job_id: str) -> bool:
    """Whether no lease of `job_id` holds `port`: its lease socket binds, or its holder now is not that job (another
    pytest-xdist worker's job, or a child that holds another test's lease and answers nothing)."""
    if lease_free(port):
        return True
    record = read_owner_record(port)
    return record is None or record.job_id != job_id


def free_window(size: int) -> int:
    """First of `size` consecutive ports outside the ephemeral range with no lease, no bind, no TIME_WAIT."""
    policy = LeasePolicy.create(EPHEMERAL)
    for start in range(40000 if EPHEMERAL[0] > 45000 else 61000, 65535 - size, size):
        ports = range(start, start + size)
        if all(policy.allowed(p) and lease_free(p) and tcp_port_free(p) for p in ports):
            return start
    raise AssertionError("no free window")


def test_named_ports_are_distinct_allowed_and_idempotent_per_owner(leaser: PortLeaser) -> None:
    owner = PortOwner.create(f"{os.getpid()}+1", "rollout", 0)  # this worker's own job id: `released_by`
    got = leaser.reserve(owner, ("http", "nccl", "dist_init", "master"))
    assert list(got) == ["http", "nccl", "dist_init", "master"]
    ports = [x.port for x in got.values()]
    assert len(set(ports)) == 4 and all(leaser.policy.allowed(p) for p in ports)
    assert all(not (EPHEMERAL[0] <= p <= EPHEMERAL[1]) for p in ports)
    assert got["dist_init"].env_key == "MOPD_PORT_DIST_INIT"
    again = leaser.reserve(owner, ["nccl", "http", "extra"])
    assert (again["nccl"], again["http"]) == (got["nccl"], got["http"]) and again["extra"].port not in ports
    assert leaser.reserve_port(owner, "http", got["http"].port) == got["http"]
    with pytest.raises(PortInUseError, match="already holds 'http'"):
        leaser.reserve_port(owner, "http", got["nccl"].port)
    assert sorted(x.name for x in leaser.release(owner)) == ["dist_init", "extra", "http", "master", "nccl"]
    assert leaser.release(owner) == [] and leaser.leases(owner) == []
    assert all(released_by(p, owner.job_id) for p in ports)


def test_64_processes_times_100_reservations_at_once_give_no_duplicate(tmp_path: object) -> None:
    procs = start_holders(64, 50, "http,nccl")
    try:
        results = go(procs)
        ports = [p for r in results for p in r]
        assert [len(r) for r in results] == [100] * 64
        assert len(ports) == 6400 and len(set(ports)) == 6400
        policy = LeasePolicy.create(EPHEMERAL)
        assert all(policy.allowed(p) for p in ports)
    finally:
        stop(procs)


def test_a_holder_killed_with_sigkill_frees_its_ports_at_once(leaser: PortLeaser) -> None:
    procs = start_holders(1, 3, "http")
    try:
        ports = go(procs)[0]
        owner = PortOwner.create("other", "actor", 0)
        for port in ports:
            with pytest.raises(PortInUseError):
                leaser.reserve_port(owner, "p", port)
        seen = {x.port: x for x in list_node_leases()}
        assert [(seen[p].job_id, seen[p].role, seen[p].pid) for p in ports] == [
            ("job0", "worker", procs[0].pid)
        ] * 3
        procs[0].kill()
        procs[0].wait()
        taken = [
            leaser.reserve_port(PortOwner.create("other", "actor", i), "p", p) for i, p in enumerate(ports)
        ]
        assert [x.port for x in taken] == ports
    finally:
        stop(procs)


def test_a_port_bound_by_a_foreign_process_is_never_handed_out() -> None:
    # The window is free when chosen; a job of another test worker may lease or bind in it before the foreign
    # process binds (the lease range is node-wide): then the foreign bind fails, or the first reservation finds
    # fewer than its two free ports, and the check is repeated on a fresh window.
    for attempt in range(5):
        if _foreign_bound_ports_are_skipped(free_window(4), last=attempt == 4):
            return


def _foreign_bound_ports_are_skipped(start: int, last: bool) -> bool:
    """True when the checks ran on the window at `start`; False when another process took one of its ports."""
    foreign_code = textwrap.dedent(
        f"""
        import socket, sys
        a = socket.socket(); a.bind(("0.0.0.0", {start})); a.listen()
        b = socket.socket(); b.bind(("127.0.0.1", {start + 1}))
        print("bound", flush=True); sys.stdin.readline()
        """
    )
    foreign = subprocess.Popen(
        [sys.executable, "-c", foreign_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert foreign.stdout is not None
        if foreign.stdout.readline().strip() != b"bound":  # the foreign bind failed: the port was taken
            assert not last, f"ports {start}, {start + 1} were taken on every attempt"
            return False
        policy = LeasePolicy.create(EPHEMERAL, lo=start, hi=start + 3)
        with PortLeaser(policy, seed=start) as lz:
            try:
                got = lz.reserve(PortOwner.create("j", "actor", 0), ["http", "nccl"])
            except PortsExhaustedError:
                if last:
                    raise
                return False
            assert sorted(x.port for x in got.values()) == [start + 2, start + 3]
            with pytest.raises(PortsExhaustedError, match="no free port"):
                lz.reserve(PortOwner.create("j", "actor", 1), ["http"])
            for port in (start, start + 1):
                with pytest.raises(PortInUseError):
                    lz.reserve_port(PortOwner.create("j", "actor", 2), "http", port)
        assert lease_free(start) and lease_free(start + 1)  # a failed bind check drops the lease again
        return True
    finally:
        foreign.kill()
        foreign.wait()


def test_a_lease_handed_to_a_child_is_held_while_the_child_lives(leaser: PortLeaser) -> None:
    # a job id of this worker's own: once the child lets the port go, another pytest-xdist worker's job may lease it
    # at once (a guard's leaser takes the lowest free port), hence `released_by`
    owner = PortOwner.create(f"j-{os.getpid()}", "rollout", 3)
    lease = leaser.reserve(owner, ["nccl"])["nccl"]
    leaser.note_child(owner, 4242)
    assert read_owner_record(lease.port).child_pid == 4242  # type: ignore[union-attr]
    code = "import sys; sys.stdin.readline()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=[lease.fd])
    try:
        leaser.release(owner)
        assert not lease_free(lease.port)  # the child's copy holds it
        silent = read_owner_record(lease.port, timeout_s=0.2)
        assert silent is not None and (silent.port, silent.answered) == (lease.port, False)
    finally:
        child.communicate(b"\n", timeout=30)
    assert released_by(lease.port, owner.job_id)


def test_policy_cuts_out_the_ephemeral_range_and_validates() -> None:
    policy = LeasePolicy.create((30000, 60000), lo=29998, hi=60002)
    assert policy.size == 4 and list(policy.candidates(60001)) == [60001, 60002, 29998, 29999]
    with pytest.raises(PortLeaseError, match="inside the ephemeral range"):
        LeasePolicy.create((30000, 60000), lo=30000, hi=60000)
    with pytest.raises(PortLeaseError, match="lo=5, hi=4"):
        LeasePolicy.create((30000, 60000), lo=5, hi=4)
    with PortLeaser(policy) as lz, pytest.raises(PortLeaseError, match="ephemeral"):
        lz.reserve_port(PortOwner.create("j", "a", 0), "http", 45000)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda lz: lz.reserve(PortOwner.create("j", "a", 0), ["HTTP"]), "'HTTP'"),
        (lambda lz: lz.reserve(PortOwner.create("j", "a", 0), ["http", "http"]), "repeat"),
        (lambda lz: lz.reserve(PortOwner.create("j", "a", 0), [7]), "7"),
        (lambda lz: PortOwner.create("", "a", 0), "job_id=''"),
        (lambda lz: PortOwner.create("j", "Actor", 0), "role='Actor'"),
        (lambda lz: PortOwner.create("j", "a", -1), "index=-1"),
        (lambda lz: PortOwner.create("j", "a", True), "index=True"),
    ],
)
def test_malformed_requests_name_the_field(leaser: PortLeaser, call: object, needle: str) -> None:
    with pytest.raises(PortLeaseError) as info:
        call(leaser)  # type: ignore[operator]
    assert needle in str(info.value)


def test_debug_ports_lists_leases_with_owners(leaser: PortLeaser) -> None:
    got = leaser.reserve(PortOwner.create("777", "teacher", 2), ["master"])["master"]
    out = io.StringIO()
    assert debug_ports.run(argparse.Namespace(json=True, timeout_s=0.5), out=out) == 0
    rows = {r["port"]: r for r in json.loads(out.getvalue())}
    assert {k: rows[got.port][k] for k in ("name", "job_id", "role", "index", "pid", "answered")} == {
        "name": "master",
        "job_id": "777",
        "role": "teacher",
        "index": 2,
        "pid": got.pid,
        "answered": True,
    }
    table = io.StringIO()
    debug_ports.run(argparse.Namespace(json=False, timeout_s=0.5), out=table)
    line = next(x for x in table.getvalue().splitlines() if x.startswith(str(got.port)))
    assert line.split()[:5] == [str(got.port), "master", "777", "teacher", "2"]
    cli = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.debug", "ports", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0 and got.port in {r["port"] for r in json.loads(cli.stdout)}


def test_leased_ports_reads_only_listening_lease_names_from_proc_net_unix() -> None:
    recorded = textwrap.dedent(
        """\
        Num       RefCount Protocol Flags    Type St Inode Path
        0000000000000000: 00000002 00000000 00010000 0001 01 41001 @mopd-port-24433
        0000000000000000: 00000003 00000000 00000000 0001 03 41009 @mopd-port-24433
        0000000000000000: 00000002 00000000 00010000 0001 01 41002 @mopd-port-61000
        0000000000000000: 00000002 00000000 00010000 0001 01 41003 /run/mysqld/mysqld.sock
        0000000000000000: 00000002 00000000 00010000 0001 01 41004 @other-port-1
        0000000000000000: 00000003 00000000 00000000 0001 03 41005
        """
    )
    assert leased_ports(recorded) == [24433, 61000]


def test_tcp_bind_check_matches_a_real_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not tcp_port_free(port) and not tcp_port_free(port, "127.0.0.1")
    assert tcp_port_free(port)


def test_the_tests_free_ports_are_leased_outside_the_ephemeral_range_and_bindable() -> None:
    """tests/helpers_ports.py: distinct ports, none ephemeral, each leased node-wide by this process (another
    process, as another pytest-xdist worker, cannot lease it; its owner record names the test) and free to
    bind on TCP."""
    from helpers_ports import free_port, free_ports

    ports = [*free_ports(3), free_port()]
    assert len(set(ports)) == 4
    assert not any(EPHEMERAL[0] <= p <= EPHEMERAL[1] for p in ports)
    taken = subprocess.run(
        [sys.executable, "-c", "import sys; from mopd_hpc.runtime.ports_registry import bind_lease_socket; "
         "print([bind_lease_socket(int(p)) is None for p in sys.argv[1:]])", *map(str, ports)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert taken.stdout.split() == ["[True,", "True,", "True,", "True]"]
    record = read_owner_record(ports[0])
    assert record is not None and (record.job_id, record.role, record.pid) == ("pytest", "test", os.getpid())
    assert all(tcp_port_free(p, "127.0.0.1") for p in ports)
