"""The guard's fork server (zygote): an interpreter that imports the roles' heavy modules once, then forks
each child of a preloaded role from that state instead of starting a new interpreter.

Why: a child of the embedded job spends most of its CPU importing torch, transformers, aiohttp, pydantic
and the config package (≈ 5 CPU s each on the 2-core CI machine, against ≈ 1 s of work in a short job).
Forked from here, the imports are paid once per guard.

Run by the guard (runtime/guard/fork_server.py) as `python -m mopd_hpc.runtime.guard.zygote FD GUARD_PID
SIGNUM MODULE...` through pdeath_exec.py, in its own session, with the environment its children will have
less their per-child keys (fork_server.import_env). `FD` is its end of an AF_UNIX SOCK_SEQPACKET pair:

    zygote → guard   {"ready": true, "threads": N, "preloaded": [...]}   (or {"ready": false, "error": ...})
    guard → zygote   {"module", "env", "cwd", "stdout", "stderr"} + the child's lease fds (SCM_RIGHTS)
    zygote → guard   {"pid": P}                                           (or {"error": ...})
    EOF              the zygote exits 0

A spawn double-forks: the middle process exits at once, so the child is re-parented to the guard (a child
subreaper, man 2 prctl) and is the guard's own child, waited on by pid. The child then waits for that
re-parenting, sets its parent-death signal (it is tied to the parent thread, so only after), starts its own
session, takes /dev/null, its log files and its lease fds, moves to `cwd`, replaces its environment, reseeds
the random generators a fresh interpreter seeds from entropy, and runs `module` as `__main__` (runpy, as
`python -m` does). Its exit, SystemExit or exception, is the interpreter's normal exit (atexit handlers run).

What differs from an exec'ed child: `/proc/<pid>/environ` and `/proc/<pid>/cmdline` are the zygote's (the
environment holds the job's tag, MOPD_JOB_ID / MOPD_HOST / MOPD_RUN_DIR, not the role's); the child's own
`os.environ` and everything it execs carry its full environment.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

#: Largest message either side sends (a spawn request carries one child's environment).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Most lease fds one spawn hands over.
MAX_FDS = 64
#: How long a child waits to be re-parented to the guard before giving up (exit EXIT_PARENT_GONE).
REPARENT_WAIT_S = 10.0
#: Exit code of a child whose guard was gone before it could start (as pdeath_exec.py).
EXIT_PARENT_GONE = 125
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class SpawnOrder:
    """One child to become: what the guard's spawn request said, and the lease fds received with it."""

    module: str
    env: dict[str, str]
    cwd: str
    stdout: str
    stderr: str
    fds: tuple[int, ...]

    @classmethod
    def parse(cls, data: bytes, fds: list[int]) -> SpawnOrder:
        """Raises ValueError (KeyError, TypeError included) for a malformed request."""
        doc: dict[str, Any] = json.loads(data)
        env = {str(k): str(v) for k, v in doc["env"].items()}
        return cls(doc["module"], env, doc["cwd"], doc["stdout"], doc["stderr"], tuple(fds))


def _send(sock: socket.socket, doc: dict[str, Any]) -> None:
    sock.send(json.dumps(doc).encode())


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def preload(modules: list[str]) -> list[str]:
    """Import `modules`; those that fail are skipped (the child imports them itself and reports the error)."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optional import: the child meets the real error
            sys.stderr.write(f"zygote: preload of {name} failed: {type(exc).__name__}: {exc}\n")
            continue
        done.append(name)
    return done


def _fork_child(order: SpawnOrder) -> int | None:
    """Double-fork; in the child return None, in the zygote the child's pid (the middle process reaped)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the child, report its pid, exit so it is re-parented
        os.close(read_end)
        try:
            child = os.fork()
        except BaseException:  # noqa: BLE001 - the zygote's parent side reads no pid and reports it
            os._exit(1)
        if child == 0:
            os.close(write_end)
            return None
        os.write(write_end, str(child).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read()
    os.waitpid(middle, 0)
    if not text:
        raise OSError("the middle process of a spawn exited before forking the child")
    return int(text)


def serve(sock: socket.socket) -> SpawnOrder | None:
    """Answer spawn requests until EOF (returns None in the zygote) or until this process is a forked child
    (returns its order)."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE_BYTES, MAX_FDS)
        except ConnectionError:
            return None
        if not data:
            return None
        try:
            order = SpawnOrder.parse(data, fds)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = _fork_child(order)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            for fd in fds:
                os.close(fd)
            reply: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            if pid is None:
                sock.close()
                return order
            for fd in order.fds:
                os.close(fd)
            reply = {"pid": pid}
        try:
            _send(sock, reply)
        except OSError:  # the guard is gone: its children are its keeper's to clean up
            return None


def become(order: SpawnOrder, guard_pid: int, pdeath_signal: int) -> None:
    """In the forked child: wait for the guard to adopt it, then set up as an exec'ed child is and run the
    role's module as `__main__`. Exits the process (EXIT_PARENT_GONE when the guard is gone)."""
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() != guard_pid:
        if time.monotonic() > deadline:
            os._exit(EXIT_PARENT_GONE)
        time.sleep(0.001)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, pdeath_signal, 0, 0, 0) != 0 or os.getppid() != guard_pid:
        os._exit(EXIT_PARENT_GONE)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(order.stdout, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = os.open(order.stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for fd in order.fds:
        os.set_inheritable(fd, True)  # as Popen(pass_fds=...): what the child execs holds the lease too
    os.chdir(order.cwd)
    os.environ.clear()
    os.environ.update(order.env)
    _reseed()
    sys.argv = [order.module]
    runpy.run_module(order.module, run_name="__main__", alter_sys=True)


def _reseed() -> None:
    """Fresh entropy where a new interpreter would have it (`random` reseeds itself at fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        sys.stderr.write("usage: python -m mopd_hpc.runtime.guard.zygote FD GUARD_PID SIGNUM [MODULE...]\n")
        return 2
    sock = socket.socket(fileno=int(argv[1]))
    guard_pid, pdeath_signal = int(argv[2]), int(argv[3])
    loaded = preload(argv[4:])
    try:
        _send(sock, {"ready": True, "threads": _thread_count(), "preloaded": loaded})
    except OSError:  # the guard closed its end while this imported (its teardown): nothing to serve
        os._exit(0)
    order = serve(sock)
    if order is None:  # EOF: the guard is done with it; nothing to flush or finalize
        os._exit(0)
    become(order, guard_pid, pdeath_signal)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
