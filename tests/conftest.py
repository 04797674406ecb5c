"""Shared pytest fixtures: the real local Slurm cluster of ``tools/slurm_local`` and a hostile temp path.

``slurm_cluster`` (session scope) starts the 4-node cluster with ``tools/slurm_local/setup.sh`` (network-namespace
mode: every node has its own hostname and address) and yields a :class:`SlurmCluster`. Every test marked
``@pytest.mark.slurm`` gets it automatically: the autouse fixture ``_slurm_for_marked_tests`` requests it, so a
marked test needs no argument unless it wants the object. Without root the marked tests skip, saying why; when
``setup.sh`` fails the test fails with the script's output. The fixture tears the cluster down at the end of the
session only when it started it: a cluster that was already running is left running, with the knobs that started
it, but takes this checkout's configs (``setup.sh`` restarts its Slurm daemons when they differ).

``micro_models`` (session scope) is the directory of the three micro tiny models (``tools/build_tiny_models.py
--micro``), built once per run and shared read-only by every test that trains, serves or scores them.
``plain_run`` (session scope) is one uninterrupted local job on them (``helpers_jobs.plain_config``), run once
per run the same way and compared with, or copied and resumed, by the tests that need such a run (a job costs
~30 CPU-s, nearly all of it its children's imports).

Parallel runs (``make test`` runs ``pytest -n N --dist loadgroup``, pytest-xdist): ``pytest_collection_modifyitems``
puts every Slurm test on one worker, one after another (``xdist_group("slurm")``: one cluster, started once),
and keeps the tests of a module that share a module-scoped fixture on one worker (the fixture then runs once,
not once per worker). Everything else a test writes lives under its own tmp path; the micro models are built
under the run's shared temp root with a file lock, so parallel workers build them once. A plain
``pytest tests/x.py`` (no ``-n``) runs as before.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import pytest
from filelock import FileLock
from helpers_fork import forked_cpu_s, remember_environment, started

if TYPE_CHECKING:
    from helpers_jobs import PlainRun

REPO_ROOT = Path(__file__).resolve().parents[1]
SLURM_LOCAL_DIR = REPO_ROOT / "tools" / "slurm_local"
SLURM_CONF = "/etc/slurm/slurm.conf"
SLURM_LOCAL_RUN_DIR = Path("/run/slurm-local")
SLURM_LOCAL_KNOB_PREFIX = "SLURM_LOCAL_"  # setup.sh's knobs (Slurm's own SLURM_LOCALID does not match)
# From nothing installed, setup.sh takes ~16 s here (apt-get install is most of it); a slow mirror takes longer.
SETUP_TIMEOUT_S = 900
TEARDOWN_TIMEOUT_S = 120
OUTPUT_TAIL_CHARS = 4000
#: The xdist group of the tests that use the local Slurm cluster: one worker runs them all, in order.
SLURM_GROUP = "slurm"
#: Module-scoped fixtures of this file that are cheap to repeat: they do not keep a module on one worker.
CHEAP_MODULE_FIXTURES = frozenset({"one_torch_thread"})
#: nodeid → seconds (setup + call + teardown) of the long tests in a profiled run; `python tools/test_durations.py
#: LOG` writes it from a `--durations=0` report. Only the order it gives matters (``longest_first``).
DURATIONS_FILE = Path(__file__).with_name("durations.json")
#: OpenMP's (and torch's) per-process CPU thread count, set for the whole run (``pytest_configure``).
OMP_THREADS = "OMP_NUM_THREADS"
# A directory name with a space, a quote and a shell command: any unquoted use of the path breaks or runs `echo`.
WEIRD_DIR_NAME = "we ird'; echo x"


class SlurmCommandError(RuntimeError):
    """A command run by :meth:`SlurmCluster.run` exited non-zero; the message carries its output tail."""


def _tail(text: str) -> str:
    return text[-OUTPUT_TAIL_CHARS:]


def clean_slurm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Copy ``environ`` without inherited ``SLURM_*`` variables (a pytest run inside an allocation must not
    leak its job into the test jobs), keeping the ``SLURM_LOCAL_*`` knobs of tools/slurm_local, and with
    ``SLURM_CONF`` pointing at the local cluster's config."""
    env = {
        key: value
        for key, value in environ.items()
        if not key.startswith("SLURM_") or key.startswith(SLURM_LOCAL_KNOB_PREFIX)
    }
    env["SLURM_CONF"] = SLURM_CONF
    return env


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    """The running local Slurm cluster, as the tests see it.

    Attributes:
        nodes: node names in order, e.g. ``("n1", "n2", "n3", "n4")``.
        partition: the default partition (``"debug"``).
        mode: ``"netns"`` (every node has its own hostname and address) or ``"loopback"`` (all share 127.0.0.1).
        node_addrs: node name → the address slurmctld reaches it on (``10.200.0.11`` … in netns mode).
        gpus_per_node: fake GPUs per node (``--gres=gpu:N`` sets ``CUDA_VISIBLE_DEVICES``).
        env: the environment for Slurm commands: this process's minus ``SLURM_*``, plus ``SLURM_CONF``.
        started_here: True when this pytest session started the cluster (and will stop it at the end).
    """

    nodes: tuple[str, ...]
    partition: str
    mode: str
    node_addrs: Mapping[str, str]
    gpus_per_node: int
    env: Mapping[str, str]
    started_here: bool

    @classmethod
    def from_running(cls, environ: Mapping[str, str], *, started_here: bool) -> SlurmCluster:
        """Describe the running cluster from ``sinfo`` and ``/run/slurm-local/mode``.

        Raises:
            SlurmCommandError: sinfo failed or listed no node.
        """
        env = clean_slurm_env(environ)
        proc = _run(["sinfo", "-h", "-N", "-o", "%N|%o|%G|%P"], env=env, timeout_s=30)
        rows = sorted({tuple(line.split("|")) for line in proc.stdout.splitlines() if line.strip()})
        if not rows:
            raise SlurmCommandError(f"sinfo listed no node; stdout={proc.stdout!r} stderr={proc.stderr!r}")
        nodes = tuple(sorted((row[0] for row in rows), key=lambda name: (len(name), name)))
        gres = {row[2] for row in rows}
        gpus = int(next(iter(gres)).split(":")[-1]) if len(gres) == 1 and "gpu:" in next(iter(gres)) else 0
        default = [row[3].rstrip("*") for row in rows if row[3].endswith("*")]
        mode_file = SLURM_LOCAL_RUN_DIR / "mode"
        return cls(
            nodes=nodes,
            partition=default[0] if default else rows[0][3],
            mode=mode_file.read_text().strip() if mode_file.exists() else "unknown",
            node_addrs=MappingProxyType({row[0]: row[1] for row in rows}),
            gpus_per_node=gpus,
            env=MappingProxyType(env),
            started_here=started_here,
        )

    def run(
        self, args: Sequence[str], *, timeout_s: float = 120, check: bool = True, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (argv list, no shell) with :attr:`env`; text output captured.

        Raises:
            SlurmCommandError: ``check`` and the command exited non-zero (message: argv, exit code, output tails).
            subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds.
        """
        return _run(args, env=dict(self.env), timeout_s=timeout_s, check=check, cwd=cwd)


def _run(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout_s: float,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(args),
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if check and proc.returncode != 0:
        raise SlurmCommandError(
            f"{list(args)} exited {proc.returncode}\n--- stdout ---\n{_tail(proc.stdout)}"
            f"\n--- stderr ---\n{_tail(proc.stderr)}"
        )
    return proc


def _slurm_local(
    script: str, environ: Mapping[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM_LOCAL_DIR / script)],
        env=dict(environ),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _recorded_knobs() -> dict[str, str]:
    """The ``SLURM_LOCAL_*`` knobs the running cluster was set up with (``/run/slurm-local/knobs``, written by
    setup.sh); empty when setup.sh recorded none (a cluster started before it did)."""
    path = SLURM_LOCAL_RUN_DIR / "knobs"
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs if key.startswith(SLURM_LOCAL_KNOB_PREFIX)}


def _fail_setup(proc: subprocess.CompletedProcess[str]) -> None:
    pytest.fail(
        f"tools/slurm_local/setup.sh exited {proc.returncode}\n--- stdout ---\n{_tail(proc.stdout)}"
        f"\n--- stderr ---\n{_tail(proc.stderr)}",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start (or reuse) the local 4-node Slurm cluster; stop it at session end only if started here."""
    if os.geteuid() != 0:
        pytest.skip(
            f"the local Slurm cluster needs root (it installs Debian packages, writes /etc/slurm and creates "
            f"network namespaces); running as uid {os.geteuid()}. Run the tests as root (CI does)."
        )
    environ = clean_slurm_env(os.environ)
    started_here = False
    if _slurm_local("status.sh", environ, 30).returncode != 0:
        proc = _slurm_local("setup.sh", environ, SETUP_TIMEOUT_S)
        if proc.returncode != 0:
            # setup.sh may have started part of the cluster: stop what it recorded before failing.
            _slurm_local("teardown.sh", environ, TEARDOWN_TIMEOUT_S)
            _fail_setup(proc)
        # Another session may have started it meanwhile (setup.sh holds a lock): then it is not ours to stop.
        started_here = "SLURM_LOCAL_RESULT=started" in proc.stdout.splitlines()
    else:
        # A cluster that is already up keeps the knobs that started it, and is left running; setup.sh with those
        # knobs does nothing unless this checkout renders other configs from them (render_conf.sh changed):
        # then it restarts the Slurm daemons on them.
        proc = _slurm_local("setup.sh", {**environ, **_recorded_knobs()}, SETUP_TIMEOUT_S)
        if proc.returncode != 0:
            _fail_setup(proc)
    try:
        yield SlurmCluster.from_running(os.environ, started_here=started_here)
    finally:
        if started_here:
            proc = _slurm_local("teardown.sh", environ, TEARDOWN_TIMEOUT_S)
            if proc.returncode != 0:
                print(f"tools/slurm_local/teardown.sh exited {proc.returncode}: {_tail(proc.stderr)}")


@pytest.fixture(autouse=True)
def _slurm_for_marked_tests(request: pytest.FixtureRequest) -> None:
    """Give every test marked ``slurm`` the session cluster (skips without root, as the fixture does)."""
    if request.node.get_closest_marker("slurm") is not None:
        request.getfixturevalue("slurm_cluster")


@pytest.fixture()
def weird_tmp_path(tmp_path: Path) -> Path:
    """A fresh directory whose name holds a space, a single quote and ``; echo x`` (see ``WEIRD_DIR_NAME``),
    for hostile-input tests of anything that puts paths into shell or sbatch text."""
    path = tmp_path / WEIRD_DIR_NAME
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests on one torch thread (the CPU tests compare numbers, not speed; CI has 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _module_fixture_names(item: pytest.Item) -> list[str]:
    """The module- or class-scoped fixtures `item` uses, less the cheap ones (`CHEAP_MODULE_FIXTURES`)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [
        name
        for name, defs in info.name2fixturedefs.items()
        if name not in CHEAP_MODULE_FIXTURES and defs and defs[-1].scope in ("module", "class")
    ]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-log",
        metavar="PATH",
        default=None,
        help="append a JSON line per test to PATH: its wall seconds, this process's CPU seconds and the CPU seconds "
        "of the processes it started and waited for (a job's guard and, through it, the job's children) or forked "
        "from the worker's fork server (tests/helpers_fork.py): where a run's CPU goes (README, Tests: Time)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``--cpu-log PATH``: one line per test (setup + call + teardown), appended in one write (the workers
    share the file). Children count once they are waited for: a module fixture's servers in the test that ends
    them."""
    path = item.config.getoption("cpu_log")
    if not path:
        yield
        return
    counts = {name: len(runs) for name, runs in started.items()}
    wall, own, kids, forked = (
        time.monotonic(),
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
        forked_cpu_s(),
    )
    yield
    own2, kids2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    children = kids2.ru_utime + kids2.ru_stime - kids.ru_utime - kids.ru_stime + forked_cpu_s() - forked
    line = {
        "nodeid": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 3),
        "self_cpu_s": round(own2.ru_utime + own2.ru_stime - own.ru_utime - own.ru_stime, 3),
        "children_cpu_s": round(children, 3),
        "programs_forked": len(started["forked"]) - counts["forked"],
        "programs_new": [keys for keys in started["new"][counts["new"] :]],
    }
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(line) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    """One CPU thread per process, and under ``--dist loadgroup`` the work in collection order.

    ``OMP_NUM_THREADS`` (default 1; a value already set is kept) is set before anything imports torch, so this
    process and every process a test starts (a job's children take it as their cap: ``roles/env.cpu_threads``)
    compute on one thread: the tests run micro models beside other workers on 2 cores, where a second OpenMP
    thread spin-waits (measured: a micro job's step 1.3 s at 2 threads, 0.07 s at 1; a 300-step SFT of the
    micro student 18× the CPU). xdist's default re-sorts the work units by their number of tests; collection
    puts the longest first instead (``pytest_collection_modifyitems``)."""
    os.environ.setdefault(OMP_THREADS, "1")
    remember_environment()  # the tests' fork server starts with this environment (tests/helpers_fork.py)
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False


def _work_unit(item: pytest.Item) -> str:
    """What xdist hands to one worker at once: the item's xdist group (named as xdist's worker names it: its
    groups sorted and joined by ``_``), else the item alone."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) if names else item.nodeid


def longest_first(items: Sequence[pytest.Item], seconds: Mapping[str, float]) -> list[pytest.Item]:
    """`items` with their work units (see `_work_unit`) longest first by the summed `seconds` of their tests (a
    test without an entry counts 0 s), ties in collection order; a unit's own tests keep their order.

    Longest-processing-time-first: a long test collected late would otherwise start last and run on one worker
    while the others idle. ``seconds`` is tests/durations.json (nodeid → setup + call + teardown seconds)."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(_work_unit(item), []).append(item)
    cost = {unit: sum(seconds.get(item.nodeid, 0.0) for item in members) for unit, members in units.items()}
    order = sorted(units, key=lambda unit: -cost[unit])  # stable: ties keep collection order
    return [item for unit in order for item in units[unit]]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group tests for ``--dist loadgroup`` (runs before xdist reads the groups; without xdist the marks are inert),
    and on an xdist worker order them longest first.

    Slurm tests (marker ``slurm`` or the ``slurm_cluster`` fixture) share one group: one worker starts the
    cluster once and runs them in order (they wait for an idle cluster, take its 4 nodes, and count its jobs).
    The tests of a module with a module-scoped fixture share a group named after the module, so the fixture
    (a job run once and asserted on by several tests, a served model) runs on one worker, once.
    On a worker (every worker collects, in the same order, and the scheduler hands out work in that order) the
    work units go longest first by tests/durations.json (``longest_first``); a run without xdist keeps the
    collection order.
    """
    for item in items:
        if item.get_closest_marker("slurm") is not None or "slurm_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group(SLURM_GROUP))
        elif _module_fixture_names(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    if hasattr(config, "workerinput") and DURATIONS_FILE.is_file():
        items[:] = longest_first(items, json.loads(DURATIONS_FILE.read_text()))


def _shared_tmp_root(factory: pytest.TempPathFactory) -> Path:
    """The temp root all xdist workers of this run share (each worker's basetemp is ``<root>/gwN``); the
    basetemp itself without xdist."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def micro_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro tiny models (teacher_chain_sum, teacher_leg_counting, student; ``--micro``), built once for the
    run: the first worker builds them under a file lock, the others wait and reuse them (the builder's
    fingerprint check makes the second call a no-op). Read-only: a test that changes a model copies it first."""
    from helpers_models import build_micro_models

    root = _shared_tmp_root(tmp_path_factory)
    out = root / "micro_models"
    with FileLock(str(root / "micro_models.lock")):
        assert build_micro_models(out) == 0
    return out


@pytest.fixture(scope="session")
def plain_run(micro_models: Path, tmp_path_factory: pytest.TempPathFactory) -> PlainRun:
    """One uninterrupted `mopd-submit CONFIG --local` of `helpers_jobs.plain_config`, run once for the test run:
    the first worker that asks runs it under a file lock, the others wait and reuse it (a marker file holds its
    output). Read-only: a test that resumes or damages it copies the directory first."""
    from helpers_jobs import PlainRun, plain_config, submit_local

    root = _shared_tmp_root(tmp_path_factory)
    base = root / "plain_run"
    done = base / "stdout.txt"
    with FileLock(str(root / "plain_run.lock")):
        if not done.is_file():
            shutil.rmtree(base, ignore_errors=True)  # a failed attempt's leftovers
            base.mkdir()
            proc = submit_local(plain_config(micro_models, base / "run", base / "c.yaml"), cwd=base)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done.write_text(proc.stdout)
    return PlainRun(base / "run", done.read_text())
