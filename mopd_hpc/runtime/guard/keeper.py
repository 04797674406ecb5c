"""The guard's keeper: the parent of the guard process, a subreaper that kills what the guard leaves behind.

`mopd-guard` forks at start: the child is the guard, the parent execs this file
(`python -S keeper.py GUARD_PID GRACE_S`, no project imports, a few MB), keeping the pid that was launched
(srun's task, the local backend's guard). It

- is a child subreaper (PR_SET_CHILD_SUBREAPER, man 2 prctl): when the guard dies, even by SIGKILL, its
  children (killed by their parent-death signal) and every orphan below them, whatever session they
  started (`setsid`), are re-parented to the keeper, not to pid 1;
- forwards SIGTERM, SIGINT, SIGUSR2, SIGHUP, SIGQUIT to the guard, and reaps every child it adopts;
- when the guard has exited: appends a `guard_exit` event (`pid`, `exit_code` or `signal`) to the guard's
  event log when given one (EVENTS_FILE HOST: the only record of a guard that was SIGKILLed and never wrote
  `guard_stop`; `mopd-logs summarize` names that death), then SIGTERM to every descendant left, GRACE_S to
  exit, SIGKILL to what remains, until none is left; then exits as the guard did (its exit code, or the same
  signal).

The guard gets SIGHUP as its parent-death signal: if the keeper itself is killed, the guard kills every
child's tree at once and exits (runtime/guard/server.py). What is guaranteed, and what is not: DESIGN notes
in runtime/guard/children.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
#: The guard's parent-death signal: the keeper is gone, kill every child's tree now (server.py).
KEEPER_DEATH_SIGNAL = signal.SIGHUP
#: Exit code of a guard whose keeper died before the guard set its parent-death signal.
EXIT_KEEPER_GONE = 125
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
_POLL_S = 0.02


def descendants(me: int) -> list[int]:
    """Pids of every live descendant of `me`, from /proc's parent links (zombies excluded)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [me]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def reap() -> None:
    """waitpid every exited child (this process never has a child whose status matters but the guard's)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def sweep(grace_s: float) -> None:
    """SIGTERM every descendant, wait up to `grace_s`, SIGKILL the rest, until none is left."""
    me, signum, deadline = os.getpid(), signal.SIGTERM, time.monotonic() + grace_s
    while pids := descendants(me):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
                os.kill(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        time.sleep(_POLL_S)
        reap()
        if time.monotonic() > deadline:
            signum = signal.SIGKILL
    reap()


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def record_exit(events_file: str, host: str, guard: int, status: int) -> None:
    """Append the guard's end (`guard_exit`: `exit_code`, or `signal` by name) to its event log, in the
    format of runtime/guard/events.py (one line, one O_APPEND write). Best effort: a keeper that cannot
    write still sweeps and exits as the guard did (its exit status tells the death too)."""
    code = os.waitstatus_to_exitcode(status)
    record = {
        "ts": time.time(),
        "host": host,
        "event": "guard_exit",
        "pid": guard,
        "exit_code": code if code >= 0 else None,
        "signal": signal.Signals(-code).name if code < 0 else None,
    }
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(events_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)


def fork_guard(grace_s: float, python: str = sys.executable, events: tuple[str, str] | None = None) -> None:
    """Split this process in two: the parent becomes the keeper (it execs this file and never returns),
    the child returns as the guard, a subreaper itself, with KEEPER_DEATH_SIGNAL as its parent-death signal.

    `events` = (the guard's event log, its host name): where the keeper records the guard's end
    (`record_exit`). Call it before any thread starts (fork keeps only the calling thread). Linux only.
    """
    keeper = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    # Blocked across fork and exec (a signal mask survives execve): a stop signal that comes before the
    # keeper's handlers exist waits for them instead of killing it (main unblocks once they are set).
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    pid = os.fork()
    if pid:
        argv = ["keeper", str(pid), str(grace_s), *(events or ())]
        try:
            os.execv(python, [python, "-S", os.path.abspath(__file__), *argv[1:]])
        except OSError:  # cannot exec an interpreter: be the keeper in this process
            os._exit(main(argv))
    # The guard keeps them blocked until its own handlers are set (server.py Guard.start unblocks them).
    _prctl(PR_SET_PDEATHSIG, int(KEEPER_DEATH_SIGNAL))
    if os.getppid() != keeper:  # the keeper died before the line above
        os._exit(EXIT_KEEPER_GONE)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 5):
        sys.stderr.write("usage: keeper.py GUARD_PID GRACE_S [EVENTS_FILE HOST]\n")
        return 2
    guard, grace_s = int(argv[1]), float(argv[2])
    _prctl(PR_SET_CHILD_SUBREAPER, 1)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(guard, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked by fork_guard until now
    status = 0
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # adopted orphans are reaped here too
        except ChildProcessError:  # the guard is gone and reaped already (cannot happen: it is our child)
            break
        if pid == guard:
            break
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_IGN)
    if len(argv) == 5:
        record_exit(argv[3], argv[4], guard, status)
    sweep(grace_s)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # end as the guard did: Slurm and the local backend see the signal
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
