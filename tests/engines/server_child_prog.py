"""A server child of the guard tests (role `servechild`, `python -m server_child_prog`); it holds no tests.

What a job's server child does, with the project's own parts: the guard-given environment (`RoleEnv`), the
job's token (`read_job_token`), an app behind it (`protect`) served by `start_app` on `RoleEnv.bind_host` and
the named port `http`. Once it listens it writes `run_dir/endpoints/servechild-<index>.json` ({node_addr,
bind_host, advertise_host, port}); it serves `GET /hello` until SIGTERM.
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.engines.serving import start_app
from mopd_hpc.records.run_dir import endpoint_file
from mopd_hpc.roles.env import RoleEnv, read_job_token
from mopd_hpc.runtime.http_auth import protect


async def serve(role: RoleEnv, token: str) -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": role.index})

    app = web.Application()
    app.router.add_get("/hello", hello)
    runner, port, stop = await start_app(protect(app, token), role.bind_host, role.port("http"))
    record = {
        "node_addr": role.node_addr,
        "bind_host": role.bind_host,
        "advertise_host": role.advertise_host,
        "port": port,
    }
    path = endpoint_file(role.run_dir, role.role, str(role.index))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> int:
    role = RoleEnv.from_env(dict(os.environ))
    asyncio.run(serve(role, read_job_token(role)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
