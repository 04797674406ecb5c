"""Leases are owned per (slot, generation): a /kill of generation g racing a /spawn of g+1 of the same slot
releases only g's leases; the new generation keeps its port and its owner record (`mopd-debug ports`).
Through a real `mopd-guard`, a child whose process group outlives it (the race window of the kill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from helpers_wait import until
from test_guard import JOB, RunningGuard, start_guard, stop_guard

from mopd_hpc.runtime.ports import LeasePolicy, PortLeaser, PortOwner, read_ephemeral_range
from mopd_hpc.runtime.ports_registry import read_owner_record


@pytest.fixture
def guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGuard]:
    g = start_guard(tmp_path_factory.mktemp("guard"), kill_wait_s=3.0)
    try:
        yield g
    finally:
        stop_guard(g)


def debug_ports() -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.debug", "ports", "--json"],
        capture_output=True, text=True, timeout=60, check=True, env=dict(os.environ),
    )  # fmt: skip
    return json.loads(proc.stdout)


def test_a_kill_racing_a_spawn_of_the_same_slot_releases_only_its_generation(guard: RunningGuard) -> None:
    first = guard.spawn_test(30, "lingering", ports=["http", "nccl"])
    guard.ready(first)
    killed: dict[str, Any] = {}
    killer = threading.Thread(target=lambda: killed.update(guard.client.kill("testchild", 30, wait_s=3.0)))
    killer.start()  # SIGTERM: the child dies, its grandchild lingers until the SIGKILL 3 s later

    def first_exited() -> bool:
        (child,) = guard.client.status(role="testchild", index=30, generation=1)["children"]
        return child["state"] == "exited"

    assert until(first_exited, 10)
    second = guard.spawn_test(30, "sleep", ports=["http"])  # while the kill of generation 1 still runs
    assert second["generation"] == 2
    guard.ready(second)
    killer.join(timeout=30)
    assert not killer.is_alive() and killed["generation"] == 1
    assert killed["released"] == first["ports"]  # generation 1's leases, both of them
    port = second["ports"]["http"]
    held = [p for p in guard.client.status()["ports"] if p["role"] == "testchild" and p["index"] == 30]
    assert held == [{"role": "testchild", "index": 30, "name": "http", "port": port, "generation": 2}]
    record = read_owner_record(port)
    assert record is not None and record.answered, record
    assert (record.job_id, record.role, record.index, record.child_pid) == (
        JOB,
        "testchild",
        30,
        second["pid"],
    )
    (listed,) = [x for x in debug_ports() if x["port"] == port]
    assert listed["answered"] and (listed["role"], listed["index"], listed["child_pid"]) == (
        "testchild", 30, second["pid"],
    )  # fmt: skip
    # generation 1's other ports carry no record of it (another process of the node may have leased one since)
    others = [read_owner_record(p) for p in first["ports"].values() if p != port]
    assert all(r is None or r.child_pid != first["pid"] for r in others), others


def test_leaser_generations_adopt_reservations_and_release_only_up_to_their_own() -> None:
    with PortLeaser(LeasePolicy.create(read_ephemeral_range())) as leaser:
        owner = PortOwner.create(JOB, "rollout", 0)
        ahead = leaser.reserve(owner, ["http"])["http"]  # /ports/reserve before the first spawn
        g1 = leaser.reserve(owner, ["http", "nccl"], generation=1)
        assert g1["http"].port == ahead.port and g1["http"].generation == 1  # adopted, same port
        g2 = leaser.reserve(owner, ["http"], generation=2)  # generation 1's kill has not finished yet
        assert g2["http"].port not in {g1["http"].port, g1["nccl"].port}  # never shared with generation 1
        assert sorted(x.port for x in leaser.release(owner, up_to_generation=1)) == sorted(
            x.port for x in g1.values()
        )
        assert leaser.leases(owner) == [g2["http"]]
        assert read_owner_record(g2["http"].port).generation == 2  # type: ignore[union-attr]
        assert read_owner_record(g1["http"].port) is None
        assert leaser.release(owner) == [g2["http"]] and leaser.release(owner) == []  # idempotent
