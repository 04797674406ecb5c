"""Peak GPU memory of this process per phase of the step (issue 21), for the metrics line.

At each phase start the CUDA caching allocator's peak statistics are reset (`torch.cuda.
reset_peak_memory_stats`); at the phase's end `max_memory_allocated` (bytes held by tensors) and
`max_memory_reserved` (bytes the allocator holds from the driver: what other processes on the GPU cannot
have) are read. The phases are the phase machine's: `PhaseMemory.on_transition` is its transition callback,
so a phase runs from the transition into it to the next transition; the controller calls `start_step()` when
a step's ROLLOUT begins, so that the work between two steps is not counted.
Only for a CUDA device: on CPU every method is a no-op and `take()` gives {} (the metrics contract's keys are
absent on CPU, `records/metrics_schema.py`). What another process holds on the same GPU (a colocated teacher,
the rollout engine) is not in these numbers: they are this child's own; `server_peaks` asks the servers for
theirs (`engines/memory/peaks.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mopd_hpc.mopd.phases import Transition
from mopd_hpc.mopd.plan import Phase
from mopd_hpc.records.metrics_schema import memory_key

GIB = float(2**30)


class PhaseMemory:
    """Peaks of one child (`child`, e.g. "actor") per phase on `device` (module docstring).

    Args:
        device: the child's compute device (a `torch.device`, or None / CPU: inactive).
        child: the metrics keys' child name.
    """

    def __init__(self, device: Any, child: str = "actor") -> None:
        self.child = child
        self.device = device if getattr(device, "type", None) == "cuda" else None
        self._phase: str | None = None
        self._peaks: dict[str, tuple[float, float]] = {}
        if self.device is not None:
            self.begin(Phase.ROLLOUT.value)

    @classmethod
    def of_engine(cls, engine: Any, child: str = "actor") -> PhaseMemory:
        """For a train engine's `device` (inactive when it has none or it is not CUDA)."""
        return cls(getattr(engine, "device", None), child)

    @property
    def active(self) -> bool:
        return self.device is not None

    def begin(self, phase: str) -> None:
        """End the current phase (its peaks kept for `take`) and start `phase` with fresh peak statistics."""
        if self.device is None:
            return
        import torch

        self.end()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._phase = phase

    def start_step(self) -> None:
        """The step's ROLLOUT starts now: what ran since the last transition (metrics, checkpoint, evaluation
        between steps) is dropped, not counted as the rollout's."""
        if self.device is None:
            return
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)
        self._phase = Phase.ROLLOUT.value

    def end(self) -> None:
        """End the current phase, if any: read its peaks (the max with an earlier run of the same phase in
        this step, e.g. after an ABORT)."""
        if self.device is None or self._phase is None:
            return
        import torch

        allocated = torch.cuda.max_memory_allocated(self.device) / GIB
        reserved = torch.cuda.max_memory_reserved(self.device) / GIB
        before = self._peaks.get(self._phase, (0.0, 0.0))
        self._peaks[self._phase] = (max(before[0], allocated), max(before[1], reserved))
        self._phase = None

    def on_transition(self, transition: Transition) -> None:
        """The phase machine's callback: the target phase begins (ABORT ends the current one only)."""
        if transition.target is Phase.ABORT:
            self.end()
        else:
            self.begin(transition.target.value)

    def observer(self, then: Callable[[Transition], None] | None = None) -> Callable[[Transition], None]:
        """A transition callback that runs `on_transition`, then `then` (e.g. the controller's list append)."""

        def observe(transition: Transition) -> None:
            self.on_transition(transition)
            if then is not None:
                then(transition)

        return observe

    def take(self) -> dict[str, float]:
        """The peaks of the phases ended since the last call, as metrics keys (`memory/<child>/<phase>/
        allocated_gib` and `.../reserved_gib`), then forgotten; {} when inactive."""
        out: dict[str, float] = {}
        for phase, (allocated, reserved) in self._peaks.items():
            out[memory_key(self.child, phase, "allocated_gib")] = allocated
            out[memory_key(self.child, phase, "reserved_gib")] = reserved
        self._peaks = {}
        return out


async def server_peaks(teachers: Mapping[str, Any], rollout: Sequence[Any]) -> dict[str, float]:
    """The teachers' and rollout engines' peak GPU memory per phase since the last call, as metrics keys
    (`memory/teacher/<id>/<phase>/<kind>`, `memory/rollout/<i>/...`; `engines/memory/peaks.py`: their
    phases, and `held` between their requests; an sglang engine: its process tree's, from the driver,
    `engines/rollout/tree_memory.py`); {} from servers on CPU."""
    from mopd_hpc.engines.memory.peaks import peak_metrics

    out: dict[str, float] = {}
    for tid, client in teachers.items():
        out |= peak_metrics(f"teacher/{tid}", await client.memory_peaks())
    for i, client in enumerate(rollout):
        out |= peak_metrics(f"rollout/{i}", await client.memory_peaks() or {})
    return out
