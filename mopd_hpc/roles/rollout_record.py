"""The rollout engine's endpoint record, `run_dir/endpoints/rollout-<index>.json`: one writer for every
rollout backend (roles/rollout.py's hf server, roles/rollout_sglang.py's sglang engine).

The record is records/endpoint.py's `EndpointRecord` (role "rollout": index, backend "hf" | "sglang"), written
atomically once the server answers; removed by the server on its way out.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mopd_hpc.records.endpoint import EndpointRecord
from mopd_hpc.records.run_dir import endpoint_file
from mopd_hpc.roles.env import RoleEnv

log = logging.getLogger("mopd_hpc.rollout")


def rollout_endpoint(role: RoleEnv) -> Path:
    """This engine's endpoint record path."""
    return endpoint_file(role.run_dir, "rollout", str(role.index))


def publish_rollout_endpoint(role: RoleEnv, port: int, model_path: str, backend: str) -> EndpointRecord:
    """Write this engine's record (records/endpoint.py); returns it."""
    record = EndpointRecord.rollout(
        role.index,
        host=role.advertise_host,
        port=port,
        pid=os.getpid(),
        job_id=role.job_id,
        model_path=model_path,
        backend=backend,
    )
    record.write(role.run_dir)
    log.info("rollout engine %d (%s) published at %s", role.index, backend, record.url)
    return record
