"""The job index: append, look up by any form of the job id (latest submission wins), XDG state home."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd_hpc.logs.index import (
    JobIndexEntry,
    JobIndexError,
    append_job_index,
    find_run_dir,
    index_path,
    state_home_from_env,
)


def test_append_and_find(tmp_path: Path) -> None:
    home = tmp_path / "state"
    append_job_index(
        {"job_id": "10", "run_dir": "/runs/a", "name": "a", "submitted_at": 1.0, "config": "a.yaml"}, home
    )
    append_job_index(JobIndexEntry(job_id="11", run_dir="/runs/b"), home)
    append_job_index({"job_id": "10", "run_dir": "/runs/a2", "submitted_at": 2.0}, home)
    with open(index_path(home), "a") as fh:
        fh.write('not json\n{"job_id": "12"}\n')
    assert find_run_dir("10", home) == Path("/runs/a2")
    assert find_run_dir("11+1.0", home) == Path("/runs/b")
    assert (index_path(home).stat().st_mode & 0o777) == 0o600
    with pytest.raises(JobIndexError, match="job 12 is not in the job index"):
        find_run_dir("12", home)
    with pytest.raises(JobIndexError, match="expected a Slurm job id"):
        find_run_dir("abc", home)
    with pytest.raises(JobIndexError, match="does not exist"):
        find_run_dir("10", tmp_path / "elsewhere")
    with pytest.raises(JobIndexError, match="run_dir='relative'"):
        append_job_index({"job_id": "13", "run_dir": "relative"}, home)


def test_state_home_from_env() -> None:
    assert state_home_from_env({"XDG_STATE_HOME": "/x/state", "HOME": "/h"}) == Path("/x/state")
    assert state_home_from_env({"XDG_STATE_HOME": "relative", "HOME": "/h"}) == Path("/h/.local/state")
    assert state_home_from_env({"HOME": "/h"}) == Path("/h/.local/state")


def test_local_job_ids_are_indexed_as_they_are(tmp_path: Path) -> None:
    """`mopd-submit --local` records `local-<pid>`: `mopd-logs summarize local-42` finds its run dir."""
    from mopd_hpc.cli.logs_summarize import resolve_target
    from mopd_hpc.logs.index import index_key

    assert index_key("local-42") == "local-42" and index_key("123+1.0") == "123"
    append_job_index({"job_id": "local-42", "run_dir": str(tmp_path / "a")}, tmp_path)
    append_job_index({"job_id": "42", "run_dir": str(tmp_path / "b")}, tmp_path)
    assert find_run_dir("local-42", tmp_path) == tmp_path / "a"
    assert find_run_dir("42", tmp_path) == tmp_path / "b"  # a Slurm job 42 is another job
    assert resolve_target("local-42", {"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "a"
    with pytest.raises(JobIndexError, match=r"'local-x' is neither a run directory nor a job id"):
        resolve_target("local-x", {"XDG_STATE_HOME": str(tmp_path)})
