"""tests/helpers_fork.py runs a program as `python ARGS` would: its argv, environment, working directory, output and
exit status; a program whose environment differs on a key a preloaded import may read is a new interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_fork import ForkedPython, on_gpu_machine, popen, run

pytestmark = pytest.mark.skipif(on_gpu_machine(), reason="new interpreters on a GPU machine")

CODE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("MOPD_X"), "sid": os.getsid(0) == os.getpid()}))
print("to stderr", file=sys.stderr)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("session", [False, True])
def test_a_forked_program_has_its_argv_env_cwd_output_and_exit_code(tmp_path: Path, session: bool) -> None:
    env = {**os.environ, "MOPD_X": "1"}
    proc = popen(
        ["-c", CODE, "3"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=session,
    )  # fmt: skip
    assert isinstance(proc, ForkedPython)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and err == "to stderr\n"
    assert eval(out.replace("true", "True").replace("false", "False")) == {
        "argv": ["-c", "3"], "cwd": str(tmp_path), "x": "1", "sid": session,
    }  # fmt: skip


def test_a_module_runs_as_main_and_a_signal_is_a_negative_status() -> None:
    done = run(["-m", "json.tool", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout
    proc = popen(["-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_an_environment_that_an_import_may_read_gets_a_new_interpreter() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1" if os.environ.get("HF_HUB_OFFLINE") != "1" else "0"}
    proc = popen(
        ["-c", "import os; print(os.environ['HF_HUB_OFFLINE'])"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert isinstance(proc, subprocess.Popen) and proc.args[0] == sys.executable
    assert proc.communicate(timeout=60)[0].strip() == env["HF_HUB_OFFLINE"]
