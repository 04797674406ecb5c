"""Exec wrapper for guard children: set a parent-death signal, then exec the real child in place.

Run by path with the guard's interpreter (`python -S pdeath_exec.py <guard_pid> <signum> <argv...>`), so it
imports nothing of the project. After `execv` the pid is the child's own (no wrapper process remains):
what the guard reports as the child's pid is the worker. A `preexec_fn` would do the same in fewer
processes, but it is unsafe in a multi-threaded parent (the guard has threads), hence this wrapper.

The death signal fires when the *thread* that forked this process exits; the guard forks from its main
thread. If the guard died before `prctl` ran, the parent pid has already changed: exit at once.
"""

from __future__ import annotations

import ctypes
import os
import sys

_PR_SET_PDEATHSIG = 1
#: Exit code when the guard was already gone before the child started.
EXIT_PARENT_GONE = 125


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        sys.stderr.write("usage: pdeath_exec.py GUARD_PID SIGNUM PROGRAM [ARGS...]\n")
        return 2
    guard_pid, signum, program = int(argv[1]), int(argv[2]), argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"pdeath_exec: prctl(PR_SET_PDEATHSIG, {signum}) failed: {os.strerror(err)}\n")
        return 2
    if os.getppid() != guard_pid:
        sys.stderr.write(f"pdeath_exec: guard pid {guard_pid} exited before the child started\n")
        return EXIT_PARENT_GONE
    os.execv(program[0], program)
    return 2  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
