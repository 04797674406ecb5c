"""The actor group's rendezvous record (trainer/rendezvous.py): written atomically by rank 0, accepted only
for the reader's own job and world size, a known-stale nonce skipped, and a timeout that names why."""

from __future__ import annotations

import json
import threading
import time

import pytest

from mopd_hpc.trainer.rendezvous import (
    Rendezvous,
    RendezvousTimeoutError,
    read_rendezvous,
    rendezvous_path,
    wait_for_rendezvous,
    write_rendezvous,
)


def test_only_a_record_of_this_job_and_world_counts(tmp_path):
    assert read_rendezvous(tmp_path, "7", 2) == (None, f"no file {rendezvous_path(tmp_path)}")
    old = Rendezvous.create("6", "127.0.0.1", 29500, 2)
    write_rendezvous(tmp_path, old)
    record, why = read_rendezvous(tmp_path, "7", 2)
    assert record is None and "belongs to job '6', not '7'" in why
    mine = Rendezvous.create("7", "10.0.0.1", 29501, 4)
    write_rendezvous(tmp_path, mine)
    assert read_rendezvous(tmp_path, "7", 2)[1].endswith("is for an actor world of 4 ranks, not 2")
    assert read_rendezvous(tmp_path, "7", 4) == (mine, "")
    assert json.loads(rendezvous_path(tmp_path).read_text())["nonce"] == mine.nonce
    assert mine.nonce != Rendezvous.create("7", "10.0.0.1", 29501, 4).nonce
    rendezvous_path(tmp_path).write_text("{torn")
    assert "unreadable" in read_rendezvous(tmp_path, "7", 4)[1]


def test_waiting_ranks_skip_a_stale_nonce_and_take_the_new_record(tmp_path):
    stale = Rendezvous.create("7", "127.0.0.1", 29500, 2)
    write_rendezvous(tmp_path, stale)
    fresh = Rendezvous.create("7", "127.0.0.1", 29502, 2)
    writer = threading.Timer(0.3, write_rendezvous, (tmp_path, fresh))
    writer.start()
    t0 = time.monotonic()
    got = wait_for_rendezvous(tmp_path, "7", 2, timeout_s=10, not_nonce=stale.nonce, poll_s=0.02)
    assert got == fresh and time.monotonic() - t0 >= 0.25
    writer.join()


def test_timeout_names_the_file_and_why(tmp_path):
    write_rendezvous(tmp_path, Rendezvous.create("other", "127.0.0.1", 1, 2))
    with pytest.raises(
        RendezvousTimeoutError, match=r"within 0 s: .* belongs to job 'other', not '7'.*actor-0"
    ):
        wait_for_rendezvous(tmp_path, "7", 2, timeout_s=0.1, poll_s=0.02)
