"""The local backend: the same job on this machine, no Slurm — one guard that runs every child of the plan.

`run_local(plan, run_dir, ...)` writes `run_dir/plan.json`, starts ONE `mopd-guard --plan` subprocess with
`MOPD_BACKEND=local` (its own session, a parent-death SIGTERM as a backstop, inherited Slurm variables
scrubbed: a shell inside an allocation must not make the local job look like a Slurm step), streams a
short status from the guard's event log, and waits. SIGINT/SIGTERM to this process are forwarded to the
guard (SIGINT: stop now; SIGTERM: checkpoint, then stop), which kills its children and releases their
ports; if it has not exited `stop_wait_s` after that, its process group is killed, and once it has exited
any process still carrying the job's id is killed (`kill_leftovers`). The exit code is the
guard's (a signal becomes 128 + its number; a guard that stopped cleanly on a forwarded signal gives
128 + that signal's number; a job stopped because the reader of its output went away gives 141, 128 + SIGPIPE).

The guard's own output goes to `run_dir/logs/guard.local.log`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from mopd_hpc.launch import local_setup
from mopd_hpc.launch.env import scrub_slurm_env
from mopd_hpc.launch.pipe_out import is_broken
from mopd_hpc.launch.rundir import RunDir
from mopd_hpc.records.run_dir import PLAN_FILE
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.guard import proctree
from mopd_hpc.runtime.guard.children import PDEATH_EXEC
from mopd_hpc.runtime.guard.events import events_path
from mopd_hpc.runtime.plan import JobPlan
from mopd_hpc.runtime.run_lock import RunLock
from mopd_hpc.runtime.signals import killpg_quiet

#: Job ids of local runs: `local-<pid of mopd-submit>` (a valid port-lease owner id).
LOCAL_JOB_PREFIX = "local"
#: After forwarding a stop signal, how long the guard gets before its process group is killed, seconds.
DEFAULT_STOP_WAIT_S = 60.0
#: Guard log of a local run, under run_dir/logs.
GUARD_LOG_NAME = "guard.local.log"


def local_job_id(pid: int | None = None) -> str:
    return f"{LOCAL_JOB_PREFIX}-{os.getpid() if pid is None else pid}"


def local_environment(environ: Mapping[str, str], gpus: Sequence[str] = ()) -> dict[str, str]:
    """The guard's environment: `environ` without inherited Slurm/PMI variables or a token path, plus
    MOPD_BACKEND=local and CUDA_VISIBLE_DEVICES = the job's GPU tokens (`launch.local_gpus`; "" for none)."""
    env = scrub_slurm_env(environ, keep=())
    env.pop(child_env.SECRET_FILE, None)
    env[child_env.BACKEND] = "local"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def guard_argv(python: str, run_dir: RunDir, job_id: str, host: str) -> list[str]:
    """argv of the local guard, behind the parent-death wrapper (SIGTERM when this process dies)."""
    wrapper = [python, "-S", str(PDEATH_EXEC), str(os.getpid()), str(int(signal.SIGTERM))]
    guard = [python, "-m", "mopd_hpc.cli.guard", "--run-dir", str(run_dir.root), "--job-id", job_id]
    guard += [
        "--host",
        host,
        "--token-file",
        str(run_dir.secret_file),
        "--plan",
        str(run_dir.root / PLAN_FILE),
    ]
    return [*wrapper, *guard, "--bind", "auto"]


class _EventFollower:
    """Prints new guard events (spawn, exit, failures) as short status lines."""

    def __init__(self, path: Path, plan: JobPlan, out: TextIO) -> None:
        self.path, self.out, self._offset, self._buffer = path, out, 0, b""
        self._labels = {(c.role, c.index): c.label for c in plan.children}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            try:
                self._show(json.loads(line))
            except ValueError:
                continue

    def _show(self, ev: dict[str, Any]) -> None:
        label = self._labels.get((ev.get("role"), ev.get("index")), f"{ev.get('role')}[{ev.get('index')}]")
        kind = ev.get("event")
        if kind == "guard_ready":
            text = f"guard ready at {ev.get('url')}"
        elif kind == "spawn":
            ports = ", ".join(f"{k}={v}" for k, v in (ev.get("ports") or {}).items()) or "no ports"
            text = f"started {label}: pid {ev.get('pid')}, {ports}"
        elif kind == "exit":
            how = f"signal {ev['signal']}" if ev.get("signal") else f"exit code {ev.get('exit_code')}"
            text = f"{label} ended: {how}"
        elif kind in ("plan_failed", "plan_spawn_failed"):
            text = f"FAILED: {label}: {ev.get('error') or ev.get('signal') or ev.get('exit_code')}"
        elif kind == "guard_signal":
            text = f"guard got {ev.get('signal')}: stopping"
        else:
            return
        print(f"[local {ev.get('host')}] {text}", file=self.out, flush=True)


def run_local(
    plan: JobPlan,
    run_dir: RunDir,
    *,
    python: str,
    environ: Mapping[str, str],
    out: TextIO,
    host: str | None = None,
    job_id: str | None = None,
    gpus: Sequence[str] = (),
    poll_s: float = 0.2,
    stop_wait_s: float = DEFAULT_STOP_WAIT_S,
    lock: RunLock | None = None,
) -> int:
    """Run `plan` here through one guard (the run dir must be prepared: `prepare_run_dir`).

    Args:
        plan: the job plan (written to run_dir/plan.json here).
        run_dir: the prepared run directory (0700, token file).
        python: the interpreter that runs the guard (sys.executable at the CLI edge).
        environ: this process's environment (read at the edge).
        out: where status lines go; a `launch.pipe_out.PipeOut` whose reader went away (`| head`) stops
            the job as a SIGTERM would (checkpoint, teardown) and makes the exit code 141.
        host, job_id: defaults: this host's name, `local-<pid>`.
        gpus: the GPU tokens the guard gets (`launch.local_gpus.local_gpu_tokens`); () runs on CPU.
        lock: the run dir's lock this job holds (runtime/run_lock.py): the guard inherits it, so it lives
            while either process does; released here when the guard has exited.
    Returns:
        the guard's exit code (128 + N when it died of signal N).
    """
    host = host or socket.gethostname()
    job_id = job_id or local_job_id()
    progress = local_setup.prepare_local_run(run_dir.root, environ, out, python, probe=plan.probe)
    plan.write(run_dir.root / PLAN_FILE)
    follower = _EventFollower(events_path(run_dir.root, host), plan, out)
    follower._offset = _size(follower.path)  # only this run's events
    log_path = run_dir.logs / GUARD_LOG_NAME
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            guard_argv(python, run_dir, job_id, host),
            env=local_environment(environ, gpus),
            cwd=run_dir.root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(lock.inheritable().fd,) if lock is not None and lock.held else (),
        )
    print(
        f"[local] job {job_id}: guard pid {proc.pid}, log {log_path}; follow it with "
        f"`mopd-logs summarize {job_id}` (or the run directory)",
        file=out,
        flush=True,
    )
    stop_deadline: list[float] = []
    forwarded: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)
        forwarded.append(signum)
        if not stop_deadline:
            stop_deadline.append(time.monotonic() + stop_wait_s)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    pipe_stop = False  # the stop was ours: the reader of `out` went away (`| head`)
    try:
        while proc.poll() is None:
            if is_broken(out) and not forwarded:  # stop as a lost terminal would: checkpoint, teardown
                pipe_stop = True
                forward(signal.SIGTERM, None)
            follower.poll()
            progress.poll()  # training progress from run_dir/metrics.jsonl
            if stop_deadline and time.monotonic() > stop_deadline[0]:
                print(f"[local] guard still running {stop_wait_s:.0f} s after the stop: killing it", file=out)
                killpg_quiet(proc.pid, signal.SIGKILL)
                stop_deadline[0] = float("inf")
            time.sleep(poll_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:  # interrupted by an exception: leave no guard behind
            killpg_quiet(proc.pid, signal.SIGKILL)
        rc = proc.wait()
        left = kill_leftovers(job_id)
        if left:
            print(f"[local] killed {left} process(es) of job {job_id} the guard left behind", file=out)
        if lock is not None:
            lock.release()
    follower.poll()
    local_setup.after_local_run(run_dir.root, out, progress, rc, job_id)  # how the job ended
    if pipe_stop and forwarded[0] == signal.SIGTERM:
        return 128 + signal.SIGPIPE  # what a shell reports for a writer whose reader went away
    if rc < 0:
        return 128 - rc
    return 128 + forwarded[0] if rc == 0 and forwarded else rc


def kill_leftovers(job_id: str) -> int:
    """SIGKILL every process of this user that carries `MOPD_JOB_ID=<job_id>` in its environment, with its
    tree: the last net when the guard and its keeper were both killed (runtime/guard/children.py says what
    each layer guarantees). A local job id (`local-<pid>`) is unique on the host while this process lives.
    Returns how many processes were signalled."""
    return proctree.kill_now(proctree.tagged_trees({child_env.JOB_ID: job_id}, (), anywhere=True))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
