"""`mopd-guard`: run this node's guard for one job in the foreground (what `launchers/` runs under srun).

    mopd-guard --run-dir DIR --job-id ID [--host H] [--bind 127.0.0.1] [--port 0]
               [--token-file FILE] [--kill-wait-s 10] [--checkpoint-wait-s 60]
               [--port-range 20000-65535] [--extra-role NAME=MODULE ...]

The token is read from `--token-file` (mode 0600; default `$MOPD_SECRET_FILE`, else
`<run-dir>/guard.token`), never from argv or the environment. `--host` defaults to `$SLURMD_NODENAME`.
The environment is read here, at the edge, and handed to the guard (children inherit it).
Exit codes: 0 clean teardown, 2 bad arguments, 3 the guard could not start (token file, port lease).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence

from mopd_hpc.runtime.guard.auth import TOKEN_FILE_NAME, GuardAuthError, read_token_file
from mopd_hpc.runtime.guard.roles import RoleRegistry, parse_extra_roles
from mopd_hpc.runtime.guard.server import Guard, GuardConfig, GuardConfigError
from mopd_hpc.runtime.ports import DEFAULT_LEASE_RANGE, LeasePolicy, PortLeaseError, read_ephemeral_range
from mopd_hpc.runtime.signals import EXIT_GUARD_START_FAILED, EXIT_USAGE

#: The token file's path as `launchers/node.sh` exports it (a path, never the token).
SECRET_FILE_ENV = "MOPD_SECRET_FILE"
#: Slurm's name for this node (several slurmd may share one host in a test cluster).
NODENAME_ENV = "SLURMD_NODENAME"

HELP = "run this node's guard (port leases, authenticated spawn/kill/status of role children)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", required=True, help="the job's run directory (logs, events, guards/)")
    parser.add_argument("--job-id", required=True, help="the job id (owner of this guard's port leases)")
    parser.add_argument(
        "--host",
        default=None,
        help="this node's name in file names (default: $SLURMD_NODENAME, else hostname)",
    )
    parser.add_argument("--bind", default="127.0.0.1", help="address the HTTP API listens on")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: lease one)")
    parser.add_argument(
        "--token-file",
        default=None,
        help=f"0600 token file (default: ${SECRET_FILE_ENV}, else <run-dir>/{TOKEN_FILE_NAME})",
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
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_config(args: argparse.Namespace, env: dict[str, str], ephemeral: tuple[int, int]) -> GuardConfig:
    """The guard's config from parsed arguments. Raises ValueError naming the bad argument."""
    lo, sep, hi = args.port_range.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise ValueError(f"--port-range {args.port_range!r} is invalid: expected LO-HI, e.g. 20000-65535")
    return GuardConfig.create(
        args.run_dir,
        args.job_id,
        args.host or env.get(NODENAME_ENV) or socket.gethostname(),
        lease_policy=LeasePolicy.create(ephemeral, int(lo), int(hi)),
        base_env=env,
        bind=args.bind,
        port=args.port,
        kill_wait_s=args.kill_wait_s,
        checkpoint_wait_s=args.checkpoint_wait_s,
        roles=RoleRegistry.create(parse_extra_roles(args.extra_role)),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s guard %(message)s")
    try:
        config = build_config(args, dict(os.environ), read_ephemeral_range())
    except (ValueError, GuardConfigError) as exc:
        print(f"mopd-guard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    token_file = (
        args.token_file or os.environ.get(SECRET_FILE_ENV) or os.path.join(config.run_dir, TOKEN_FILE_NAME)
    )
    try:
        token = read_token_file(token_file)
    except GuardAuthError as exc:
        print(f"mopd-guard: {exc}", file=sys.stderr)
        return EXIT_GUARD_START_FAILED
    return asyncio.run(_serve(config, token))


async def _serve(config: GuardConfig, token: str) -> int:
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
    return await guard.wait_stopped()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mopd-guard", description=__doc__.splitlines()[0] if __doc__ else HELP
    )
    add_arguments(parser)
    return run(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    raise SystemExit(main())
