"""`mopd-guard`: run this node's guard for one job in the foreground (what `launchers/` runs under srun).

    mopd-guard --run-dir DIR --job-id ID [--host H] [--bind 127.0.0.1|auto|ADDR] [--port 0]
               [--token-file FILE] [--kill-wait-s 10] [--checkpoint-wait-s 60]
               [--port-range 20000-65535] [--extra-role NAME=MODULE ...] [--allow-env KEY ...]
               [--plan PLAN | --autostart] [--keeper | --no-keeper]

With `--plan run_dir/plan.json` (or `--autostart`, the same with the run dir's plan.json) the guard spawns
its node's children of the job plan and exits when they are done (runtime/guard/autostart.py): 0 when all
exited 0, the first failing child's code otherwise, 0 after USR2/TERM (a requested stop), 130 after SIGINT.
`--bind auto` listens on this node's address (its host name resolved; 127.0.0.1 on the local backend), so
that other nodes reach it; the guard's children bind the same address (MOPD_NODE_ADDR). Binding every
interface takes an explicit `--bind 0.0.0.0`.

The token is read from `--token-file` (mode 0600; default `$MOPD_SECRET_FILE`, else
`<run-dir>/guard.token`), never from argv or the environment. `--host` defaults to `$SLURMD_NODENAME`.
The environment is read here, at the edge, and handed to the guard (children inherit it).
`--allow-env KEY` lets a spawn set env KEY besides `MOPD_*` and the policy's own list
(runtime/guard/env_policy.py); a loader or interpreter key (LD_*, PYTHON*, PATH, ...) is refused (exit 2).
With a plan (every job's guard; `--keeper` for a bare one) the process started forks: the guard runs in
the child, the parent execs the keeper (runtime/guard/keeper.py: a subreaper that forwards signals, kills
whatever the guard leaves behind, even after a SIGKILL of the guard, and exits as the guard did);
`guards/<host>.json` records the guard's own pid.
The guard takes the run dir's lock (runtime/run_lock.py) before it serves: a guard of another job on the
same run dir exits 3 naming the job that holds it; a guard of the same job joins.
Exit codes: 0 clean teardown, 2 bad arguments (or a plan that does not fit this node), 3 the guard could
not start (token file, port lease), 4 a child of the plan could not be spawned.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from mopd_hpc.records.job_token import GuardAuthError, read_token_file
from mopd_hpc.records.run_dir import PLAN_FILE, TOKEN_FILE
from mopd_hpc.runtime import child_env, run_lock
from mopd_hpc.runtime.guard.autostart import NodeAssignment, assign_node, run_plan, visible_gpus
from mopd_hpc.runtime.guard.events import events_path
from mopd_hpc.runtime.guard.fork_server import FORK_ROLES, PRELOAD_MODULES
from mopd_hpc.runtime.guard.keeper import fork_guard
from mopd_hpc.runtime.guard.proctree import set_child_subreaper
from mopd_hpc.runtime.guard.roles import RoleRegistry, parse_extra_roles
from mopd_hpc.runtime.guard.server import Guard, GuardConfig, GuardConfigError
from mopd_hpc.runtime.node_address import LOOPBACK, NodeAddressError, node_address
from mopd_hpc.runtime.plan import JobPlan, PlanError
from mopd_hpc.runtime.ports import DEFAULT_LEASE_RANGE, LeasePolicy, PortLeaseError, read_ephemeral_range
from mopd_hpc.runtime.run_lock import RunDirLockedError
from mopd_hpc.runtime.signals import EXIT_GUARD_START_FAILED, EXIT_USAGE
from mopd_hpc.runtime.topology import TopologyError

#: Slurm's name for this node (several slurmd may share one host in a test cluster).
NODENAME_ENV = "SLURMD_NODENAME"
#: `--bind` value: listen on this node's own address.
BIND_AUTO = "auto"

HELP = "run this node's guard (port leases, authenticated spawn/kill/status of role children)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", required=True, help="the job's run directory (logs, events, guards/)")
    parser.add_argument("--job-id", required=True, help="the job id (owner of this guard's port leases)")
    parser.add_argument(
        "--host",
        default=None,
        help="this node's name in file names (default: $SLURMD_NODENAME, else hostname)",
    )
    parser.add_argument(
        "--bind",
        default="127.0.0.1",
        help="address the HTTP API listens on; 'auto': this node's address (other nodes reach it)",
    )
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: lease one)")
    parser.add_argument(
        "--token-file",
        default=None,
        help=f"0600 token file (default: ${child_env.SECRET_FILE}, else <run-dir>/{TOKEN_FILE})",
    )
    parser.add_argument("--kill-wait-s", type=float, default=10.0, help="SIGTERM→SIGKILL wait, seconds")
    parser.add_argument(
        "--checkpoint-wait-s", type=float, default=60.0, help="wait after USR2 before teardown, seconds"
    )
    parser.add_argument(
        "--port-range",
        default=f"{DEFAULT_LEASE_RANGE[0]}-{DEFAULT_LEASE_RANGE[1]}",
        help="lease search range LO-HI (the kernel's ephemeral range is always cut out)",
    )
    parser.add_argument(
        "--extra-role", action="append", default=[], metavar="NAME=MODULE", help="register another role"
    )
    parser.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="KEY",
        help=f"let a spawn set env KEY besides {child_env.PREFIX}* and runtime/guard/env_policy.py's ALLOWED_KEYS",
    )
    parser.add_argument(
        "--keeper",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run under a keeper process that kills what the guard leaves behind (default: with a plan)",
    )
    parser.add_argument(
        "--exec-children",
        action="store_true",
        help="start every child as a new interpreter (default: the actor, teacher and rollout fork from a "
        "server that imported torch and transformers once: runtime/guard/fork_server.py)",
    )
    parser.add_argument(
        "--fork-role",
        action="append",
        default=[],
        metavar="NAME",
        help="also fork the children of role NAME from the fork server (an --extra-role whose module imports "
        "what --preload names)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="what the fork server imports, instead of runtime/guard/fork_server.py's PRELOAD_MODULES",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    plan = parser.add_mutually_exclusive_group()
    plan.add_argument(
        "--plan", default=None, help="job plan (plan.json): spawn this node's children, exit after"
    )
    plan.add_argument("--autostart", action="store_true", help=f"--plan <run-dir>/{PLAN_FILE}")


def resolve_bind(bind: str, host: str, backend: str) -> str:
    """The address to listen on: `bind` as given, or for 'auto' the IPv4 address `host` resolves to
    (127.0.0.1 on the local backend; `runtime/node_address.py`). Raises ValueError naming the host when it
    does not resolve."""
    if bind != BIND_AUTO:
        return bind
    if backend == "local":
        return LOOPBACK
    try:
        return node_address(host)
    except NodeAddressError as exc:
        raise ValueError(f"--bind auto: {exc}") from None


def load_assignment(args: argparse.Namespace, env: dict[str, str]) -> NodeAssignment | None:
    """This guard's children from `--plan`/`--autostart`, or None without them.

    Raises:
        PlanError: the plan is unreadable or does not fit this node. TopologyError: no valid topology.
    """
    path = args.plan or (os.path.join(args.run_dir, PLAN_FILE) if args.autostart else None)
    if path is None:
        return None
    return assign_node(JobPlan.load(path), env)


def build_config(args: argparse.Namespace, env: dict[str, str], ephemeral: tuple[int, int]) -> GuardConfig:
    """The guard's config from parsed arguments. Raises ValueError naming the bad argument."""
    lo, sep, hi = args.port_range.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise ValueError(f"--port-range {args.port_range!r} is invalid: expected LO-HI, e.g. 20000-65535")
    host = args.host or env.get(NODENAME_ENV) or socket.gethostname()
    backend = env.get(child_env.BACKEND) or ("slurm" if env.get("SLURM_JOB_ID") else "local")
    return GuardConfig.create(
        args.run_dir,
        args.job_id,
        host,
        lease_policy=LeasePolicy.create(ephemeral, int(lo), int(hi)),
        base_env=env,
        bind=resolve_bind(args.bind, host, backend),
        port=args.port,
        kill_wait_s=args.kill_wait_s,
        checkpoint_wait_s=args.checkpoint_wait_s,
        roles=RoleRegistry.create(parse_extra_roles(args.extra_role)),
        site_env_keys=frozenset(args.allow_env),
        fork_roles=fork_roles(args),
        preload=tuple(args.preload) or PRELOAD_MODULES,
    )


def fork_roles(args: argparse.Namespace) -> frozenset[str]:
    """The roles whose children fork (fork_server.py). Raises ValueError for --fork-role with --exec-children."""
    if args.exec_children and args.fork_role:
        raise ValueError(
            "--fork-role needs the fork server, which --exec-children turns off: drop one of them"
        )
    return frozenset() if args.exec_children else FORK_ROLES | frozenset(args.fork_role)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s guard %(message)s")
    env = dict(os.environ)
    try:
        config = build_config(args, env, read_ephemeral_range())
        assignment = load_assignment(args, env)
        visible = visible_gpus(env) if assignment is not None else ()
    except (ValueError, GuardConfigError, PlanError, TopologyError) as exc:
        print(f"mopd-guard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    token_file = (
        args.token_file or os.environ.get(child_env.SECRET_FILE) or os.path.join(config.run_dir, TOKEN_FILE)
    )
    try:
        token = read_token_file(token_file)
    except GuardAuthError as exc:
        print(f"mopd-guard: {exc}", file=sys.stderr)
        return EXIT_GUARD_START_FAILED
    try:  # one job per run dir: taken (or joined, by a guard of the same job) before anything starts
        lock = run_lock.acquire(
            config.run_dir, config.job_id, config.host
        ).inheritable()  # the keeper keeps it
    except (RunDirLockedError, OSError) as exc:
        print(f"mopd-guard: {exc}", file=sys.stderr)
        return EXIT_GUARD_START_FAILED
    if lock.unsupported:
        print(
            f"mopd-guard: warning: {config.run_dir} is on a file system without flock: no run-dir lock",
            file=sys.stderr,
        )
    if args.keeper if args.keeper is not None else assignment is not None:
        events = (str(events_path(config.run_dir, config.host)), config.host)  # the keeper records our end
        fork_guard(config.kill_wait_s, events=events)  # from here on this is the guard; its parent the keeper
    else:
        set_child_subreaper()  # orphans of the children's trees stay the guard's to find (proctree.py)
    return asyncio.run(_serve(config, token, assignment, visible))


async def _serve(
    config: GuardConfig, token: str, assignment: NodeAssignment | None = None, visible: tuple[str, ...] = ()
) -> int:
    guard = Guard(config, token)
    try:
        await guard.start()
    except (PortLeaseError, OSError) as exc:
        print(
            f"mopd-guard: cannot serve on {config.bind}:{config.port or 'a leased port'}: {exc}",
            file=sys.stderr,
        )
        guard.leaser.close()
        return EXIT_GUARD_START_FAILED
    if assignment is None:
        return await guard.wait_stopped()
    rc = await run_plan(guard, assignment, visible)
    await guard.wait_stopped()
    # Done: a late TERM/USR2 (srun's --kill-on-bad-exit, the batch shell's forwarding) must not turn this
    # exit code into 143 after the loop restores the default handlers (srun reports the highest task code).
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGUSR2):
        loop.remove_signal_handler(signum)
        signal.signal(signum, signal.SIG_IGN)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mopd-guard", description=__doc__.splitlines()[0] if __doc__ else HELP
    )
    add_arguments(parser)
    return run(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    raise SystemExit(main())
