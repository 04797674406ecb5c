"""The run directory's layout: every path a process of the run writes or reads under it, named once, here.

    run_dir/                                        (0700; `launch/rundir.py` creates it)
      config.yaml                                   CONFIG_FILE     the resolved run config (mopd-submit)
      plan.json                                     PLAN_FILE       the job plan (mopd-submit; the guards read it)
      unverified.json                               UNVERIFIED_FILE what allow_unverified let through (mopd-submit)
      guard.token                                   TOKEN_FILE      the guards' secret, mode 0600
      metrics.jsonl                                 METRICS_FILE    one line per step (the actor)
      eval.json                                     EVAL_FILE       held-out evaluations (the actor)
      awex_meta_server.json                         AWEX_META_SERVER_FILE   AWEX's meta server (the actor)
      student_final/                                FINAL_DIR       the trained student, HF format (the actor)
      exports/step_<n>/                             EXPORTS_DIR     periodic HF exports, the last export.keep (the actor)
      checkpoints/step_<n>/, checkpoints/latest     CHECKPOINTS_DIR, LATEST_CHECKPOINT (the actor)
      endpoints/<role>-<key>.json                   `endpoint_file`       a server's endpoint record
      endpoints/teacher-<id>.r<replica>.json        `teacher_endpoint_file`  a teacher replica's record
      endpoints/.rollout-<index>.ready.json         `rollout_ready_file`  the hf rollout server's ready file
      endpoints/actor-rendezvous.json               `actor_rendezvous_file`  the actor group's store address
      endpoints/teacher-<id>.r<replica>-rendezvous.json  `teacher_rendezvous_file`  a TP replica's store address
      logs/                                         LOGS_DIR        batch and step logs (the sbatch script)
      logs/<host>/<role>-<index>.g<gen>.out|.err    `child_log_paths`     a guard child's output
      events/<host>.guard.jsonl                     `guard_events_file`   a guard's event log
      guards/<host>.json                            `guard_record_file`   a guard's address record
      ports/<host>.json                             `ports_record_file`   the ports a node's children leased
      probe/<host>-<role>-<index>.json              `probe_report_file`   a probe child's report
      state/                                        STATE_DIR       records of the batch shell and the actor:
        job.json, first_failure.json, last_signal.json, requeue.json (the batch shell), job_end.json
        (JOB_END_FILE: the actor's end-of-job marker, `records/job_end.py`)
      submit/                                       SUBMIT_DIR      submitit's folder

Names are relative to the run directory (str); the functions take it and return a `Path`. Nothing is created
or read here.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
UNVERIFIED_FILE = "unverified.json"
TOKEN_FILE = "guard.token"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
AWEX_META_SERVER_FILE = "awex_meta_server.json"
FINAL_DIR = "student_final"
EXPORTS_DIR = "exports"
CHECKPOINTS_DIR = "checkpoints"
#: The latest-checkpoint pointer inside CHECKPOINTS_DIR (a symlink, or a file holding the step directory).
LATEST = "latest"
LATEST_CHECKPOINT = f"{CHECKPOINTS_DIR}/{LATEST}"
ENDPOINTS_DIR = "endpoints"
LOGS_DIR = "logs"
EVENTS_DIR = "events"
#: Suffix of a guard's event log in EVENTS_DIR.
EVENTS_SUFFIX = ".guard.jsonl"
GUARDS_DIR = "guards"
PORTS_DIR = "ports"
PROBE_DIR = "probe"
STATE_DIR = "state"
SUBMIT_DIR = "submit"
JOB_FILE = f"{STATE_DIR}/job.json"
JOB_END_FILE = f"{STATE_DIR}/job_end.json"

PathLike = str | os.PathLike[str]


def endpoint_file(run_dir: PathLike, role: str, key: str) -> Path:
    """`run_dir/endpoints/<role>-<key>.json` (teacher: key = teacher id; rollout: key = engine index)."""
    return Path(run_dir) / ENDPOINTS_DIR / f"{role}-{key}.json"


def teacher_endpoint_file(run_dir: PathLike, teacher_id: str, replica: int) -> Path:
    """`run_dir/endpoints/teacher-<id>.r<replica>.json`: the record of replica `replica` of teacher `teacher_id`
    (each replica is a scoring server of its own)."""
    return endpoint_file(run_dir, "teacher", f"{teacher_id}.r{int(replica)}")


def actor_rendezvous_file(run_dir: PathLike) -> Path:
    """`run_dir/endpoints/actor-rendezvous.json`: where actor rank 0's store listens (`trainer/rendezvous.py`)."""
    return Path(run_dir) / ENDPOINTS_DIR / "actor-rendezvous.json"


def teacher_rendezvous_file(run_dir: PathLike, teacher_id: str, replica: int) -> Path:
    """`run_dir/endpoints/teacher-<id>.r<replica>-rendezvous.json`: where the leader of a tensor-parallel teacher
    replica has its store listen (`trainer/rendezvous.py`; the replica's followers read it)."""
    return Path(run_dir) / ENDPOINTS_DIR / f"teacher-{teacher_id}.r{int(replica)}-rendezvous.json"


def rollout_ready_file(run_dir: PathLike, index: int) -> Path:
    """`run_dir/endpoints/.rollout-<index>.ready.json`: where rollout engine `index`'s server says it listens."""
    return Path(run_dir) / ENDPOINTS_DIR / f".rollout-{index}.ready.json"


def child_log_dir(run_dir: PathLike, host: str) -> Path:
    """`run_dir/logs/<host>`: the output of the children of `host`'s guard."""
    return Path(run_dir) / LOGS_DIR / host


def child_log_paths(
    run_dir: PathLike, host: str, role: str, index: int, generation: int
) -> tuple[Path, Path]:
    """`(stdout, stderr)` paths of one child generation: `logs/<host>/<role>-<index>.g<generation>.out|.err`."""
    base = child_log_dir(run_dir, host)
    stem = f"{role}-{index}.g{generation}"
    return base / f"{stem}.out", base / f"{stem}.err"


def guard_events_file(run_dir: PathLike, host: str) -> Path:
    """`run_dir/events/<host>.guard.jsonl`."""
    return Path(run_dir) / EVENTS_DIR / f"{host}{EVENTS_SUFFIX}"


def guard_record_file(run_dir: PathLike, host: str) -> Path:
    """`run_dir/guards/<host>.json`: the address of `host`'s guard."""
    return Path(run_dir) / GUARDS_DIR / f"{host}.json"


def ports_record_file(run_dir: PathLike, host: str) -> Path:
    """`run_dir/ports/<host>.json`: the ports the children of `host` leased."""
    return Path(run_dir) / PORTS_DIR / f"{host}.json"


def probe_report_file(run_dir: PathLike, host: str, role: str, index: int) -> Path:
    """`run_dir/probe/<host>-<role>-<index>.json`."""
    return Path(run_dir) / PROBE_DIR / f"{host}-{role}-{index}.json"
