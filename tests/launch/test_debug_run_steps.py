"""`mopd-debug run`'s step supervisor (`launch.debug_session.run_steps`, no Slurm needed): real subprocesses
stand in for the srun steps. A step that ends with code 0 leaves the others a grace period to end on their own;
an interrupt sent after it is not a failure; a step that fails on its own still fails the run and stops the
others at once."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from mopd_hpc.launch.debug_session import run_steps
from mopd_hpc.launch.rundir import prepare_run_dir

# The trainer step announces the job end (records/job_end.py) and exits 0; the rollout step, per `mode`, stops
# on it ("stops": exit 0), fails on it ("fails": exit 3) or ignores it ("hangs"). SIGINT makes it record
# the signal and exit 130, as a guard stopped by Ctrl-C does.
# The trainer step ends only once the rollout step is up (`rollout.ready`, its SIGINT handler installed): a
# rollout still importing when it is stopped would die of the signal (-2) instead of recording it.
_TRAINER_STEP = (
    "import pathlib, sys, time; from mopd_hpc.records.job_end import write_job_end; "
    "run_dir = pathlib.Path(sys.argv[1]); deadline = time.monotonic() + 60\n"
    "while not (run_dir / 'rollout.ready').exists() and time.monotonic() < deadline: time.sleep(0.01)\n"
    "sys.exit(0 if write_job_end(run_dir, '77', 'finished', 10) and sys.argv[2] == '0' else int(sys.argv[2]))"
)
_ROLLOUT_STEP = """
import pathlib, signal, sys, time
from mopd_hpc.records.job_end import job_ended
run_dir, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
def on_sigint(signum, frame):
    (run_dir / "rollout.sigint").write_text("SIGINT")
    sys.exit(130)
signal.signal(signal.SIGINT, on_sigint)
(run_dir / "rollout.ready").write_text("ready")
while True:
    if mode != "hangs" and job_ended(run_dir, "77"):
        time.sleep(1.0 if mode == "fails" else 0.0)  # fails after the trainer's clean end was seen
        sys.exit(0 if mode == "stops" else 3)
    time.sleep(0.05)
"""


def _run_two_steps(run_dir: Path, trainer_rc: int, mode: str, end_grace_s: float) -> tuple[int, str]:
    out = io.StringIO()
    steps = [
        ("trainer", [sys.executable, "-c", _TRAINER_STEP, str(run_dir), str(trainer_rc)]),
        ("rollout", [sys.executable, "-c", _ROLLOUT_STEP, str(run_dir), mode]),
    ]
    rc = run_steps(
        steps,
        run_dir,
        environ=dict(os.environ),
        out=out,
        stop_wait_s=20.0,
        end_grace_s=end_grace_s,
        poll_s=0.05,
    )
    return rc, out.getvalue()


def test_run_steps_a_clean_end_lets_the_others_stop_on_their_own(tmp_path: Path) -> None:
    run_dir = prepare_run_dir(tmp_path / "run").root
    rc, text = _run_two_steps(run_dir, 0, "stops", end_grace_s=60.0)
    assert rc == 0, text
    assert "step exit codes {'trainer': 0, 'rollout': 0}" in text
    assert not (run_dir / "rollout.sigint").exists()  # never interrupted
    assert "stopping" not in text and "SIGINT" not in text


def test_run_steps_an_interrupt_after_a_clean_end_is_not_a_failure(tmp_path: Path) -> None:
    run_dir = prepare_run_dir(tmp_path / "run").root
    rc, text = _run_two_steps(run_dir, 0, "hangs", end_grace_s=0.5)
    assert rc == 0, text
    assert (run_dir / "rollout.sigint").read_text() == "SIGINT"  # interrupted once the grace ran out
    assert "the step of trainer ended with code 0: the others get 0.5 s to end on their own" in text
    assert "rollout still running 0.5 s after the step of trainer ended with code 0: stopping them" in text
    assert (
        "step exit codes {'trainer': 0, 'rollout': 130} (rollout: stopped after the clean end of trainer, "
        "not a failure)" in text
    )


def test_run_steps_a_failure_during_the_grace_period_or_first_still_fails(tmp_path: Path) -> None:
    run_dir = prepare_run_dir(tmp_path / "a").root
    rc, text = _run_two_steps(run_dir, 0, "fails", end_grace_s=60.0)
    assert rc == 3, text
    assert "the step of trainer ended with code 0: the others get 60 s" in text
    assert "[debug run] the step of rollout ended with code 3\n" in text  # the last step: none to stop
    assert "step exit codes {'trainer': 0, 'rollout': 3}" in text
    run_dir = prepare_run_dir(tmp_path / "b").root
    rc, text = _run_two_steps(run_dir, 2, "hangs", end_grace_s=60.0)
    assert rc == 2, text  # a failing step stops the others at once, as before
    assert "the step of trainer ended with code 2: stopping the others" in text
    assert "step exit codes {'trainer': 2, 'rollout': 130}" in text and "not a failure" not in text
