"""The endpoint record (records/endpoint.py): written and read back equal, at the path records/run_dir.py names,
with the JSON keys the servers' readers use; a malformed file is refused naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopd_hpc.records.endpoint import EndpointRecord, EndpointRecordError, read_endpoint
from mopd_hpc.records.run_dir import endpoint_file, teacher_endpoint_file


def test_a_teacher_record_round_trips_at_its_path(tmp_path: Path) -> None:
    record = EndpointRecord.teacher(
        "math", 1, host="node-3", port=41234, pid=77, job_id="123+1", model_path="/m/t", fingerprint="ab12"
    )
    path = record.write(tmp_path)
    assert path == teacher_endpoint_file(tmp_path, "math", 1)
    assert json.loads(path.read_text(encoding="utf-8")) == {
        "role": "teacher",
        "host": "node-3",
        "port": 41234,
        "url": "http://node-3:41234",
        "pid": 77,
        "job_id": "123+1",
        "model_path": "/m/t",
        "teacher_id": "math",
        "replica": 1,
        "fingerprint": "ab12",
    }
    assert read_endpoint(path) == record
    assert record.job_problem(path, "123+1") is None
    assert record.job_problem(path, "124") == (
        f"{path} belongs to job '123+1', not to this job '124' (a record left by another job)"
    )


def test_a_rollout_record_round_trips_and_a_standalone_one_belongs_to_no_job(tmp_path: Path) -> None:
    record = EndpointRecord.rollout(
        2, host="127.0.0.1", port=5, pid=9, job_id=None, model_path="m", backend="sglang"
    )
    path = record.write(tmp_path)
    assert path == endpoint_file(tmp_path, "rollout", "2")
    back = read_endpoint(path)
    assert back == record and back.url == "http://127.0.0.1:5"
    assert back.to_json()["backend"] == "sglang" and "teacher_id" not in back.to_json()
    assert "has no job_id" in str(record.job_problem(path, "7"))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("not json", "is not JSON"),
        ("[1]", "is not a JSON object"),
        ('{"role": "actor"}', "role 'actor'; expected one of teacher, rollout"),
        ('{"role": "rollout", "host": "h", "port": 1}', "no pid, job_id, model_path, index, backend"),
        (
            '{"role": "rollout", "host": "h", "port": "1", "pid": 1, "job_id": 3, "model_path": "m", '
            '"index": 0, "backend": "hf"}',
            "port='1', job_id=3 (of the wrong type)",
        ),
    ],
)
def test_a_malformed_record_is_refused_naming_what_is_wrong(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "rollout-0.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(EndpointRecordError) as err:
        read_endpoint(path)
    assert expected in str(err.value) and str(path) in str(err.value)
    with pytest.raises(FileNotFoundError):
        read_endpoint(tmp_path / "absent.json")
