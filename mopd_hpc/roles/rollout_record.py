"""The rollout engine's endpoint record, `run_dir/endpoints/rollout-<index>.json`: one writer for every
rollout backend (roles/rollout.py's hf server, roles/rollout_sglang.py's sglang engine).

Fields: url, host, port (where the trainer connects: the guard's advertised address), pid, index, job_id (the
trainer accepts only its own job's records: roles/endpoints.py), model_path, backend ("hf" | "sglang").
Written atomically once the server answers; removed by the server on its way out.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import endpoint_file
from mopd_hpc.roles.env import RoleEnv

log = logging.getLogger("mopd_hpc.rollout")


def rollout_endpoint(role: RoleEnv) -> Path:
    """This engine's endpoint record path."""
    return endpoint_file(role.run_dir, "rollout", str(role.index))


def publish_rollout_endpoint(role: RoleEnv, port: int, model_path: str, backend: str) -> dict[str, object]:
    """Write this engine's record (module docstring); returns it."""
    record: dict[str, object] = {
        "url": f"http://{role.advertise_host}:{port}",
        "host": role.advertise_host,
        "port": port,
        "pid": os.getpid(),
        "index": role.index,
        "job_id": role.job_id,
        "model_path": model_path,
        "backend": backend,
    }
    atomic_write_json(rollout_endpoint(role), record)
    log.info("rollout engine %d (%s) published at %s", role.index, backend, record["url"])
    return record
