"""A job's teacher child with a stand-in shard engine on CPU, for tests/engines/test_teacher_replica_role.py:

    python tests/engines/teacher_replica_prog.py        (in the environment the guard gives a teacher child)

runs the role's own entry point, `roles.teacher.main([], engines=STAND_IN)`: the run's config, the plan's
variables, the job's token, the replica's world (gloo) and the leader/follower protocol are the job's; only
the engine is `FakeTPEngine` (tests/engines/teacher_tp_prog.py: a vocabulary-parallel fake forward whose logits are
all-gathered over the replica's world), declared for the config's engine ("megatron") as scoring on CPU at
tensor_parallel ≤ 2. Each rank builds its vocabulary shard (`args.rank` of `args.tensor_parallel`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import MappingProxyType

import torch.distributed as dist
from teacher_tp_prog import FakeTPEngine

from mopd_hpc.config.capabilities import TEACHER_ENGINES
from mopd_hpc.engines.teacher.process import TeacherArgs
from mopd_hpc.roles import teacher

#: The stand-in's declaration: the megatron teacher's, on CPU, at tensor_parallel ≤ 2.
SPEC = replace(TEACHER_ENGINES["megatron"], devices=("cpu",), tensor_parallel=2)


def build(args: TeacherArgs) -> FakeTPEngine:
    """This rank's shard: the whole weight at tensor_parallel 1, else shard `args.rank` of the world."""
    if args.tensor_parallel == 1:
        return FakeTPEngine()
    assert (dist.get_rank(), dist.get_world_size()) == (args.rank, args.tensor_parallel)
    return FakeTPEngine(args.rank, args.tensor_parallel)


STAND_IN = teacher.TeacherEngines(specs=MappingProxyType({"megatron": SPEC}), build=build)

if __name__ == "__main__":
    sys.exit(teacher.main([], STAND_IN))
