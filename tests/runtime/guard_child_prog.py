"""The child program of the guard tests (role `testchild`, `python -m guard_child_prog`); it holds no tests.

The tests start `mopd-guard --extra-role testchild=guard_child_prog` with `tests/` on PYTHONPATH. Its
behaviour comes from env overrides of the spawn request:

- `GUARD_TEST_DIR`: where it writes `<role>-<index>.g<gen>.ready` (JSON: pid, pgid, grandchild pid) and
  `<role>-<index>.g<gen>.usr2` (when it got SIGUSR2: it then exits 0, like a checkpointing worker).
- `GUARD_TEST_MODE`: `sleep` (wait for signals), `grandchild` (also start a `sleep` in its group),
  `stubborn` (ignore SIGTERM and SIGUSR2, child and grandchild: only SIGKILL ends it), `lingering` (the
  child dies on SIGTERM, its grandchild in the group ignores it: the group outlives the child until the
  guard's SIGKILL), `detached` (also start a `sleep` in a session of its own, `grandchild`, and a daemon:
  a `sleep` double-forked into a new session whose parent exits at once, `daemon`, as SGLang's and torch's
  workers leave the group), `envdump` (write its whole environment to `env-<role>-<index>.g<gen>.json` and
  exit 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MODES = ("sleep", "grandchild", "stubborn", "lingering", "detached", "envdump")
#: The daemon's double fork: the intermediate prints the daemon's pid and exits.
DAEMONIZE = (
    "import subprocess, sys; p = subprocess.Popen(['sleep', '1000'], start_new_session=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid, flush=True)"
)


def main() -> int:
    mode = os.environ.get("GUARD_TEST_MODE", "sleep")
    assert mode in MODES, f"GUARD_TEST_MODE={mode!r}: expected one of {MODES}"
    out = Path(os.environ["GUARD_TEST_DIR"])
    stem = f"{os.environ['MOPD_ROLE']}-{os.environ['MOPD_INDEX']}.g{os.environ['MOPD_GENERATION']}"
    if mode == "envdump":
        (out / f"env-{stem}.json").write_text(json.dumps(dict(os.environ)))
        return 0

    def on_usr2(signum: int, frame: object) -> None:
        (out / f"{stem}.usr2").write_text(str(os.getpid()))
        sys.exit(0)

    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGUSR2, on_usr2)
    grandchild = None
    if mode == "lingering":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen(["sleep", "1000"])  # keeps SIG_IGN for TERM across exec
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if mode in ("grandchild", "stubborn"):
        grandchild = subprocess.Popen(["sleep", "1000"])  # inherits SIG_IGN for TERM in stubborn mode
    daemon = None
    if mode == "detached":
        grandchild = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        out_text = subprocess.run(
            [sys.executable, "-c", DAEMONIZE], capture_output=True, text=True, check=True
        )
        daemon = int(out_text.stdout.strip())
    ready = {"pid": os.getpid(), "pgid": os.getpgid(0), "grandchild": grandchild.pid if grandchild else None}
    ready["daemon"] = daemon
    tmp = out / f".{stem}.ready"
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, out / f"{stem}.ready")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    raise SystemExit(main())
