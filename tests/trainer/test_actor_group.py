"""The actor group's step protocol on a real 2-process gloo world (tests/trainer/actor_group_prog.py): rendezvous
through the run directory, the start/step/stop records through rank 0's store, each rank's own shard (its
rows asked of the teachers by itself, nothing else; at TP 2 by TP rank 0 alone, which broadcasts the scores),
the drain receipts gathered at rank 0, the gradient
all-reduce giving the DP = 1 parameters, the ratio statistics summed over the ranks; a follower outlives a
rank 0 busier than the collective timeout; a dead rank ends its peer's wait at once with PeerLostError."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import actor_group_prog as prog
import helpers_fork
import pytest
from helpers_ports import free_port

from mopd_hpc.trainer.rendezvous import RendezvousFile
from mopd_hpc.trainer.shards import shard_rows

HERE = Path(__file__).resolve().parent


def run_world(
    tmp_path: Path,
    scenario: str,
    timeout_s: float = 20.0,
    busy_s: float = 0.0,
    kill_after_s: float = 0.0,
    world: int = 2,
) -> list[dict]:
    """Every rank as a subprocess; with kill_after_s, SIGKILL what is left that long after rank 0 or rank 1
    wrote its result (a hung or frozen peer)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE)])}
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs = []
    for rank in reversed(range(world)):  # the followers first: they wait for the rendezvous record
        argv = [
            str(HERE / "actor_group_prog.py"),
            scenario,
            "--rank",
            str(rank),
            "--world",
            str(world),
        ]
        argv += ["--run-dir", str(tmp_path), "--port", str(port), "--timeout-s", str(timeout_s)]
        argv += ["--busy-s", str(busy_s)]
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
        procs.append(helpers_fork.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    if kill_after_s:
        assert wait_for_any(tmp_path, 120)
        time.sleep(kill_after_s)
        for proc in procs:
            proc.kill()
    for proc in procs:
        proc.wait(timeout=120)
    out = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "missing": True})
    return out


def wait_for_any(tmp_path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not any((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_two_ranks_train_their_own_shards_and_match_dp1(tmp_path):
    r0, r1 = run_world(tmp_path, "steps")
    assert "error" not in r0 and "error" not in r1, (r0, r1, (tmp_path / "rank0.log").read_text()[-3000:])
    ref = prog.reference()
    assert r1["outcome"] == ["finished", 3] and r1["steps"] == [1, 2, 3]
    for step in range(1, 4):
        record = prog.step_record(step)
        shards = shard_rows(record.response_lengths, 2)
        for rank, result in ((0, r0), (1, r1)):
            lo, hi = shards[rank].start, shards[rank].stop
            trained = [
                row[: len(record.rows[b])]
                for b, row in zip(range(lo, hi), result["trained"][step - 1], strict=True)
            ]
            assert trained == [list(r) for r in record.rows[lo:hi]]  # exactly its own rows
        assert r0["receipts"][step - 1] == [[0, step, shards[0].rows], [1, step, shards[1].rows]]
    # each rank asked the teacher for its own rows only, and together for every row once
    every = [list(r) for s in range(1, 4) for r in prog.step_record(s).rows]
    assert sorted(r0["asked"] + r1["asked"]) == sorted(every)
    assert not set(map(tuple, r0["asked"])) & set(map(tuple, r1["asked"]))
    # the gradient all-reduce over the global token count: the DP = 1 parameters, on both ranks
    assert r0["w"] == pytest.approx(ref["w"], rel=1e-12, abs=1e-14) and r1["w"] == r0["w"]
    for got, want in zip(r0["stats"], ref["stats"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
        for key in ("mopd/rho_mean", "mopd/ratio_capped_frac", "mopd/teacher_student_gap"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    assert not RendezvousFile.actor(tmp_path).path.exists()  # rank 0 removed its record at the end


def test_a_follower_waits_out_a_rank0_busier_than_the_collective_timeout(tmp_path):
    r0, r1 = run_world(tmp_path, "busy", timeout_s=3.0, busy_s=8.0)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r1["outcome"] == ["finished", 3]


def test_a_killed_follower_ends_rank0s_collective_at_once(tmp_path):
    t0 = time.monotonic()
    r0, r1 = run_world(tmp_path, "rank1_dies", timeout_s=60.0)
    assert r1.get("missing")  # SIGKILL: it wrote nothing
    assert r0["error"].startswith("PeerLostError: actor rank 0: the drain gather of step 2 failed")
    assert time.monotonic() - t0 < 45  # long before the 60 s collective timeout


def test_a_dead_rank0_ends_the_followers_wait(tmp_path):
    r0, r1 = run_world(tmp_path, "rank0_dies", timeout_s=60.0)
    assert r0.get("missing")
    assert r1["error"].startswith("PeerLostError: actor rank 1: rank 0's store is unreachable")
    assert r1["error_after_s"] < 40


def test_a_hung_follower_ends_rank0s_collective_after_the_timeout(tmp_path):
    r0, _ = run_world(tmp_path, "rank1_hangs", timeout_s=4.0, kill_after_s=0.5)
    assert r0["error"].startswith("PeerLostError: actor rank 0: the drain gather of step 2 failed")
    assert "Timed out" in r0["error"] or "timed out" in r0["error"]


def test_a_frozen_rank0_ends_the_followers_wait_after_the_timeout(tmp_path):
    # SIGSTOP freezes rank 0's store with it: the store call, bounded by the timeout, gives up
    _, r1 = run_world(tmp_path, "rank0_freezes", timeout_s=4.0, kill_after_s=0.5)
    assert r1["error"].startswith("PeerLostError: actor rank 1: rank 0's store did not answer for 4 s")
    assert r1["error"].endswith("rank 0 is frozen")


def test_a_tp_group_joins_rank0s_weight_gathers_and_counts_once(tmp_path):
    """TP 2 × DP 1: both ranks train every row (the DP = 1 parameters on both); only TP rank 0 asks the
    teacher, once a step, and broadcasts the scores: both ranks train on batches equal bit for bit to the
    TP 1 run's; after each step rank 0's `weights` record makes the follower join its gather, which gives
    the whole parameter; a sum over the data-parallel ranks counts the TP group once."""
    r0, r1 = run_world(tmp_path, "tp2")
    assert "error" not in r0 and "error" not in r1, (r0, r1, (tmp_path / "rank0.log").read_text()[-3000:])
    ref = prog.reference()
    assert r1["outcome"] == ["finished", 3] and r1["steps"] == [1, 2, 3] and r1["joined"] == 3
    # one request per replica per step, from TP rank 0, holding the step's rows; none from TP rank 1
    assert r0["requests"] == [5, 5, 5] and r1["requests"] == [] and r1["asked"] == []
    assert r0["asked"] == [list(r) for s in range(1, 4) for r in prog.step_record(s).rows]
    # TP rank 1's batches (its scores broadcast from TP rank 0) = TP rank 0's = the TP 1 run's, bit for bit
    assert len(ref["batches"]) == 3 and r0["batches"] == ref["batches"] and r1["batches"] == ref["batches"]
    assert r0["w"] == pytest.approx(ref["w"], rel=1e-12, abs=1e-14) and r1["w"] == r0["w"]
    assert r0["gathered"][-1] == r0["w"]  # the two halves, gathered: the whole parameter
    assert len(r0["gathered"]) == 3
    assert r0["dp_sum"] == r1["dp_sum"] == [1.0]


def test_an_expert_parallel_follower_joins_rank0s_weight_gathers(tmp_path):
    """DP 2 at expert parallel 2: each rank trains its own rows (the DP = 1 parameters on both), and after each
    step rank 0's `weights` record makes the follower of its EP group (`in_rank0_expert_group`) join the
    gather of every rank's experts, which gives the whole parameter."""
    r0, r1 = run_world(tmp_path, "ep2")
    assert "error" not in r0 and "error" not in r1, (r0, r1, (tmp_path / "rank0.log").read_text()[-3000:])
    assert r1["outcome"] == ["finished", 3] and r1["steps"] == [1, 2, 3] and r1["joined"] == 3
    assert r0["w"] == pytest.approx(prog.reference()["w"], rel=1e-12, abs=1e-14) and r1["w"] == r0["w"]
    assert len(r0["gathered"]) == 3 and r0["gathered"][-1] == r0["w"]


@pytest.mark.gpu
def test_tp2_on_nccl_broadcasts_the_scores_through_the_gpus(tmp_path):
    """TP 2 × DP 1 on two GPUs (NCCL world and TP group; gloo control group): TP rank 0 alone asks the
    teacher, and TP rank 1's batches, received through the devices, equal the TP 1 run's bit for bit."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (NCCL refuses two ranks on one GPU)")
    r0, r1 = run_world(tmp_path, "tp2_nccl", timeout_s=120.0)
    assert "error" not in r0 and "error" not in r1, (r0, r1, (tmp_path / "rank0.log").read_text()[-3000:])
    ref = prog.reference()
    assert r1["outcome"] == ["finished", 3] and r1["steps"] == [1, 2, 3]
    assert r0["requests"] == [5, 5, 5] and r1["requests"] == []
    assert r0["batches"] == ref["batches"] and r1["batches"] == ref["batches"]
    assert r0["w"] == pytest.approx(ref["w"], rel=1e-12, abs=1e-14) and r1["w"] == r0["w"]


def test_tp2_dp2_each_replica_asks_the_teacher_once_a_step_and_shares_it(tmp_path):
    """TP 2 × DP 2 (world 4): each replica's TP rank 0 (ranks 0 and 2) asks the teacher once a step for its
    shard's rows and broadcasts the scores over its TP group; every rank trains on the batch of its shard
    at TP 1, bit for bit, and the DP = 1 parameters come out on all four."""
    results = run_world(tmp_path, "tp2dp2", world=4)
    logs = (tmp_path / "rank0.log").read_text()[-3000:]
    assert all("error" not in r and "missing" not in r for r in results), (results, logs)
    expected = prog.shard_batches(2)
    for rank, result in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        if rank:
            assert result["outcome"] == ["finished", 3] and result["steps"] == [1, 2, 3]
        shards = [shard_rows(prog.step_record(s).response_lengths, 2)[dp_rank] for s in range(1, 4)]
        assert result["requests"] == ([s.rows for s in shards] if tp_rank == 0 else []), rank
        assert result["batches"] == expected[dp_rank], rank
    ref = prog.reference()
    assert results[0]["w"] == pytest.approx(ref["w"], rel=1e-12, abs=1e-14)
    assert all(r["w"] == results[0]["w"] for r in results)
    # rank 0 gathered a receipt from each of the 4 ranks: the rows of its replica's shard
    assert [len(got) for got in results[0]["receipts"]] == [4, 4, 4]


def test_every_rank_of_a_tp2_dp2_actor_publishes_each_sync_with_rank0(tmp_path):
    """TP 2 × DP 2 with a sync every trainer rank writes (AWEX from a DP × TP actor, trainer/rank_writer.py):
    after each step rank 0's `weights` record makes every follower's writer publish that step together with
    rank 0's (a world all-gather: a rank that did not publish would stall the others), each rank its own TP
    piece of the step's parameters; no rank joins a weight gather."""
    results = run_world(tmp_path, "writers", world=4)
    logs = (tmp_path / "rank0.log").read_text()[-3000:]
    assert all("error" not in r and "missing" not in r for r in results), (results, logs)
    w = results[0]["w"]
    assert all(r["w"] == w for r in results)
    half = len(w) // 2
    for result in results:
        assert len(result["published"]) == 3, result["rank"]
        assert result["published"] == results[0]["published"]
    last = results[0]["published"][-1]  # step 3, after which w is final: rank r sent TP piece r mod 2
    assert [row[:2] for row in last] == [[r, 3] for r in range(4)]
    assert [row[2:] for row in last] == [w[:half], w[half:], w[:half], w[half:]]
    assert [[row[1] for row in sync] for sync in results[0]["published"]] == [[s] * 4 for s in (1, 2, 3)]


def test_followers_join_a_collective_state_dict_at_a_checkpoint(tmp_path):
    """DP 2 with an engine whose optimizer state is DP-sharded (`collective_state_dict`, megatron's distributed
    optimizer): rank 0's `checkpoint` record makes the follower join rank 0's state_dict gather once, so
    rank 0's checkpoint holds both ranks' shards, and the run goes on to the end."""
    r0, r1 = run_world(tmp_path, "dp_checkpoint")
    assert "error" not in r0 and "error" not in r1, (r0, r1, (tmp_path / "rank0.log").read_text()[-3000:])
    assert r1["outcome"] == ["finished", 3] and r1["steps"] == [1, 2, 3] and r1["joined"] == 1
    shards = r0["state"]["shards"]
    assert [s[0] for s in shards] == [1.0, 2.0]  # one shard from each rank
    assert shards[0][1:] == shards[1][1:]  # the replicas' parameters after step 2 agree
    assert r0["w"] == pytest.approx(prog.reference()["w"], rel=1e-12, abs=1e-14) and r1["w"] == r0["w"]


@pytest.mark.parametrize(
    ("backend", "collective_s", "rendezvous_s", "message"),
    [
        ("mpi", 5.0, 5.0, "backend='mpi': expected 'gloo' (CPU) or 'nccl' (GPU)"),
        ("gloo", 0.0, 5.0, "collective_timeout_s=0.0, rendezvous_timeout_s=5.0: expected > 0"),
        ("nccl", 5.0, -1.0, "collective_timeout_s=5.0, rendezvous_timeout_s=-1.0: expected > 0"),
    ],
)
def test_the_actor_group_and_a_teacher_tp_group_refuse_the_same_settings(
    backend: str, collective_s: float, rendezvous_s: float, message: str
) -> None:
    """`group.group_settings_problem`, as both groups' specs raise it (each with its own error type)."""
    from mopd_hpc.roles.teacher_replica import ReplicaSpec
    from mopd_hpc.trainer.actor_group import GroupSpec
    from mopd_hpc.trainer.group import ActorGroupError

    with pytest.raises(ActorGroupError) as actor:
        GroupSpec(0, 2, 0, 2, backend, "cpu", collective_s, rendezvous_s)
    with pytest.raises(ValueError) as teacher:
        ReplicaSpec("t", 0, 1, 2, backend, "cpu", collective_s, rendezvous_s)
    assert str(actor.value) == str(teacher.value) == message
