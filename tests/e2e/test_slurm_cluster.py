"""The real local Slurm cluster of tools/slurm_local: nodes, a two-component het job, sacct, per-node network
namespaces and submitit, asserted from inside the jobs. Needs root (the session fixture skips otherwise)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import submitit

pytestmark = pytest.mark.slurm

EXPECTED_NODES = ("n1", "n2", "n3", "n4")
IDLE_WAIT_S = 60
SACCT_WAIT_S = 30
JOB_TIMEOUT_S = 120
# Outside the ephemeral range (32768-60999); each node has its own network namespace, so all may bind it at once.
SHARED_PORT = 29517


def _require_netns(cluster) -> None:
    if cluster.mode != "netns":
        pytest.skip(
            f"needs the network-namespace mode of tools/slurm_local (the default); the running cluster is in "
            f"{cluster.mode!r} mode, where all nodes share one hostname and 127.0.0.1"
        )


def _wait_idle(cluster) -> list[tuple[str, str]]:
    """Wait until every node is idle (jobs of earlier tests may still be completing); return (node, state)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        out = cluster.run(["sinfo", "-h", "-N", "-p", cluster.partition, "-o", "%N %T %G"]).stdout
        rows = [tuple(line.split()) for line in out.splitlines() if line.strip()]
        if all(row[1] == "idle" for row in rows) or time.monotonic() > deadline:
            return sorted(rows)
        time.sleep(0.5)


def _read_env0(path: Path) -> dict[str, str]:
    """Parse an ``env -0`` dump (NUL-separated KEY=VALUE records)."""
    records = path.read_bytes().decode().split("\0")
    return dict(record.split("=", 1) for record in records if "=" in record)


def test_sinfo_shows_four_idle_nodes_with_two_gpus(slurm_cluster) -> None:
    rows = _wait_idle(slurm_cluster)
    assert [row[0] for row in rows] == list(EXPECTED_NODES)
    assert {row[1] for row in rows} == {"idle"}
    assert {row[2] for row in rows} == {"gpu:2"}
    assert slurm_cluster.nodes == EXPECTED_NODES
    assert slurm_cluster.partition == "debug"
    assert slurm_cluster.gpus_per_node == 2
    if slurm_cluster.mode == "netns":
        assert dict(slurm_cluster.node_addrs) == {f"n{i}": f"10.200.0.{10 + i}" for i in range(1, 5)}
    else:
        assert slurm_cluster.mode == "loopback"
        assert set(slurm_cluster.node_addrs.values()) == {"127.0.0.1"}


HET_SCRIPT = """#!/bin/bash
#SBATCH --job-name=mopd-het-test
#SBATCH --output={out}/batch-%j.out
#SBATCH --time=2
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:1
set -euo pipefail
OUT={out}
env -0 > "$OUT/batch.env0"
srun --het-group=0 bash -c 'TEST_HOSTNAME=$(hostname) env -0 > "$1/g0-$SLURM_PROCID.env0"' _ "$OUT" &
srun --het-group=1 bash -c 'TEST_HOSTNAME=$(hostname) env -0 > "$1/g1-$SLURM_PROCID.env0"' _ "$OUT" &
wait
"""


@dataclass(frozen=True, slots=True)
class HetRun:
    job_id: int
    out: Path
    group0: tuple[dict[str, str], ...]
    group1: tuple[dict[str, str], ...]
    batch: dict[str, str]


@pytest.fixture(scope="module")
def het_run(slurm_cluster, tmp_path_factory) -> HetRun:
    """Submit the two-component het job once (``sbatch --wait``) and collect what each task wrote."""
    _wait_idle(slurm_cluster)
    out = tmp_path_factory.mktemp("het")
    script = out / "het.sbatch"
    script.write_text(HET_SCRIPT.format(out=shlex.quote(str(out))))
    proc = slurm_cluster.run(["sbatch", "--parsable", "--wait", str(script)], timeout_s=JOB_TIMEOUT_S)
    job_id = int(proc.stdout.strip().split(";")[0])
    batch_log = next(out.glob("batch-*.out"), None)
    assert batch_log is not None and batch_log.read_text() == "", f"batch output: {batch_log}"
    return HetRun(
        job_id=job_id,
        out=out,
        group0=tuple(_read_env0(p) for p in sorted(out.glob("g0-*.env0"))),
        group1=tuple(_read_env0(p) for p in sorted(out.glob("g1-*.env0"))),
        batch=_read_env0(out / "batch.env0"),
    )


def test_het_job_component_nodes_seen_from_inside(het_run: HetRun, slurm_cluster) -> None:
    assert len(het_run.group0) == 1
    assert len(het_run.group1) == 2
    (task0,) = het_run.group0
    assert task0["SLURMD_NODENAME"] == "n1"
    assert task0["SLURM_STEP_NODELIST"] == "n1"
    group1_nodes = sorted(task["SLURMD_NODENAME"] for task in het_run.group1)
    assert len(set(group1_nodes)) == 2
    assert "n1" not in group1_nodes and set(group1_nodes) <= set(EXPECTED_NODES)
    for env in (task0, *het_run.group1, het_run.batch):
        assert env["SLURM_JOB_ID"] == str(het_run.job_id)
        assert env["SLURM_HET_SIZE"] == "2"
        assert env["SLURM_JOB_NODELIST_HET_GROUP_0"] == "n1"
    hostlist = het_run.batch["SLURM_JOB_NODELIST_HET_GROUP_1"]
    expanded = slurm_cluster.run(["scontrol", "show", "hostnames", hostlist]).stdout.split()
    assert expanded == group1_nodes
    assert sorted(task["SLURM_PROCID"] for task in het_run.group1) == ["0", "1"]
    assert het_run.batch["SLURM_JOB_ID_HET_GROUP_1"] == str(het_run.job_id + 1)


def test_het_job_gpus_per_node(het_run: HetRun) -> None:
    for task in het_run.group1:
        assert task["CUDA_VISIBLE_DEVICES"] == "0"
        assert task["SLURM_GPUS_ON_NODE"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in het_run.group0[0]


def test_het_job_hostnames_differ_per_node(het_run: HetRun, slurm_cluster) -> None:
    _require_netns(slurm_cluster)
    tasks = (*het_run.group0, *het_run.group1)
    # Network-namespace mode: each node has its own UTS namespace, so hostname == the Slurm node name.
    assert [task["TEST_HOSTNAME"] for task in tasks] == [task["SLURMD_NODENAME"] for task in tasks]
    assert len({task["TEST_HOSTNAME"] for task in tasks}) == 3


def test_sacct_reports_het_components_completed(het_run: HetRun, slurm_cluster) -> None:
    job = het_run.job_id
    want = {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}
    deadline = time.monotonic() + SACCT_WAIT_S
    while True:  # slurmctld sends the end records to slurmdbd asynchronously
        out = slurm_cluster.run(
            ["sacct", "-j", str(job), "-X", "-n", "-P", "-o", "JobID,State,NodeList"]
        ).stdout
        rows = {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines() if line}
        if {key: value[0] for key, value in rows.items()} == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {key: value[0] for key, value in rows.items()} == want
    assert rows[f"{job}+0"][1] == "n1"
    group1_nodes = sorted(task["SLURMD_NODENAME"] for task in het_run.group1)
    expanded = slurm_cluster.run(["scontrol", "show", "hostnames", rows[f"{job}+1"][1]]).stdout.split()
    assert expanded == group1_nodes


BIND_SCRIPT = """
import os, socket, sys, time
port, barrier, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sock = socket.socket()
sock.bind(("0.0.0.0", port))
sock.listen()
open(os.path.join(barrier, socket.gethostname()), "w").close()
deadline = time.monotonic() + 30
while len(os.listdir(barrier)) < n and time.monotonic() < deadline:
    time.sleep(0.05)
print(socket.gethostname(), "held", len(os.listdir(barrier)), flush=True)
"""


def test_every_node_binds_the_same_port_at_once(slurm_cluster, tmp_path: Path) -> None:
    _require_netns(slurm_cluster)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    n = len(slurm_cluster.nodes)
    proc = slurm_cluster.run(
        [
            "srun",
            "-N",
            str(n),
            "-n",
            str(n),
            "--ntasks-per-node=1",
            "-t",
            "1",
            sys.executable,
            "-c",
            BIND_SCRIPT,
        ]
        + [str(SHARED_PORT), str(barrier), str(n)],
        timeout_s=JOB_TIMEOUT_S,
    )
    # Each task binds, then waits until all have bound: all n held the port at the same time.
    assert sorted(proc.stdout.split("\n")[:-1]) == [f"{node} held {n}" for node in slurm_cluster.nodes]
    assert sorted(os.listdir(barrier)) == list(slurm_cluster.nodes)


TCP_SCRIPT = """
import os, socket, sys, time
port, ready = int(sys.argv[1]), sys.argv[2]
if os.environ["SLURM_PROCID"] == "0":
    srv = socket.create_server(("0.0.0.0", port))
    open(ready + ".tmp", "w").write(socket.gethostname())
    os.replace(ready + ".tmp", ready)  # whole or absent: the client never reads an empty name
    conn, peer = srv.accept()
    conn.sendall(socket.gethostname().encode())
    print("server", socket.gethostname(), "peer", peer[0], flush=True)
else:
    deadline = time.monotonic() + 30
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    server = open(ready).read()
    with socket.create_connection((server, port), timeout=10) as conn:
        print("client", socket.gethostname(), "got", conn.recv(64).decode(), flush=True)
"""


def test_cross_node_tcp_goes_over_the_bridge(slurm_cluster, tmp_path: Path) -> None:
    _require_netns(slurm_cluster)
    ready = tmp_path / "ready"
    proc = slurm_cluster.run(
        ["srun", "-w", "n2,n3", "-N", "2", "-n", "2", "--ntasks-per-node=1", "-t", "1", sys.executable, "-c"]
        + [TCP_SCRIPT, str(SHARED_PORT + 1), str(ready)],
        timeout_s=JOB_TIMEOUT_S,
    )
    lines = sorted(proc.stdout.splitlines())
    # The client on n3 reached n2 by name; n2 saw n3's own address, not 127.0.0.1.
    assert lines == ["client n3 got n2", f"server n2 peer {slurm_cluster.node_addrs['n3']}"]


NO_ROUTE_SCRIPT = """
import errno, socket
sock = socket.socket()
sock.settimeout(5)
try:
    sock.connect(("198.51.100.1", 80))
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc.errno))
else:
    print("connected")
"""


def test_nodes_reach_only_the_bridge_subnet(slurm_cluster) -> None:
    _require_netns(slurm_cluster)
    # No default route and no NAT out of the node namespaces: an outside address is unreachable at once.
    proc = slurm_cluster.run(
        ["srun", "-w", "n4", "-N", "1", "-n", "1", "-t", "1", sys.executable, "-c", NO_ROUTE_SCRIPT],
        timeout_s=JOB_TIMEOUT_S,
    )
    assert proc.stdout.split() == ["ENETUNREACH"]


def test_submitit_slurm_executor_returns_result(slurm_cluster, tmp_path: Path) -> None:
    def multiply_on_node(x: int, y: int) -> tuple[int, str, str, str | None]:
        import os
        import socket

        return (
            x * y,
            os.environ["SLURMD_NODENAME"],
            socket.gethostname(),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    executor = submitit.SlurmExecutor(folder=tmp_path / "submitit", max_num_timeout=0)
    executor.update_parameters(time=2, partition=slurm_cluster.partition, mem="500M", gres="gpu:1")
    job = executor.submit(multiply_on_node, 6, 7)
    product, node, hostname, cuda = job.result()
    assert product == 42
    assert node in slurm_cluster.nodes
    if slurm_cluster.mode == "netns":
        assert hostname == node
    assert cuda == "0"
    # job.state does not refresh by itself; force sacct reads until the end record reaches slurmdbd.
    deadline = time.monotonic() + SACCT_WAIT_S
    while (state := job.get_info(mode="force").get("State")) != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert state == "COMPLETED"


def test_weird_tmp_path_survives_sbatch(slurm_cluster, weird_tmp_path: Path) -> None:
    assert " " in weird_tmp_path.name and "'" in weird_tmp_path.name and "; echo x" in weird_tmp_path.name
    proc = slurm_cluster.run(
        ["sbatch", "--parsable", "--wait", f"--chdir={weird_tmp_path}", "--output=out-%j.txt", "-t", "1"]
        + ["--wrap", "pwd; hostname"],
        timeout_s=JOB_TIMEOUT_S,
    )
    job_id = proc.stdout.strip().split(";")[0]
    lines = (weird_tmp_path / f"out-{job_id}.txt").read_text().splitlines()
    assert lines[0] == str(weird_tmp_path)
    assert lines[1] in slurm_cluster.nodes or slurm_cluster.mode != "netns"
    assert sorted(os.listdir(weird_tmp_path)) == [f"out-{job_id}.txt"]
