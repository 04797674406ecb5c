"""`mopd-logs summarize` on a new user's four reports: a teacher whose model path does not exist (the real
transformers traceback, raised by `AutoTokenizer.from_pretrained` on a missing path in a subprocess), next
steps of a local job (`local-N`), a job cancelled with scancel (sacct `CANCELLED by 0` and slurmstepd's
`*** JOB 786 ON n1 CANCELLED AT ... ***`), and a run dir where nothing ran. Asserts the named cause, what the
screen shows first, the commands suggested and the CLI's exit code."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_logs_jobs import job_run, sacct_row, sacct_runner, write_job_json
from test_logs_summary import RunBuilder, _render, logs_cli_args

from mopd_hpc.cli import logs as logs_cli
from mopd_hpc.cli import logs_summarize
from mopd_hpc.logs.causes import classify_text, message_lines
from mopd_hpc.logs.index import append_job_index
from mopd_hpc.logs.next_steps import next_steps
from mopd_hpc.logs.render import SCREEN_LINES_BY_CAUSE
from mopd_hpc.logs.summary import NothingRanError, RunDirMissingError, no_sacct, summarize_run
from mopd_hpc.runtime.signals import EXIT_USAGE

MISSING_MODEL = "/work/trial/.cache/models/nope"


@pytest.fixture(scope="module")
def missing_model_traceback() -> str:
    """The stderr of a real `AutoTokenizer.from_pretrained(MISSING_MODEL)` (offline: no network here)."""
    code = f"from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained({MISSING_MODEL!r})\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 1
    assert "raise HFValidationError(" in proc.stderr  # the source line that used to be matched
    assert proc.stderr.rstrip().splitlines()[-1].startswith("OSError: Repo id must be in the form")
    return proc.stderr


# ---- 1. a missing model path ----------------------------------------------------------------------------
def test_frame_source_lines_are_never_matched() -> None:
    tb = [
        "Traceback (most recent call last):",
        '  File "/x/huggingface_hub/utils/_validators.py", line 133, in validate_repo_id',
        "    raise HFValidationError(",
        "    ^^^^^^^^^^^^^^^^^^^^^^^^",
        "RuntimeError: something else",
        "  with a second message line",
    ]
    assert message_lines(tb) == [tb[0], tb[4], tb[5]]
    assert classify_text(tb) is None
    # a pydantic ValidationError exception line still is a config error; HFValidationError is not
    assert classify_text(["pydantic_core._pydantic_core.ValidationError: 1 validation error"]).key == (
        "config_error"
    )
    cause = classify_text(["OSError: /m/teacher does not appear to have a file named config.json."])
    assert (cause.key, cause.title) == ("model_path", "model path missing or invalid: /m/teacher")


def test_missing_teacher_model_path_names_the_path(tmp_path: Path, missing_model_traceback: str) -> None:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.child("n1", "actor", 0, 1, exit_at=9, killed_at=8.5, sig="SIGTERM")
    b.child("n1", "teacher", 0, 1, exit_at=5, exit_code=1, err=missing_model_traceback)
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    f = s.first_failure
    assert (f.cause.key, f.role, f.index, f.host) == ("model_path", "teacher", 0, "n1")
    assert f.cause.title == f"model path missing or invalid: {MISSING_MODEL}"
    final = missing_model_traceback.rstrip().splitlines()[-1]
    assert f.cause.evidence == final  # the final exception line, not a frame's source
    assert s.next_steps == (f"mopd-submit {s.run_dir}/config.yaml --check",)
    screen = _render(s)
    panel = screen[screen.index("first failure") :]
    body = [x.strip(" │╭╰─") for x in panel.splitlines()[1:]]
    assert body[0].startswith(f"model path missing or invalid: {MISSING_MODEL} — teacher-0 on n1")
    assert body[1].startswith("OSError: Repo id must be in the form")
    assert "config error" not in screen
    # a short excerpt: the caller's frame, the last frames, the exception (no ^^^^ markers)
    excerpt = panel[: panel.index("log: ")].splitlines()
    frames = [x for x in excerpt if 'File "' in x]
    assert 'File "<string>"' in frames[0] and "hub.py" in frames[-1] and len(frames) <= 3
    assert '"<string>", line 2, in <module>' in panel and "^^^^" not in panel
    panel = panel[: panel.index("╰")]
    assert len(panel.splitlines()) <= 2 + 1 + SCREEN_LINES_BY_CAUSE["model_path"] + 1
    assert panel.count("OSError: Repo id") == 1  # not repeated under the excerpt


# ---- 2. next steps of a local job -----------------------------------------------------------------------
def test_local_job_gets_no_slurm_commands(tmp_path: Path) -> None:
    for key in ("killed_by_signal", "host_oom", "nccl", "address_in_use"):
        steps = next_steps("/r", key, "local-301", "n1", "actor", 0, running=False)
        assert not any(x.startswith(("sacct", "mopd-debug shell")) for x in steps), steps
        assert steps[0] in (
            "mopd-logs tail /r --role actor --rank 0",
            "mopd-debug ports",
            "mopd-debug topology",
        )
    assert next_steps("/r", "killed_by_signal", "local-301", "n1", "actor", 0, running=False) == [
        "mopd-logs tail /r --role actor --rank 0",
        "mopd-submit /r/config.yaml --resume /r",
    ]
    assert next_steps("/r", None, "local-301", "n1", None, None, running=True) == ["mopd-logs tail /r -f"]
    # a Slurm job keeps them
    assert next_steps("/r", "killed_by_signal", "301", "n1", "actor", 0, running=False)[0] == (
        "sacct -j 301 --format=JobID,State,ExitCode,MaxRSS,MaxRSSNode"
    )
    assert next_steps("/r", None, "301", "n1", None, None, running=True) == [
        "mopd-logs tail /r -f",
        "mopd-debug shell 301 --node n1",
    ]
    # end to end: a local child killed by SIGKILL
    b = RunBuilder(tmp_path / "run", job_id="local-301")
    b.guard("n1")
    b.child("n1", "actor", 0, 1, exit_at=4, sig="SIGKILL")
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    assert s.first_failure.cause.key == "killed_by_signal"
    assert s.next_steps == (
        f"mopd-logs tail {s.run_dir} --role actor --rank 0",
        f"mopd-submit {s.run_dir}/config.yaml --resume {s.run_dir}",
    )
    assert "sacct" not in _render(s)


# ---- 3. scancel ---------------------------------------------------------------------------------------
def test_scancel_is_named_with_the_uid(tmp_path: Path) -> None:
    root = tmp_path / "run"
    b = RunBuilder(root, job_id="786")
    job_run(b, "786", 0.0, signal="SIGTERM")
    write_job_json(root, "786", 0)
    line = "slurmstepd: error: *** JOB 786 ON n1 CANCELLED AT 2026-11-30T05:00:00 ***"
    (root / "logs" / "batch.786.log").write_text(f"starting\n{line}\n")
    b.write()
    runner = sacct_runner({"786": [sacct_row("786", "CANCELLED by 0", "0:15")]})
    s = summarize_run(root, sacct_runner=runner)
    f = s.first_failure
    assert (f.cause.key, f.cause.title, f.source) == (
        "cancelled",
        "cancelled by uid 0 (root) (scancel)",
        "slurm_signal",
    )
    assert f.cause.evidence == f"{line}; sacct 786 State=CANCELLED by 0"
    assert f.log_path.endswith("batch.786.log")
    assert s.job.state == "CANCELLED"
    assert s.next_steps == (f"mopd-submit {s.run_dir}/config.yaml --resume {s.run_dir}",)
    assert "cancelled by uid 0 (root) (scancel)" in _render(s) and "guard got SIGTERM" not in _render(s)
    # sacct alone (no batch log) still names it
    (root / "logs" / "batch.786.log").unlink()
    s2 = summarize_run(root, sacct_runner=runner)
    assert (s2.first_failure.cause.title, s2.first_failure.cause.evidence) == (
        "cancelled by uid 0 (root) (scancel)",
        "sacct 786 State=CANCELLED by 0",
    )
    # neither: the generic wording stays
    s3 = summarize_run(root, sacct_runner=no_sacct)
    assert s3.first_failure.cause.title == "guard got SIGTERM (scancel, preemption or time limit)"


def test_timeout_steps_cancelled_are_not_a_scancel(tmp_path: Path) -> None:
    root = tmp_path / "run"
    b = RunBuilder(root, job_id="787")
    job_run(b, "787", 0.0, signal="SIGTERM")
    b.write()
    rows = [sacct_row("787", "TIMEOUT"), sacct_row("787.batch", "CANCELLED", "0:15")]
    s = summarize_run(root, sacct_runner=sacct_runner({"787": rows}))
    assert s.first_failure.cause.key == "time_limit"


# ---- 4. nothing ran -----------------------------------------------------------------------------------
def test_run_dir_where_nothing_ran_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    for sub in ("logs", "state", "submit"):  # the skeleton mopd-submit leaves before the job starts
        (root / sub).mkdir(parents=True)
    (root / "config.yaml").write_text("model: x\n")
    with pytest.raises(NothingRanError, match="nothing ran in .*no guard events, no child or job logs"):
        summarize_run(root, sacct_runner=no_sacct)
    assert issubclass(NothingRanError, RunDirMissingError)
    assert logs_cli.main(["summarize", str(root), "--no-sacct"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"mopd-logs summarize: nothing ran in {root.absolute()}")
    assert "no failure found" not in err
    # by job id, sacct knowing a pending job: it is summarized (PENDING), not "nothing ran"
    state_home = tmp_path / "state_home"
    append_job_index({"job_id": "900", "run_dir": str(root), "submitted_at": 0.0}, state_home)
    out = io.StringIO()
    args = logs_cli_args("900", json_out=True)
    args.no_sacct = False
    rc = logs_summarize.run(
        args,
        out=out,
        env={"XDG_STATE_HOME": str(state_home)},
        sacct_runner=sacct_runner({"900": [sacct_row("900", "PENDING")]}),
    )
    assert rc == 0 and json.loads(out.getvalue())["job"]["state"] == "PENDING"
    # once a child log exists, it is summarized
    (root / "logs" / "n1").mkdir()
    (root / "logs" / "n1" / "actor-0.g1.err").write_text("")
    assert summarize_run(root, sacct_runner=no_sacct).job.state == "UNKNOWN"


def test_nothing_ran_yet_names_the_job_holding_the_run_dir(tmp_path: Path) -> None:
    """A first `mopd-submit --local` holds the run-dir lock while it builds the tiny models, minutes before its
    guard writes anything: the "nothing ran" message names that job (held by another process, as there)
    instead of "the job never started", and goes back to it once the lock is released."""
    root = tmp_path / "run"
    for sub in ("logs", "state", "submit"):
        (root / sub).mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from mopd_hpc.runtime.run_lock import acquire\n"
         "acquire(sys.argv[1], 'local-4242', 'hostA', pid=4242)\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n", str(root)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(NothingRanError) as exc:
            summarize_run(root, sacct_runner=no_sacct)
        message = str(exc.value)
        assert message.startswith(f"nothing ran in {root}: no guard events, no child or job logs")
        assert "; job local-4242 (host hostA, pid 4242) holds it since 20" in message
        assert " UTC and has not started its guard yet (a first `mopd-submit --local` builds the tiny models " \
            "before it: minutes); run this again once its guard has started" in message  # fmt: skip
        assert "the job never started" not in message
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with pytest.raises(NothingRanError, match=r"\(the job never started, or this is not the run dir\)$"):
        summarize_run(root, sacct_runner=no_sacct)
