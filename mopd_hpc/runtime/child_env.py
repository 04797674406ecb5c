"""Every `MOPD_*` environment variable of the package, named here and nowhere else: what the guard and the job
plan set for a guard child, and the knobs the launchers, the standalone servers and the tests set.

Writers: the guard (`runtime/guard/children.py`: the identity keys, named ports, CUDA_VISIBLE_DEVICES), the
job plan (`plan/placement.py`: each child's rank variables and role specifics; `runtime/plan.py
child_environment`: backend, het group and size, transfer ranks, base GPU). Readers: `RankTopology.from_env`
(`runtime/topology_env.py`), the role environment (`roles/env.py` `RoleEnv`, its device
`runtime/child_device.py`), the probe, the rank map. Every other module uses these constants: a test
(tests/runtime/test_child_env_names.py) checks that the names appear as string literals in this module only.

    identity (guard)   MOPD_ROLE MOPD_INDEX MOPD_GENERATION MOPD_JOB_ID MOPD_RUN_DIR MOPD_HOST
    address (guard)    MOPD_NODE_ADDR     the address the guard binds (the child's servers and rendezvous too)
    ports (guard)      MOPD_PORT_<NAME>   one per named port lease (`port_env_name`)
    ranks (plan)       MOPD_RANK MOPD_WORLD_SIZE MOPD_LOCAL_RANK MOPD_LOCAL_WORLD_SIZE
    role (plan)        MOPD_TEACHER_ID MOPD_TEACHER_REPLICA (teacher), MOPD_ROLLOUT_TP (rollout), MOPD_PLAN_ROLE MOPD_PLAN_INDEX (a
                       probe standing in for another role)
    node (plan)        MOPD_BACKEND ("slurm" | "local") MOPD_HET_GROUP MOPD_HET_SIZE MOPD_TRANSFER_RANKS
                       (comma-separated) MOPD_BASE_GPU_ID (the device ordinal a child starts at, when not its first)

The knobs (`KNOB_NAMES`), each read once at the edge by the module named:

    launch             MOPD_SECRET_FILE    the token file's path, as launchers/node.sh exports it (cli/guard.py)
                       MOPD_SUBMIT_DIR     the directory relative model paths are relative to (roles/env.py)
    local backend      MOPD_HOSTNAME       the host name (default socket.gethostname(); runtime/topology_env.py)
    roles              MOPD_ACTOR_THREADS  the actor's torch threads (roles/actor.py)
                       MOPD_ENDPOINT_TIMEOUT_S  the deadline for every server to be up (roles/endpoints.py)
    probe (tests)      MOPD_PROBE_ENV_KEYS MOPD_PROBE_HOLD_S MOPD_PROBE_EXIT_CODE MOPD_PROBE_EXIT_HET_GROUP
                       (roles/probe.py)
    standalone servers MOPD_MODEL_PATH MOPD_BIND_HOST MOPD_DEVICE MOPD_DTYPE MOPD_TEACHER_ENGINE (the teacher
                       server, roles/teacher.py); MOPD_ROLLOUT_READY_FILE MOPD_ROLLOUT_MODEL MOPD_ROLLOUT_DEVICE
                       (the HF rollout server, engines/rollout/server_args.py)

A spawn's overrides may set any variable of the family (`PREFIX`, runtime/guard/env_policy.py) but the identity.
"""

from __future__ import annotations

#: The family: every variable below starts with it.
PREFIX = "MOPD_"

#: Identity: the guard sets them for every child; neither a spawn's overrides nor the plan may set them.
ROLE = "MOPD_ROLE"
INDEX = "MOPD_INDEX"
GENERATION = "MOPD_GENERATION"
JOB_ID = "MOPD_JOB_ID"
RUN_DIR = "MOPD_RUN_DIR"
HOST = "MOPD_HOST"
IDENTITY_KEYS: tuple[str, ...] = (ROLE, INDEX, GENERATION, JOB_ID, RUN_DIR, HOST)
#: The address the guard listens on (`runtime/node_address.py`); set for every child, like the identity.
NODE_ADDR = "MOPD_NODE_ADDR"
#: Every key the guard sets for every child besides the named ports.
GUARD_KEYS: tuple[str, ...] = (*IDENTITY_KEYS, NODE_ADDR)

#: Named port `<name>` reaches a child as `MOPD_PORT_<NAME>` (the guard sets one per lease).
PORT_PREFIX = "MOPD_PORT_"

#: The plan's rank variables: what `RankTopology.from_env` takes a guard child's ranks from.
RANK = "MOPD_RANK"
WORLD_SIZE = "MOPD_WORLD_SIZE"
LOCAL_RANK = "MOPD_LOCAL_RANK"
LOCAL_WORLD_SIZE = "MOPD_LOCAL_WORLD_SIZE"

#: Role specifics the plan sets.
TEACHER_ID = "MOPD_TEACHER_ID"
#: The replica (scoring server) of that teacher a teacher child belongs to: 0 .. replicas − 1.
TEACHER_REPLICA = "MOPD_TEACHER_REPLICA"
ROLLOUT_TP = "MOPD_ROLLOUT_TP"
PLAN_ROLE = "MOPD_PLAN_ROLE"
PLAN_INDEX = "MOPD_PLAN_INDEX"

#: What `child_environment` adds for every child of a plan.
BACKEND = "MOPD_BACKEND"
HET_GROUP = "MOPD_HET_GROUP"
HET_SIZE = "MOPD_HET_SIZE"
TRANSFER_RANKS = "MOPD_TRANSFER_RANKS"
BASE_GPU_ID = "MOPD_BASE_GPU_ID"

#: Every variable above (the port family by its prefix), in the order of the module docstring.
CHILD_ENV_NAMES: tuple[str, ...] = (
    *IDENTITY_KEYS,
    NODE_ADDR,
    PORT_PREFIX,
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    TEACHER_ID,
    TEACHER_REPLICA,
    ROLLOUT_TP,
    PLAN_ROLE,
    PLAN_INDEX,
    BACKEND,
    HET_GROUP,
    HET_SIZE,
    TRANSFER_RANKS,
    BASE_GPU_ID,
)


#: The knobs of the module docstring's second table.
SECRET_FILE = "MOPD_SECRET_FILE"
SUBMIT_DIR = "MOPD_SUBMIT_DIR"
HOSTNAME = "MOPD_HOSTNAME"
ACTOR_THREADS = "MOPD_ACTOR_THREADS"
ENDPOINT_TIMEOUT_S = "MOPD_ENDPOINT_TIMEOUT_S"
#: Comma-separated names of extra variables the probe reports verbatim.
PROBE_ENV_KEYS = "MOPD_PROBE_ENV_KEYS"
#: Test knobs of the probe: hold after writing (seconds); exit code; the het group the exit code applies to.
PROBE_HOLD_S = "MOPD_PROBE_HOLD_S"
PROBE_EXIT_CODE = "MOPD_PROBE_EXIT_CODE"
PROBE_EXIT_HET_GROUP = "MOPD_PROBE_EXIT_HET_GROUP"
#: The standalone teacher server's settings (roles/teacher.py `ENV`).
MODEL_PATH = "MOPD_MODEL_PATH"
BIND_HOST = "MOPD_BIND_HOST"
DEVICE = "MOPD_DEVICE"
DTYPE = "MOPD_DTYPE"
TEACHER_ENGINE = "MOPD_TEACHER_ENGINE"
#: The HF rollout server's settings (engines/rollout/server_args.py `ENV`).
ROLLOUT_READY_FILE = "MOPD_ROLLOUT_READY_FILE"
ROLLOUT_MODEL = "MOPD_ROLLOUT_MODEL"
ROLLOUT_DEVICE = "MOPD_ROLLOUT_DEVICE"

#: Every knob, in the order of the module docstring's second table.
KNOB_NAMES: tuple[str, ...] = (
    SECRET_FILE,
    SUBMIT_DIR,
    HOSTNAME,
    ACTOR_THREADS,
    ENDPOINT_TIMEOUT_S,
    PROBE_ENV_KEYS,
    PROBE_HOLD_S,
    PROBE_EXIT_CODE,
    PROBE_EXIT_HET_GROUP,
    MODEL_PATH,
    BIND_HOST,
    DEVICE,
    DTYPE,
    TEACHER_ENGINE,
    ROLLOUT_READY_FILE,
    ROLLOUT_MODEL,
    ROLLOUT_DEVICE,
)


def port_env_name(name: str) -> str:
    """The variable of named port `name`: `"dist_init"` → `"MOPD_PORT_DIST_INIT"`."""
    return PORT_PREFIX + name.upper()


def port_name(key: str) -> str | None:
    """The port name a variable carries (`"MOPD_PORT_HTTP"` → `"http"`), None for any other variable."""
    return key[len(PORT_PREFIX) :].lower() if key.startswith(PORT_PREFIX) else None
