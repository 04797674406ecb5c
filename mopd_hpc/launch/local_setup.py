"""Before a local run: build the tiny models on first use, and pin the run's paths.

`prepare_local_run(run_dir, environ, out, python)` is called by the local backend (`launch/local.py`)
after `mopd-submit` wrote `run_dir/config.yaml` and before the guard starts:

1. every relative model, tokenizer and jsonl path of the config is made absolute against the directory
   `mopd-submit` runs in (the children run in the run directory), and config.yaml is rewritten atomically;
2. when a model directory of a CPU config is missing (or has no config.json: an interrupted first build) and its
   name is one that `tools/build_tiny_models.py` builds (teacher_chain_sum, teacher_leg_counting, student), the
   builder runs once into that directory's parent
   (`python tools/build_tiny_models.py --out DIR --threads N`; seeded, cached by fingerprint; the default models
   copied from their builds shipped in assets/tiny_models, any other trained), its output
   streamed to `out`; the build dies with `mopd-submit` (SIGTERM, Ctrl-C or SIGKILL: `build_tiny_models`). A missing model the builder does not make is left for the actor's clear error.

While the guard runs, `LocalProgress.poll()` (returned by `prepare_local_run`) follows run_dir/metrics.jsonl
and shows the training progress in the submitting terminal (a rich bar on a TTY, a line every ~1 % otherwise;
the actor's own output goes to its log file). `after_local_run(run_dir, out, progress, rc, job_id)` closes it and
says how the job ended (the evaluation table of a finished run; the saved step of a checkpoint stop; where to
look after a failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TextIO

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.config import RunConfig
from mopd_hpc.records.eval_table import print_eval_table
from mopd_hpc.records.job_end import read_job_end
from mopd_hpc.records.run_dir import CONFIG_FILE, METRICS_FILE
from mopd_hpc.roles.env import with_absolute_paths
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.guard.children import PDEATH_EXEC
from mopd_hpc.runtime.signals import PARENT_DEATH_SIGNAL, killpg_quiet
from mopd_hpc.trainer.progress import Progress

#: The tiny-model builder of this repository (tools/ is not a package).
BUILDER = Path(__file__).resolve().parents[2] / "tools" / "build_tiny_models.py"
#: Model directories the builder makes.
BUILT_NAMES = ("teacher_chain_sum", "teacher_leg_counting", "student", "student_moe")


class LocalSetupError(RuntimeError):
    """The tiny-model builder failed (its exit code and the command are named)."""


def builds_tiny_models(cfg: RunConfig) -> bool:
    """Whether missing builder-named models of `cfg` are built on first use: only for a CPU run (the tiny
    models are CPU models; a GPU config's `student`/`teacher` directories are made otherwise, e.g. by
    benchmarks/gpu_step.py --make-models)."""
    return all(group.gpus_per_node == 0 for group in cfg.cluster.groups().values())


def awaits_build(cfg: RunConfig, path: Path) -> bool:
    """Whether the model directory `path` of `cfg` is one `--local` builds on first use (a builder name, a CPU
    config) whose build has not finished: no config.json, the directory absent or left behind by an
    interrupted first build (the builder makes it before it trains, and saves the model at the end)."""
    return builds_tiny_models(cfg) and path.name in BUILT_NAMES and not (path / "config.json").exists()


def missing_builder_dirs(cfg: RunConfig) -> list[Path]:
    """Parent directories in which builder-made models of `cfg` are missing or unfinished (`awaits_build`;
    deduplicated, in order); none for a GPU config (`builds_tiny_models`)."""
    return list(missing_builder_models(cfg))


def missing_builder_models(cfg: RunConfig) -> dict[Path, list[str]]:
    """Parent directory → the names of the builder-made models of `cfg` missing or unfinished in it."""
    paths = [cfg.models.actor.path, cfg.models.tokenizer.path, *(t.path for t in cfg.models.teachers)]
    out: dict[Path, list[str]] = {}
    for raw in paths:
        path = Path(raw)
        if awaits_build(cfg, path) and path.name not in out.get(path.parent, []):
            out.setdefault(path.parent, []).append(path.name)
    return out


def build_tiny_models(
    out_dir: Path,
    python: str,
    out: TextIO,
    threads: int = 2,
    names: Sequence[str] = (),
    *,
    builder: Path = BUILDER,
) -> None:
    """Run the builder (`builder`, default `BUILDER`) into `out_dir` (`names`: only these models; none: the
    default three), its output streamed to `out`.

    The builder dies with this process: it runs in its own process group behind the parent-death wrapper
    (`runtime/guard/pdeath_exec.py`, SIGKILL when this process dies, even of SIGKILL); a SIGTERM to this process
    during the build (installed from the main thread only) or a Ctrl-C (KeyboardInterrupt) kills that group
    before the interruption goes on (SIGTERM: `SystemExit(128 + SIGTERM)`). An interrupted build leaves its
    directories without config.json, so the next run builds them again (`awaits_build`).

    Raises:
        LocalSetupError: the builder failed (its exit code and command are named).
        SystemExit: 143, on SIGTERM during the build.
    """
    argv = [python, str(builder), "--out", str(out_dir), "--threads", str(threads)]
    argv += [arg for name in names for arg in ("--only", name)]
    print(
        f"[local] building the tiny models into {out_dir} (first use: the shipped builds copied; cached afterwards)",
        file=out,
        flush=True,
    )
    wrapper = [python, "-S", str(PDEATH_EXEC), str(os.getpid()), str(int(PARENT_DEATH_SIGNAL))]
    with _sigterm_exits():
        proc = subprocess.Popen(
            [*wrapper, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"[build] {line.rstrip()}", file=out, flush=True)
            rc = proc.wait()
        except BaseException:  # SIGTERM (SystemExit), Ctrl-C: the build goes with us
            killpg_quiet(proc.pid, signal.SIGKILL)  # not yet reaped: its pid is still its group's id
            proc.wait()
            print(f"[local] stopped: the tiny-model build into {out_dir} was killed", file=out, flush=True)
            raise
    if rc != 0:
        raise LocalSetupError(f"the tiny-model builder failed with exit code {rc}: {' '.join(argv)}")


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(128 + SIGTERM) (so cleanup runs) instead of ending the process
    at once; the previous handler is restored after. Off the main thread (where no handler can be set) a
    no-op: the parent-death signal is the builder's net there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class LocalProgress:
    """Follows run_dir/metrics.jsonl from its current end; `poll()` shows new steps; `close()` ends it."""

    def __init__(self, run_dir: Path, total: int | None, out: TextIO) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.total, self.out = total, out
        self._offset = self.path.stat().st_size if self.path.exists() else 0
        self._buffer = b""
        self._progress: Progress | None = None
        self._last_ts: float | None = None

    def poll(self) -> None:
        if self.total is None:
            return
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self._offset:  # rolled back by a resume: follow the new file
                    self._offset, self._buffer = 0, b""
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for raw in lines:
            try:
                line = json.loads(raw)
                step = int(line["step"])
            except (ValueError, KeyError, TypeError):
                continue
            if self._progress is None:
                self._progress = Progress(self.out, step - 1, self.total).__enter__()
            ts = float(line.get("ts") or 0.0)
            step_s = ts - self._last_ts if self._last_ts is not None else None
            self._last_ts = ts
            self._progress.update(step, line, step_s)

    def close(self) -> None:
        self.poll()
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None


def prepare_local_run(
    run_dir: Path, environ: Mapping[str, str], out: TextIO, python: str, *, probe: bool = False
) -> LocalProgress:
    """Steps 1-2 of the module docstring; returns the progress follower of the run. A probe-only run (no
    model is loaded) or a run directory without config.yaml is left alone (the follower then shows nothing)."""
    path = Path(run_dir) / CONFIG_FILE
    if probe or not path.is_file():
        return LocalProgress(run_dir, None, out)
    cfg = RunConfig.from_yaml(path)
    base = {child_env.SUBMIT_DIR: environ.get(child_env.SUBMIT_DIR, os.getcwd())}
    cfg = with_absolute_paths(cfg, base)
    for directory, names in missing_builder_models(cfg).items():
        build_tiny_models(directory, python, out, names=names)
    atomic_write_text(path, cfg.to_yaml())
    return LocalProgress(run_dir, cfg.steps, out)


def after_local_run(
    run_dir: Path, out: TextIO, progress: LocalProgress | None = None, rc: int = 0, job_id: str | None = None
) -> None:
    """Close the progress display, then say how the job ended: the evaluation table of a finished run
    (run_dir/eval.json); for a job that stopped on a checkpoint signal (this job's state/job_end.json says
    so), the step it saved and how to resume; for a failed job (rc != 0), where to look — never an older
    run's table, which would read as this job's result."""
    if progress is not None:
        progress.close()
    run_dir = Path(run_dir)
    if rc != 0:
        how = f"the guard was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        print(
            f"[local] the job failed ({how}): `mopd-logs summarize {run_dir}` says what failed first",
            file=out,
        )
        return
    end = read_job_end(run_dir)
    if end is not None and end.get("reason") == "checkpoint_signal" and end.get("job_id") in (job_id, None):
        print(
            f"[local] stopped on a checkpoint signal after step {end.get('step')}: re-run the same command "
            "to resume",
            file=out,
        )
        return
    print_eval_table(run_dir, out)
