"""What the teacher and rollout roles and the weight sync do not run, derived from the declarations of
config/capabilities.py: a teacher's engine, device, tensor-parallel size and top-k (`teacher_refusals`), the
rollout backend and its engines' tensor-parallel size (`rollout_refusals`), the rollout package's version
(`version_refusals`), the weight sync's writer, reader, placement and trainer ranks (`weight_sync_refusals`), and
a checkpoint family the engines do not load (`model_family_refusals`). Each refusal is a `Problem` naming the
field, the value and the way out. Callers: config/job_gaps.py (at --check), launch/model_check.py, the teacher
and rollout roles and servers (their re-check at start).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from mopd_hpc.config.capabilities import (
    MODEL_FAMILIES,
    ROLLOUT_BACKENDS,
    TEACHER_ENGINES,
    WEIGHT_SYNCS,
    device_kinds,
    other_ways,
    process_count,
    unverified,
)
from mopd_hpc.config.capability_specs import TeacherEngineSpec
from mopd_hpc.config.problems import Problem, join_path


def teacher_refusals(
    index: int,
    engine: str,
    device: str,
    tp: int,
    estimator: str | None = None,
    *,
    table: Mapping[str, TeacherEngineSpec] = TEACHER_ENGINES,
) -> list[Problem]:
    """What the teacher role does not serve for `models.teachers[index]`: its `engine` on `device` at
    tensor_parallel `tp`, answering top-k when `estimator` is "topk". `table`: the declarations (the role's
    tests pass a stand-in engine's)."""
    spec, path, out = table[engine], join_path("models", "teachers", index), []
    if device not in spec.devices:
        out.append(
            Problem(
                f"{path}.engine",
                f"the {engine} teacher engine scores on {device_kinds(spec.devices)} only; the teacher's device "
                f"is a {device.upper()}",
                engine,
                "a GPU group"
                + other_ways(TEACHER_ENGINES, "engine", lambda s: device in s.devices, but=engine),
            )
        )
    if tp > spec.tensor_parallel:
        problem = Problem(
            f"{path}.tensor_parallel",
            f"the teacher role serves a {engine} teacher at tensor_parallel ≤ {spec.tensor_parallel}: a "
            f"replica of tensor_parallel {tp} (a leader and {tp - 1} follower rank(s)) has not run with "
            "this engine yet" + (f": {spec.untested} has not run" if spec.untested else ""),
            tp,
            f"expected ≤ {spec.tensor_parallel}",
        )
        out.append(unverified(problem, spec.untested) if "tensor_parallel" in spec.unverified else problem)
    if estimator == "topk" and not spec.topk:
        out.append(
            Problem(
                f"{path}.engine",
                f"the {engine} teacher engine answers no top-k (loss.estimator is 'topk')",
                engine,
                "loss.estimator: sampled"
                + other_ways(TEACHER_ENGINES, "engine", lambda s: s.topk, but=engine),
            )
        )
    return out


def rollout_refusals(backend: str, tensor_parallel: int) -> list[Problem]:
    """What the rollout role does not run: the `backend`, or its engines at `tensor_parallel`."""
    spec = ROLLOUT_BACKENDS[backend]
    running = [name for name, s in ROLLOUT_BACKENDS.items() if s.runs_in_job]
    if not spec.runs_in_job:
        return [
            Problem(
                "rollout.backend",
                f"the rollout role runs the {' / '.join(running)} server only",
                backend,
                f"expected {' / '.join(repr(r) for r in running)}",
            )
        ]
    if spec.tensor_parallel is not None and tensor_parallel > spec.tensor_parallel:
        return [
            Problem(
                "rollout.engines.tensor_parallel",
                f"a {backend} rollout engine runs on {process_count(spec.tensor_parallel)} (one device): the "
                f"other GPUs of an engine of tensor_parallel {tensor_parallel} would sit idle",
                tensor_parallel,
                f"expected ≤ {spec.tensor_parallel}, and more rollout.engines.count instead",
            )
        ]
    return []


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("0.5.17.post1" → (0, 5, 17))."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def version_refusals(backend: str, installed: str | None, where: str = "this machine") -> list[Problem]:
    """The rollout backend's package at version `installed` (None: not installed, said elsewhere) outside
    the versions the role has run with (`RolloutBackendSpec.versions`), naming both."""
    spec = ROLLOUT_BACKENDS[backend]
    if spec.versions is None or installed is None:
        return []
    low, high = (_release(v) for v in spec.versions)
    if low <= _release(installed) < high:
        return []
    return [
        Problem(
            "rollout.backend",
            f"{spec.package} {installed} is installed on {where}; the {backend} backend has run with "
            f"{spec.package}{spec.version_range} only",
            backend,
            f"pip install '{spec.package}{spec.version_range}', or rollout.backend: "
            + " / ".join(n for n, s in ROLLOUT_BACKENDS.items() if n != backend and s.runs_in_job),
        )
    ]


def weight_sync_refusals(
    backend: str,
    actor_engine: str,
    rollout_backend: str,
    rollout_mode: str = "separated",
    device: str = "cpu",
    actor_world: int = 1,
) -> Iterator[Problem]:
    """What the `backend` weight sync does not connect: the actor engine it writes from, the rollout it
    reads into, the placement (rollout.mode on `device`) it crosses, an actor of `actor_world` trainer ranks
    on GPUs beyond what it has run from (naming the test that has not run)."""
    spec = WEIGHT_SYNCS[backend]
    limit = spec.trainer_ranks_gpu
    if device == "gpu" and limit is not None and actor_world > limit:
        problem = Problem(
            "weight_sync.backend",
            f"the {backend} sync from {actor_world} trainer ranks (every rank a writer at its transfer rank) has "
            f"not run on GPUs: it has run from {'one trainer rank' if limit == 1 else f'{limit} trainer ranks'} only, and "
            f"{spec.untested} has not run",
            backend,
            ("one trainer slot" if limit == 1 else f"at most {limit} trainer slots")
            + other_ways(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: (
                    (s.trainer_ranks_gpu is None or s.trainer_ranks_gpu >= actor_world)
                    and actor_engine in s.actor_engines
                    and rollout_backend in s.rollout_backends
                    and (rollout_mode, device) in s.layouts
                ),
                but=backend,
            ),
        )
        yield unverified(problem, spec.untested) if "trainer_ranks_gpu" in spec.unverified else problem
    if (rollout_mode, device) not in spec.layouts:
        modes = [m for m, d in spec.layouts if d == device]
        yield Problem(
            "weight_sync.backend",
            f"the {backend} sync does not connect an actor and rollout engines {rollout_mode} on {device.upper()}"
            + (" (NCCL refuses two ranks on one GPU)" if backend == "torch" else ""),
            backend,
            (f"rollout.mode: {' / '.join(modes)}" if modes else "another backend")
            + other_ways(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: (
                    (rollout_mode, device) in s.layouts
                    and actor_engine in s.actor_engines
                    and rollout_backend in s.rollout_backends
                ),
                but=backend,
            ),
        )
    if actor_engine not in spec.actor_engines:
        yield Problem(
            "weight_sync.backend",
            f"the {backend} writer needs the {' / '.join(spec.actor_engines)} actor; models.actor.engine is "
            f"{actor_engine!r}",
            backend,
            f"models.actor.engine: {' / '.join(spec.actor_engines)}"
            + other_ways(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: actor_engine in s.actor_engines and (rollout_mode, device) in s.layouts,
                but=backend,
            ),
        )
    if rollout_backend not in spec.rollout_backends:
        yield Problem(
            "weight_sync.backend",
            f"the job's {backend} reader runs in the {' / '.join(spec.rollout_backends)} rollout server only; "
            f"rollout.backend is {rollout_backend!r}",
            backend,
            f"rollout.backend: {' / '.join(spec.rollout_backends)}"
            + other_ways(
                WEIGHT_SYNCS,
                "weight_sync.backend",
                lambda s: rollout_backend in s.rollout_backends and (rollout_mode, device) in s.layouts,
                but=backend,
            ),
        )


def model_family_refusals(field: str, engine: str | None, architecture: str, where: str) -> list[Problem]:
    """What the job does not load of the checkpoint at `field` (`models.actor.path`, `models.teachers[i].path`)
    read by `engine` (None: the rollout's, transformers): an `architecture` (config.json `architectures[0]`)
    of no declared family, or one `engine` has not run on GPUs; `where` names the directory."""
    spec = MODEL_FAMILIES.get(architecture)
    names = " / ".join(MODEL_FAMILIES)
    engine_field = field.removesuffix(".path") + ".engine"
    if spec is None or (engine is not None and engine not in spec.engines):
        return [
            Problem(
                field,
                f"the job's engines load {names} checkpoints only (config/capabilities.py MODEL_FAMILIES); "
                f"{where} is a {architecture}",
                architecture,
                f"a checkpoint of {names}",
            )
        ]
    untested = spec.untested_by(engine) if engine is not None else ""
    if not untested:
        return []
    ways = [f"{engine_field}: {e}" for e in spec.engines if e != engine and not spec.untested_by(e)]
    problem = Problem(
        field,
        f"the {engine} engine maps {architecture} checkpoints (engines/megatron/convert.py) but has not run "
        f"one on GPUs: {untested} has not run; {where} is a {architecture}",
        architecture,
        ", or ".join(ways) or "another engine",
    )
    return [unverified(problem, untested)]  # the code is written: allow_unverified lets it through
