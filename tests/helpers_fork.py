"""Python programs of the tests as processes forked from a fork server of this pytest worker that imported torch,
transformers and megatron-core once (`multiprocessing`'s forkserver, with `PRELOAD`).

A test's rank, role or script process used to be a new interpreter that paid these imports first (torch 1.8 s,
transformers' Qwen3 3.4 s more, megatron-core 4.7 s on the 2-core CI machine); forked, it starts with them. What it
runs is the same: `python -c CODE ARGS`, `python -m MODULE ARGS` or `python SCRIPT ARGS` as `__main__`, with the
environment, working directory and output files asked, its exit status that of the program (SystemExit's code, 1
after an uncaught exception, -N after signal N). What differs from an interpreter of its own: the preloaded
modules were imported with the fork server's environment (this worker's once the session is configured: tests/
conftest.py, `remember_environment`), so a program whose
environment differs from it on any key but `MOPD_*`, PYTHONPATH (prepended to sys.path) and `RUNTIME_KEYS` is a
new interpreter as before (`forkable`); and the interpreter exits without running atexit handlers
(multiprocessing's `os._exit`, after flushing stdout and stderr). On a machine with a GPU (`GPU_DEVICE_FILES`)
the programs are new interpreters as before and `context()` is spawn's: the CUDA driver is not fork-safe, and an
import may initialize it.

    proc = popen(["-c", CODE, "arg"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    done = run(["-m", "mopd_hpc.cli.submit", "--help"], capture_output=True, text=True)
"""

from __future__ import annotations

import builtins
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from mopd_hpc.runtime.guard.fork_server import GPU_DEVICE_FILES  # a machine with GPUs: no forks

#: What the fork server imports (a module that fails to import is skipped: the program meets the error itself).
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "safetensors.torch",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.distributed",
    "megatron.core.transformer.moe.router",
    "pydantic",
    "yaml",
    "reasoning_gym",
    "mopd_hpc.config",
]
#: Keys a program's environment may change and still fork: read when used, by no preloaded module at import (the
#: CUDA ones: programs fork only on a machine without GPUs, where no import acts on them).
RUNTIME_KEYS = frozenset(
    {
        "PYTHONPATH",
        "COLUMNS",
        "LINES",
        "TERM",
        "PYTEST_CURRENT_TEST",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_VISIBLE_DEVICES",
    }
)
_context: Any = None
_server_env: dict[str, str] = {}
_set_by_import: set[str] = set()
#: Programs started by `popen` in this worker: forked, and new interpreters with the keys that made them so.
started: dict[str, list[Any]] = {"forked": [], "new": []}
#: The environment the fork server starts with: this worker's once configured (`remember_environment`), not
#: whatever a test that happens to start it has set meanwhile.
_pristine: dict[str, str] = {}


def remember_environment() -> None:
    """Keep this process's environment as the fork server's (tests/conftest.py, once the session is set up)."""
    _pristine.clear()
    _pristine.update(os.environ)


def on_gpu_machine() -> bool:
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def context() -> Any:
    """This worker's forkserver context with `PRELOAD` (for `ctx.Process`, `ctx.Queue`, ... as spawn's)."""
    global _context
    if _context is None:
        if on_gpu_machine():
            _context = multiprocessing.get_context("spawn")
        else:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            saved = dict(os.environ)
            os.environ.clear()
            os.environ.update(_pristine or saved)
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _context = ctx
    return _context


def _import_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less the keys no preloaded import reads: `MOPD_*`, RUNTIME_KEYS, and those the imports set themselves
    (torch inductor's cache directory: set in this worker too once it imports them)."""
    skip = RUNTIME_KEYS | _set_by_import
    return {k: v for k, v in env.items() if not k.startswith("MOPD_") and k not in skip}


def _environ(answer: Any) -> None:
    """In a forked process: its environment as the fork server's imports left it."""
    answer.put(dict(os.environ))


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a program with environment `env` may fork from the fork server (started here if not yet)."""
    if on_gpu_machine():
        return False
    if not _server_env:
        import psutil

        ctx = context()
        answer = ctx.SimpleQueue()
        probe = ctx.Process(target=_environ, args=(answer,))
        probe.start()
        after = answer.get()
        probe.join()
        _server_env.update(psutil.Process(multiprocessing.forkserver._forkserver._forkserver_pid).environ())
        _set_by_import.update(
            k for k in after.keys() | _server_env.keys() if after.get(k) != _server_env.get(k)
        )
    return _import_env(env) == _import_env(_server_env)


def forked_cpu_s() -> float:
    """CPU seconds of this worker's fork server and the processes it forked and reaped (0 before it starts): the
    tests' `--cpu-log` adds them, as they are nobody's waited-for children here."""
    import psutil

    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if _context is None or pid is None:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system + t.children_user + t.children_system


def _redirect(fd: int, target: str | None) -> None:
    if target is None:
        return
    if target == "<stdout>":
        os.dup2(1, fd)
        return
    new = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(new, fd)
    os.close(new)


def _main(
    args: list[str],
    cwd: str | None,
    env: dict[str, str],
    out: str | None,
    err: str | None,
    session: bool,
) -> None:
    """In the forked process: become `python *args` (module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if session:
        os.setsid()
    _redirect(1, out)
    _redirect(2, err)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path.insert(0, os.getcwd())
        code = compile(args[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


class ForkedPython:
    """The part of `subprocess.Popen` the tests use, for a program forked by `popen`."""

    def __init__(
        self, process: Any, pipes: dict[str, Path], text: bool, tmp: tempfile.TemporaryDirectory
    ) -> None:
        self._process = process
        self._pipes = pipes
        self._text = text
        self._tmp = tmp
        self.pid: int = process.pid
        self.args = process._args if hasattr(process, "_args") else None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("python", timeout or 0)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        self.wait(timeout)
        return self._read("stdout"), self._read("stderr")

    def _read(self, name: str) -> Any:
        path = self._pipes.get(name)
        if path is None:
            return None
        data = path.read_bytes()
        return data.decode(errors="replace") if self._text else data

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _target(stream: Any, name: str, pipes: dict[str, Path], tmp: str) -> str | None:
    if stream is None:
        return None
    if stream is subprocess.STDOUT:
        return "<stdout>"
    if stream is subprocess.PIPE:
        pipes[name] = Path(tmp) / name
        return str(pipes[name])
    if stream is subprocess.DEVNULL:
        return os.devnull
    return str(Path(stream.name).resolve())  # an open file: the child appends to it


def popen(
    args: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    text: bool = False,
    start_new_session: bool = False,
) -> ForkedPython:
    """`subprocess.Popen([sys.executable, *args], ...)`, forked from this worker's fork server (module docstring).
    `stdout`/`stderr`: None (this process's), PIPE (read back by `communicate`), STDOUT (stderr only), DEVNULL,
    or an open file (appended to). `start_new_session`: the program leads a session (and group) of its own."""
    env = dict(os.environ if env is None else env)
    if not forkable(env):
        theirs, ours = _import_env(env), _import_env(_server_env)
        started["new"].append(sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k)))
        return subprocess.Popen(  # type: ignore[return-value]
            [sys.executable, *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
            start_new_session=start_new_session,
        )  # fmt: skip
    tmp = tempfile.TemporaryDirectory(prefix="forked-")
    pipes: dict[str, Path] = {}
    out = _target(stdout, "stdout", pipes, tmp.name)
    err = _target(stderr, "stderr", pipes, tmp.name)
    where = None if cwd is None else str(cwd)
    process = context().Process(target=_main, args=(list(args), where, env, out, err, start_new_session))
    process.start()
    started["forked"].append(args[0] if args[0] in ("-c", "-m") else "script")
    return ForkedPython(process, pipes, text, tmp)


def run(
    args: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run([sys.executable, *args], ...)` forked from this worker's fork server; on timeout the program
    is killed and TimeoutExpired raised, as subprocess.run does."""
    pipe = subprocess.PIPE if capture_output else None
    proc = popen(args, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess([sys.executable, *args], proc.wait(), out, err)
