"""The `teacher` role of a run: `python -m mopd_hpc.trainer.teacher_role` (the guard's role table runs it).

The teacher scoring server (`engines/teacher_main.py`) takes its checkpoint and port from flags or its own
variables; inside a job its settings come from the run instead: MOPD_TEACHER_ID (the job plan sets it)
names the entry of `models.teachers` in `run_dir/config.yaml`, which gives the checkpoint path, the scoring
engine (torch, or megatron on the child's GPU), its dtype and tensor_parallel (1: the role starts one process
per teacher); the port is the named port `http`. This module resolves them (env read once, in `main`) and runs
`teacher_main.serve` until SIGTERM/SIGINT or until the actor announces the end of the job
(`trainer/job_end.py`), then exits 0. SIGUSR2 is ignored (a teacher has nothing to checkpoint).

Rows scored per forward (`scoring_rows`): a forward materializes [rows, tokens, vocab] logits (and their
float32 log-softmax), which for a production vocabulary (Qwen3: 151,936) and a long response is gigabytes per
row: 256 rows × 1,280 tokens would need ~200 GB. The role caps the rows so that one chunk's float32 logits stay
within `SCORING_BUDGET_BYTES`; a step's rows are then scored in chunks (same results).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.teacher_main import TeacherArgs
from mopd_hpc.trainer.job_end import stop_on_job_end
from mopd_hpc.trainer.role_env import RoleEnv, RoleEnvError, cpu_threads, start_server_role

#: The plan's variable naming the teacher of this child.
TEACHER_ID_ENV = "MOPD_TEACHER_ID"
#: Bytes of float32 logits one scoring forward may materialize (module docstring).
SCORING_BUDGET_BYTES = 4 << 30


def scoring_rows(cfg: RunConfig, model_path: str, budget_bytes: int = SCORING_BUDGET_BYTES) -> int:
    """Rows per scoring forward: all of a step's rows (data.batch_size · samples_per_prompt, at least 64) unless
    their float32 logits — rows × (max_prompt_tokens + max_new_tokens) × vocab_size × 4 bytes — exceed
    `budget_bytes`; then the most rows that fit (at least 1). vocab_size from `model_path`/config.json; when
    it cannot be read the step's rows are kept (the server's load reports the checkpoint's problem)."""
    rows = max(64, cfg.data.batch_size * cfg.data.samples_per_prompt)
    try:
        vocab = int(json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return rows
    tokens = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    return max(1, min(rows, budget_bytes // (tokens * vocab * 4)))


def teacher_args(role: RoleEnv, cfg: RunConfig, environ: Mapping[str, str]) -> TeacherArgs:
    """The scoring server's arguments for this child.

    Raises:
        RoleEnvError: no or unknown teacher id; the teacher's tensor_parallel is not 1; engine megatron
            while CUDA_VISIBLE_DEVICES is empty (the child has no GPU). The message names the config field
            (`models.teachers[i].tensor_parallel`, `models.teachers[i].engine`) and its value.
    """
    teacher_id = environ.get(TEACHER_ID_ENV)
    if not teacher_id:
        raise RoleEnvError(f"{TEACHER_ID_ENV} is not set: the job plan names the teacher of each child")
    try:
        teacher = cfg.models.teacher(teacher_id)
    except KeyError as exc:
        raise RoleEnvError(f"{TEACHER_ID_ENV}={teacher_id!r}: {exc.args[0]}") from None
    here = f"models.teachers[{cfg.models.teacher_ids.index(teacher.id)}]"
    if teacher.tensor_parallel != 1:
        raise RoleEnvError(
            f"{here}.tensor_parallel={teacher.tensor_parallel}: the teacher role serves each teacher from one "
            "process and starts no follower ranks; expected 1"
        )
    gpu = bool(environ.get("CUDA_VISIBLE_DEVICES"))
    if teacher.engine == "megatron" and not gpu:
        raise RoleEnvError(
            f"{here}.engine='megatron' needs a GPU, but CUDA_VISIBLE_DEVICES is "
            f"{environ.get('CUDA_VISIBLE_DEVICES')!r} (the job gives this teacher child none); expected a "
            "GPU group, or engine: torch"
        )
    base = environ.get("MOPD_BASE_GPU_ID")
    return TeacherArgs(
        teacher_id=teacher.id,
        model_path=teacher.path,
        host=role.bind_host,
        port=role.port("http"),
        advertise_host=role.advertise_host,
        device=(f"cuda:{base}" if base else "cuda") if gpu else "cpu",
        dtype=teacher.dtype,
        run_dir=str(role.run_dir),
        max_batch_rows=scoring_rows(cfg, teacher.path),
        # on CPU the teachers of a step score concurrently: each takes its share of the cores
        num_threads=None if gpu else cpu_threads(environ, share=len(cfg.models.teachers)),
        engine=teacher.engine,
        tensor_parallel=teacher.tensor_parallel,
        source=here,
    )


async def run(role: RoleEnv, args: TeacherArgs) -> None:
    from mopd_hpc.engines.teacher_main import serve

    stop = asyncio.Event()
    watcher = asyncio.create_task(stop_on_job_end(role.run_dir, role.job_id, stop))
    try:
        await serve(args, stop)
    finally:
        watcher.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    environ = dict(os.environ)
    role, cfg = start_server_role(environ)
    asyncio.run(run(role, teacher_args(role, cfg, environ)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
