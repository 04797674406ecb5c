"""A group's rendezvous record (trainer/rendezvous.py), the actor group's and a TP teacher replica's: written
atomically by rank 0, accepted only for the reader's own job and world size, a known-stale nonce skipped, a
timeout that names why, and a client that reaches the store only through its own nonce."""

from __future__ import annotations

import json
import threading
import time

import pytest
from helpers_ports import free_port

from mopd_hpc.trainer.rendezvous import (
    Rendezvous,
    RendezvousFile,
    RendezvousTimeoutError,
    connect_store,
    publish_store,
    read_rendezvous,
    wait_for_rendezvous,
    write_rendezvous,
)


def test_the_files_of_the_actor_and_of_a_teacher_replica(tmp_path):
    actor, teacher = RendezvousFile.actor(tmp_path), RendezvousFile.teacher(tmp_path, "math", 1)
    assert actor.path == tmp_path / "endpoints" / "actor-rendezvous.json"  # unchanged since the actor group
    assert teacher.path == tmp_path / "endpoints" / "teacher-math.r1-rendezvous.json"
    assert actor.nonce_key != teacher.nonce_key


@pytest.mark.parametrize(
    ("file", "world"),
    [
        (lambda d: RendezvousFile.actor(d), "an actor world"),
        (lambda d: RendezvousFile.teacher(d, "t", 0), "a TP group of teacher t replica 0"),
    ],
)
def test_only_a_record_of_this_job_and_world_counts(tmp_path, file, world):
    file = file(tmp_path)
    assert read_rendezvous(file, "7", 2) == (None, f"no file {file.path}")
    old = Rendezvous.create("6", "127.0.0.1", 29500, 2)
    write_rendezvous(file, old)
    record, why = read_rendezvous(file, "7", 2)
    assert record is None and "belongs to job '6', not '7'" in why
    mine = Rendezvous.create("7", "10.0.0.1", 29501, 4)
    write_rendezvous(file, mine)
    assert read_rendezvous(file, "7", 2)[1].endswith(f"is for {world} of 4 ranks, not 2")
    assert read_rendezvous(file, "7", 4) == (mine, "")
    assert json.loads(file.path.read_text())["nonce"] == mine.nonce
    assert mine.nonce != Rendezvous.create("7", "10.0.0.1", 29501, 4).nonce
    file.path.write_text("{torn")
    assert "unreadable" in read_rendezvous(file, "7", 4)[1]


def test_a_client_reaches_the_published_store_through_its_nonce(tmp_path):
    port = free_port()
    file = RendezvousFile.teacher(tmp_path, "t", 0)
    write_rendezvous(file, Rendezvous.create("7", "127.0.0.1", port, 2))  # a stale record: no store behind it
    stale = json.loads(file.path.read_text())["nonce"]
    publisher = threading.Timer(
        0.5, lambda: served.append(publish_store(file, "7", "127.0.0.1", port, 2, 30))
    )
    served: list = []
    publisher.start()
    client, record = connect_store(file, "7", 2, timeout_s=30)
    publisher.join()
    store, published = served[0]
    assert record == published and record.nonce != stale
    store.set("k", "v")
    assert client.get("k") == b"v" and client.get(file.nonce_key).decode() == record.nonce


def test_waiting_ranks_skip_a_stale_nonce_and_take_the_new_record(tmp_path):
    stale = Rendezvous.create("7", "127.0.0.1", 29500, 2)
    file = RendezvousFile.actor(tmp_path)
    write_rendezvous(file, stale)
    fresh = Rendezvous.create("7", "127.0.0.1", 29502, 2)
    writer = threading.Timer(0.3, write_rendezvous, (file, fresh))
    writer.start()
    t0 = time.monotonic()
    got = wait_for_rendezvous(file, "7", 2, timeout_s=10, not_nonce=stale.nonce, poll_s=0.02)
    assert got == fresh and time.monotonic() - t0 >= 0.25
    writer.join()


def test_timeout_names_the_file_and_why(tmp_path):
    file = RendezvousFile.actor(tmp_path)
    write_rendezvous(file, Rendezvous.create("other", "127.0.0.1", 1, 2))
    with pytest.raises(
        RendezvousTimeoutError,
        match=r"^actor rank 0's rendezvous record did not appear within 0 s: .* belongs to job 'other', "
        r"not '7'.*actor-0",
    ):
        wait_for_rendezvous(file, "7", 2, timeout_s=0.1, poll_s=0.02)
