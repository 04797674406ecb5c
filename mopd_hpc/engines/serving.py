"""Start an aiohttp server for a child process (teacher, rollout): bind, learn the port, stop on TERM/INT.

One place for what every server child does the same way; its own readiness record stays with each server.
It serves only apps that require the job's token (`runtime/http_auth.protect`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Mapping

from aiohttp import web

from mopd_hpc.engines.frames.over_http import READ_BUFSIZE
from mopd_hpc.runtime.http_auth import is_protected
from mopd_hpc.runtime.http_limits import DEFAULT_LIMITS, HttpLimits, serve_runner


async def start_app(
    app: web.Application,
    host: str,
    port: int,
    stop: asyncio.Event | None = None,
    limits: HttpLimits = DEFAULT_LIMITS,
) -> tuple[web.AppRunner, int, asyncio.Event]:
    """Serve `app` on (host, port) and return (runner, the bound port, the stop event); the header-read
    and connection bounds of `limits` apply (runtime/http_limits.py).

    Args:
        port: the port to bind; 0 lets the kernel choose (the returned port says which).
        stop: set by the caller to stop; a new event when None. SIGTERM and SIGINT set it too.
    Raises:
        ValueError: `app` has no token check (build it with `runtime.http_auth.protect(app, token)`).
        OSError: the address cannot be bound (e.g. EADDRINUSE); nothing is left listening.
    """
    if not is_protected(app):
        raise ValueError(
            "the app has no token check: every server of the job requires the job's token; "
            "build it with mopd_hpc.runtime.http_auth.protect(app, token)"
        )
    # large frame bodies: few pauses
    runner = await serve_runner(app, limits, access_log=None, read_bufsize=READ_BUFSIZE)
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return runner, bound_port, stop


def cli_port(
    parser: argparse.ArgumentParser, flag: int | None, environ: Mapping[str, str], env_name: str
) -> int:
    """A standalone server's TCP port: `--port` (`flag`), else the variable `env_name` of `environ`; exits
    through `parser.error` (status 2) naming the flag or variable when it is missing, not a number, or not
    in [0, 65535] (0 = the kernel chooses)."""
    port = flag
    if port is None:
        raw = environ.get(env_name)
        if raw is None:
            parser.error(f"no port: pass --port or set {env_name}")
        try:
            port = int(raw)
        except ValueError:
            parser.error(f"{env_name}={raw!r}: expected a TCP port number")
    if not 0 <= port <= 65535:
        parser.error(f"port={port}: expected a TCP port in [0, 65535]")
    return port
