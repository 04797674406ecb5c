"""Signals of the node runtime: named exit codes, process-group kill, and the checkpoint request.

Slurm delivers `--signal=USR2@N` and `scancel --signal` to every process of a job step (the guard *and* its
children), so each child must handle USR2 itself; the guard also forwards USR2 to every child's process
group before it tears down (DESIGN.md §4, Guard). USR2 rather than USR1 because NCCL may catch USR1
(submitit `core/job_environment.py::SignalHandler`).

Sources: torchx `schedulers/local_scheduler.py::_LocalReplica.terminate` (`os.killpg`, safe to call
many times, `ProcessLookupError` ignored); submitit `Controller.kill_tasks` (escalation to SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

#: The signal that asks a child to checkpoint (and then exit).
CHECKPOINT_SIGNAL = signal.SIGUSR2

#: Signal a child receives when the guard (the thread that forked it) dies: a backstop for a guard
#: killed with SIGKILL. SIGKILL because a backstop must not depend on the child's handlers; the
#: child's own children must take their own parent-death signal (SGLang and torch workers do).
PARENT_DEATH_SIGNAL = signal.SIGKILL

#: Exit codes of the guard, the roles and the CLI: done; bad input (config, topology, arguments: the argparse
#: convention).
EXIT_OK = 0
EXIT_USAGE = 2
#: The guard could not start: its token file, run directory or HTTP port lease failed.
EXIT_GUARD_START_FAILED = 3

#: Linux prctl option (include/uapi/linux/prctl.h).
PR_SET_PDEATHSIG = 1


def signal_name(signum: int) -> str:
    """`15` → `"SIGTERM"`; an unknown number → `"SIG<n>"`."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def killpg_quiet(pgid: int, signum: int) -> bool:
    """Send `signum` to process group `pgid`; safe to call many times.

    Returns:
        True if the group had at least one process (zombies included) to signal; False if it is gone or
        belongs to another user now (its id was reused: not ours to signal).
    """
    if pgid <= 1:
        raise ValueError(
            f"pgid={pgid}: refusing to signal process group <= 1 (it would hit init or everyone)"
        )
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def group_members(pgid: int, proc: str = "/proc") -> list[int]:
    """Pids of the live processes of group `pgid` (zombies excluded: they only wait to be reaped, and an
    orphan's zombie may wait long when pid 1 reaps lazily, as in some containers)."""
    members = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    """True while any live (non-zombie) process of group `pgid` exists."""
    return killpg_quiet(pgid, 0) and bool(group_members(pgid))


def set_parent_death_signal(signum: int = PARENT_DEATH_SIGNAL) -> None:
    """Ask the kernel to send `signum` to this process when the thread that forked it exits.

    Linux only (prctl PR_SET_PDEATHSIG, man 2 prctl). The setting survives execve (except setuid binaries).
    Raises:
        OSError: prctl failed.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG, {signal_name(signum)}) failed: {os.strerror(errno)}")


class CheckpointRequest:
    """One handler object for the checkpoint signal in a child (STYLE.md rule 11).

    `install()` makes USR2 set a flag instead of killing the process (USR2's default action); the training
    loop polls `requested` at a safe point, checkpoints, and exits. The callback, if any, runs in the main
    thread inside the signal handler: keep it short (set a flag, write one line).
    """

    def __init__(self, on_request: Callable[[int], None] | None = None) -> None:
        self._event = threading.Event()
        self._on_request = on_request

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def install(self, signum: int = CHECKPOINT_SIGNAL) -> CheckpointRequest:
        signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        self._event.set()
        if self._on_request is not None:
            with contextlib.suppress(Exception):
                self._on_request(signum)
