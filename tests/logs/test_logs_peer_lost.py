"""`mopd-logs summarize` names the rank that failed first, not the rank that lost its peer: a real gloo
"connection closed/reset by peer" (a real 2-process gloo group whose rank 1 SIGKILLs itself mid-collective)
wrapped in the actor group's PeerLostError is a consequence (`causes.CONSEQUENCE_KEYS`), so the SIGKILLed
rank is named first even when its guard, on another node with a slower clock, stamped its exit later."""

from __future__ import annotations

import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
from helpers_ports import free_port
from test_logs_summary import RunBuilder

from mopd_hpc.logs.causes import classify_text
from mopd_hpc.logs.summary import no_sacct, summarize_run

RANK1 = """
import os, signal, sys, datetime
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, datetime.timedelta(seconds=30))
pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), 1, 2, datetime.timedelta(seconds=30))
pg.barrier().wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def peer_lost_traceback() -> str:
    """Rank 0's traceback after rank 1's SIGKILL: gloo's own error under the actor group's PeerLostError."""
    import torch
    import torch.distributed as dist

    from mopd_hpc.trainer.group import PeerLostError

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(port)])
    pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), 0, 2, timedelta(seconds=30))
    pg.barrier().wait()
    assert rank1.wait(timeout=60) == -9
    try:
        try:
            pg.allreduce([torch.zeros(4)]).wait()
        except RuntimeError as exc:
            raise PeerLostError(f"actor rank 0: the drain gather of step 2 failed: {exc}") from exc
    except PeerLostError:
        text = traceback.format_exc()
    else:
        raise AssertionError("the all-reduce with a dead peer did not fail")
    return "step 2: scoring 3 rows\n" + text


def test_a_lost_peer_is_a_consequence(peer_lost_traceback: str) -> None:
    cause = classify_text(peer_lost_traceback.splitlines())
    assert cause is not None and cause.key == "peer_lost"


def test_the_sigkilled_rank_is_named_first_across_clocks(tmp_path: Path, peer_lost_traceback: str) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.guard("n2")
    b.child("n1", "actor", 0, 1, exit_at=10.0, exit_code=1, err=peer_lost_traceback)
    b.child("n2", "actor", 1, 1, exit_at=10.4, sig="SIGKILL", err="step 2: scoring 3 rows\n")
    b.child("n1", "teacher", 0, 1, exit_at=10.6, sig="SIGTERM", killed_at=10.5)  # guard teardown: not counted
    f = summarize_run(b.write(), sacct_runner=no_sacct).first_failure
    assert (f.host, f.role, f.index, f.cause.key) == ("n2", "actor", 1, "killed_by_signal")
    assert f.cascade == (("n1 actor-0", "peer_lost"),)


def test_only_lost_peers_keep_the_earliest(tmp_path: Path, peer_lost_traceback: str) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.child("n1", "actor", 1, 1, exit_at=20.0, exit_code=1, err=peer_lost_traceback)
    b.child("n1", "actor", 0, 1, exit_at=21.0, exit_code=1, err=peer_lost_traceback)
    f = summarize_run(b.write(), sacct_runner=no_sacct).first_failure
    assert (f.index, f.cause.key) == (1, "peer_lost")
    assert "Connection" in (f.exception or "") + "".join(f.traceback)
