"""The environment `sbatch` runs with: inherited Slurm/PMI variables removed when submitting from a job.

A job submitted from inside an allocation (an `salloc` shell, a batch script, an `srun` step) inherits its
`SLURM_*` variables, and sbatch reads many of them as defaults (`SLURM_CPU_BIND`, `SLURM_MEM_PER_*`, node
lists, array ids: submitit issue #1782), so the new job inherits CPU binding or node lists it never asked
for. We drop them, as submitit's `helpers.clean_env` does, but keep `SLURM_CONF` (submitit #1814: without
it sbatch cannot find a non-default slurm.conf). Pure functions over a `Mapping` (STYLE.md rule 4).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

#: Prefixes of inherited variables that must not reach a nested submission.
SCRUBBED_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SRUN_", "PMI", "PMIX_")
#: Variables kept although they match a prefix: where slurm.conf is.
KEPT_BY_DEFAULT = frozenset({"SLURM_CONF"})
#: Variables whose presence means "this process runs inside a Slurm allocation".
ALLOCATION_MARKERS = ("SLURM_JOB_ID", "SLURM_JOBID")


@dataclass(frozen=True, slots=True)
class SubmitEnv:
    """The environment for `sbatch`, and what was removed from the caller's.

    Attributes:
        environ: the variables sbatch runs with.
        removed: names dropped from the caller's environment, sorted (for a log line; values never logged).
        inside_allocation: whether the caller ran inside a Slurm allocation.
    """

    environ: dict[str, str]
    removed: tuple[str, ...]
    inside_allocation: bool


def inside_allocation(environ: Mapping[str, str]) -> bool:
    """Whether `environ` is that of a process inside a Slurm allocation (SLURM_JOB_ID is set)."""
    return any(environ.get(name) for name in ALLOCATION_MARKERS)


def scrub_slurm_env(environ: Mapping[str, str], keep: Collection[str] = KEPT_BY_DEFAULT) -> dict[str, str]:
    """A copy of `environ` without `SLURM_*`, `SLURMD_*`, `SBATCH_*`, `SALLOC_*`, `SRUN_*`, `PMI*`, `PMIX_*`.

    Args:
        environ: the caller's environment (e.g. `os.environ`, read at the edge).
        keep: names kept even if they match a prefix; default {"SLURM_CONF"}.
    Returns:
        a new dict; `environ` is not modified.
    """
    return {k: v for k, v in environ.items() if k in keep or not k.startswith(SCRUBBED_PREFIXES)}


def submit_environment(environ: Mapping[str, str], keep: Collection[str] = KEPT_BY_DEFAULT) -> SubmitEnv:
    """The environment for `sbatch`: scrubbed when `environ` is inside an allocation, else unchanged.

    Outside an allocation `SBATCH_*` variables are the user's own defaults (e.g. SBATCH_ACCOUNT in a
    shell profile) and are kept; inside one they may have been set by Slurm for the enclosing job.
    """
    inside = inside_allocation(environ)
    new = scrub_slurm_env(environ, keep) if inside else dict(environ)
    removed = tuple(sorted(set(environ) - set(new)))
    return SubmitEnv(environ=new, removed=removed, inside_allocation=inside)
