"""GPU memory of an sglang rollout child's whole process tree per phase of the step, from the driver (issue 34).

SGLang's GPU memory lives in its scheduler subprocesses (one per TP rank, children of the rollout child that
built the `sglang.Engine`), which torch's allocator statistics in the rollout child do not see (the phase
sampler's plan / measured read 1.57–1.64 on the H100 with them missing). So this tracker asks the driver:
NVML's used GPU memory per process (`nvmlDeviceGetComputeRunningProcesses`, every GPU; `nvidia-smi
--query-compute-apps=pid,used_memory` where pynvml does not import), summed over the child's process tree
(the child and every descendant, from /proc's parent ids). NVML counts what the driver gave each process:
its CUDA context, the caching allocator's segments and torch_memory_saver's mappings; units GiB (2^30 bytes).

When it samples (SGLang's memory is its static pool, which changes only when it is released or resumed, so
the samples are taken at those calls, never per /generate):

    /release_memory_occupation  start → `rollout` (what it held through the rollout, the allocator's cache of
                                the generation included); end → `teacher`, `drain`, `train` (what it keeps
                                from the release to the next resume: the controller releases when the step
                                leaves ROLLOUT and resumes at SYNC, trainer/rollout_memory.py)
    /resume_memory_occupation, /update_weights_*   start and end → `sync`
    `read()`                    `held`: what it holds now (the controller reads at the step's end)

`read()` answers the phases seen since the last read in `engines/memory/peaks.py`'s shape, with the figure as
`reserved_gib` (what other processes on the GPU cannot have), then forgets them; {} when no source of
per-process memory is there (a CPU machine, a stand-in engine). A process the driver lists without a figure
(NVML_VALUE_NOT_AVAILABLE) counts 0.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

GIB = float(2**30)
#: The phases a released engine holds its post-release memory through (trainer/rollout_memory.py).
RELEASED_PHASES = ("teacher", "drain", "train")
#: The pseudo-phase of the release call: its start is the rollout's, its end the released phases'.
RELEASE = "release"
#: The routes of the sglang server the tracker samples around, and their phase.
PHASE_OF_PATH = {
    "/release_memory_occupation": RELEASE,
    "/resume_memory_occupation": "sync",
    "/update_weights_from_ipc": "sync",
    "/update_weights_from_distributed": "sync",
    "/update_weights_from_disk": "sync",
}
#: pid → bytes of GPU memory the driver gives it (None: no source here).
UsedTable = Callable[[], Mapping[int, int] | None]


def descendants(root: int, parents: Mapping[int, int]) -> set[int]:
    """`root` and every process below it, from `parents` (pid → parent pid)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def proc_parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid → parent pid of every process in `proc` (field 4 of /proc/PID/stat, after the parenthesized name);
    processes that exit while read are left out."""
    out = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return out


def tree_gib(used: Mapping[int, int], pids: set[int]) -> float:
    """GiB the driver gives the processes `pids`: Σ `used` (pid → bytes) over them."""
    return sum(used.get(pid, 0) for pid in pids) / GIB


def parse_smi(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` (MiB; one process on
    several GPUs has a line each) as pid → bytes; "[N/A]" figures count 0."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit():
            out[int(pid)] = out.get(int(pid), 0) + (int(mib) << 20 if mib.isdigit() else 0)
    return out


def nvml_used() -> dict[int, int] | None:
    """pid → bytes on every GPU, from NVML (pynvml), else from nvidia-smi; None when neither answers."""
    try:
        import pynvml
    except ImportError:
        return _smi_used()
    try:
        pynvml.nvmlInit()
        out: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                out[proc.pid] = out.get(proc.pid, 0) + (proc.usedGpuMemory or 0)
        return out
    except pynvml.NVMLError:
        return _smi_used()


def _smi_used() -> dict[int, int] | None:
    argv = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_smi(done.stdout)


class TreeMemoryTracker:
    """Per-phase GPU memory of the process tree under `root` (module docstring); `PeakTracker`'s interface
    (`activity(phase)`, `read()`), so `engines/memory/peaks.py`'s middleware and route serve it.

    Args:
        root: the tree's root pid (default: this process).
        used: the driver's table, pid → bytes (default `nvml_used`); None from it: no figure (inactive).
        parents: pid → parent pid (default `proc_parents`).
    """

    def __init__(
        self,
        root: int | None = None,
        used: UsedTable = nvml_used,
        parents: Callable[[], Mapping[int, int]] = proc_parents,
    ) -> None:
        self.root = os.getpid() if root is None else root
        self._used, self._parents = used, parents
        self._peaks: dict[str, float] = {}

    def sample(self) -> float | None:
        """GiB the tree holds now, None without a source."""
        table = self._used()
        return None if table is None else tree_gib(table, descendants(self.root, self._parents()))

    def _fold(self, phases: tuple[str, ...], gib: float | None) -> None:
        for phase in phases if gib is not None else ():
            self._peaks[phase] = max(self._peaks.get(phase, 0.0), gib)

    @contextlib.contextmanager
    def activity(self, phase: str) -> Iterator[None]:
        """Sample around one call of `phase` (RELEASE: before → rollout, after → RELEASED_PHASES)."""
        self._fold(("rollout",) if phase == RELEASE else (phase,), self.sample())
        try:
            yield
        finally:
            self._fold(RELEASED_PHASES if phase == RELEASE else (phase,), self.sample())

    def read(self) -> dict[str, dict[str, float]]:
        """phase → {"reserved_gib"} since the last read (then forgotten), `held` = now; {} without a source."""
        now = self.sample()
        if now is None:
            self._peaks = {}
            return {}
        out = {phase: {"reserved_gib": gib} for phase, gib in self._peaks.items()}
        out["held"] = {"reserved_gib": now}
        self._peaks = {}
        return out
