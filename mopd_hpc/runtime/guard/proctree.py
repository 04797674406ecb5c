"""Whole process trees of the guard's children: find every descendant, also those in a session of their own.

A child runs in its own session and process group, but what it starts may leave both (`setsid`, a daemon's
double fork: SGLang's scheduler and detokenizer, torch's workers), so killing the group is not enough.
Three ways find such a process here:

- the tree: `psutil.Process(pid).children(recursive=True)` while its ancestors live;
- the subreaper: the guard sets PR_SET_CHILD_SUBREAPER (man 2 prctl), so an orphan whose parent died is
  re-parented to the guard instead of pid 1 — it stays findable as the guard's own (non-Popen) child;
- the tag: every child carries its identity in its environment (MOPD_JOB_ID, MOPD_HOST, MOPD_ROLE,
  MOPD_INDEX, MOPD_GENERATION) and its descendants inherit it; `/proc/<pid>/environ` is the environment the
  process was exec'ed with, so a later `os.environ` change does not hide it (a process that exec'ed itself
  with a cleared environment is found by the first two ways only). A child forked from the fork server
  (fork_server.py) shows the server's environment there, with the job's tag (MOPD_JOB_ID, MOPD_HOST,
  MOPD_RUN_DIR) but not the role's: what it execs carries its whole tag, what it only forks the job's (an
  orphan of that kind is found by the job's sweep at teardown).

The guard also reaps the orphans it adopts (`reap_adopted`), never the children it started (their exit
statuses are the Popen or ForkedProcess objects'). Linux only; elsewhere the subreaper is simply not set.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Collection, Iterable, Mapping

import psutil

#: prctl option (include/uapi/linux/prctl.h).
PR_SET_CHILD_SUBREAPER = 36

_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ProcessLookupError)


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants. True when the kernel accepted it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def live(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running and not zombies (psutil checks the pid was not reused)."""
    out = []
    for proc in procs:
        with contextlib.suppress(*_GONE):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
    return out


def tree(pid: int) -> list[psutil.Process]:
    """`pid` and every descendant of it, by parent links; [] when `pid` is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except _GONE:
        return []


def tagged(proc: psutil.Process, tag: Mapping[str, str]) -> bool:
    """True when the environment `proc` was exec'ed with holds every `tag` item (False if unreadable)."""
    try:
        env = proc.environ()
    except _GONE:
        return False
    return all(env.get(k) == v for k, v in tag.items())


def adopted(exclude: Collection[int]) -> list[psutil.Process]:
    """This process's own children other than `exclude` (the Popen'ed ones): orphans it adopted as subreaper."""
    try:
        kids = psutil.Process().children()
    except _GONE:
        return []
    return [k for k in kids if k.pid not in exclude]


def tagged_trees(
    tag: Mapping[str, str], exclude: Collection[int], anywhere: bool = False
) -> list[psutil.Process]:
    """Processes carrying `tag`, with their trees: among the adopted orphans (or, with `anywhere`, among
    every process of the node this user may read), never `exclude` or this process."""
    me = os.getpid()
    roots = psutil.process_iter() if anywhere else adopted(exclude)
    found: dict[int, psutil.Process] = {}
    for proc in roots:
        if proc.pid in exclude or proc.pid == me or not tagged(proc, tag):
            continue
        for p in tree(proc.pid):
            found.setdefault(p.pid, p)
    return list(found.values())


def signal_all(procs: Iterable[psutil.Process], signum: int) -> int:
    """Send `signum` to each of `procs` still alive; returns how many were sent."""
    sent = 0
    for proc in procs:
        with contextlib.suppress(*_GONE):
            proc.send_signal(signum)
            sent += 1
    return sent


def reap_adopted(exclude: Collection[int]) -> list[int]:
    """waitpid() the adopted orphans that have exited (not `exclude`, the Popen'ed children). Their pids."""
    reaped = []
    for proc in adopted(exclude):
        with contextlib.suppress(ChildProcessError, OSError):
            pid, _ = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                reaped.append(pid)
    return reaped


def kill_now(procs: Iterable[psutil.Process]) -> int:
    """SIGKILL each of `procs`; returns how many were sent."""
    return signal_all(procs, signal.SIGKILL)
