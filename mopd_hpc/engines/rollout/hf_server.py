"""The HF rollout server: SGLang 0.5.23's HTTP surface for RL over a transformers model (DESIGN.md §5).

Run:  python -m mopd_hpc.engines.rollout.hf_server --model PATH --host 127.0.0.1 --port N
      [--device cpu|cuda] [--dtype auto|float32|bfloat16|float16] [--ready-file PATH] [--token-file PATH]

The port comes from `--port` or, under the guard, from the named port in env `MOPD_PORT_HTTP`. When the
server listens it writes the ready file (atomically; JSON {url, host, port, pid, model_path}) and logs
"rollout server ready". Every endpoint but the bare liveness probe `GET /health` requires the token
(`Authorization: Bearer`, `runtime/http_auth.py`): a job's rollout child passes the job's; `main` reads
`--token-file` (created with a new token when missing; none given: a new file in a private temporary
directory) and logs its path. Endpoints (shapes: ../shared/reference/algo_awex.md §3.2):

  GET  /health /health_generate      200 once the model is loaded (empty body)
  GET  /model_info /get_model_info   model_path, weight_version, architectures, ...
  GET  /server_info                  arguments and internal state (paused, queue sizes, released tags)
  POST /generate                     input_ids | text, sampling_params, return_logprob, logprob_start_len
  POST /pause_generation {mode}      abort (default) | retract | in_place;  POST /continue_generation
  GET|POST /release_memory_occupation, /resume_memory_occupation {tags}
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
  POST /update_weights_from_disk {model_path, weight_version?};  GET|POST /flush_cache
  POST /awex/init {inference_config}, /awex/update_weights {step}   AWEX reader (`awex_routes.py`)
  POST /update_weights_from_ipc {buffers, tensors, weight_version}; /get_weights_by_name {name}
                                     shared-buffer updates of a colocated actor (`ipc_routes.py`)

Errors are JSON {"success": false, "message", "error": {"message", "type", "code"}}: 400 for a bad
request (field, value, expectation), 409 when the engine is busy, 503 while weights are released, 500 for
a bug (the server keeps serving); see `http_app.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.engines.rollout.awex_routes import AwexFactory, add_awex_routes
from mopd_hpc.engines.rollout.control import MEMORY_TAGS
from mopd_hpc.engines.rollout.http_app import RolloutServer
from mopd_hpc.engines.rollout.ipc_routes import add_ipc_routes
from mopd_hpc.engines.rollout.server_args import ServerArgs
from mopd_hpc.engines.serving import start_app
from mopd_hpc.runtime.http_auth import protect, standalone_token

log = logging.getLogger("mopd_hpc.rollout")

#: Files of which at least one must exist for the checkpoint to carry a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, or None when it has none (then requests must send input_ids)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        log.info("no tokenizer files in %s: requests must send input_ids, responses carry text ''", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def rollout_app(
    server: RolloutServer, token: str, *, awex_factory: AwexFactory | None = None
) -> web.Application:
    """The server's aiohttp app as it is served: SGLang's surface (`RolloutServer.app`) plus the AWEX reader's
    routes (`awex_routes.add_awex_routes`; `awex_factory` None = awex_hf's engine, tests pass a fake) and the
    shared-buffer routes (`ipc_routes.add_ipc_routes`), behind
    `token` (`http_auth.protect`)."""
    app = server.app()
    add_awex_routes(app, server.engine, factory=awex_factory)
    add_ipc_routes(app, server.engine)
    return protect(app, token)


async def serve(args: ServerArgs, token: str, stop: asyncio.Event | None = None) -> None:
    """Load the model, listen (every route but the liveness probe requires `token`), write the ready file,
    and serve until `stop` is set (or SIGTERM/SIGINT)."""
    import torch

    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    graph_shape = None
    if args.graph_length is not None:
        graph_shape = (args.graph_rows or args.max_batch_rows, args.graph_length)
    engine = await asyncio.to_thread(
        HFRolloutEngine.load,
        args.model_path,
        args.device,
        args.dtype,
        compile_decode=None if args.compile_decode else False,  # None: on CUDA (static decoder) only
        graph_shape=graph_shape,
    )
    server = RolloutServer(args, engine, await asyncio.to_thread(_load_tokenizer, args.model_path))
    server.scheduler.start()
    runner, port, stop = await start_app(rollout_app(server, token), args.host, args.port, stop)
    url = f"http://{args.host}:{port}"
    if args.ready_file:
        ready = {
            "url": url,
            "host": args.host,
            "port": port,
            "pid": os.getpid(),
            "model_path": args.model_path,
        }
        atomic_write_json(args.ready_file, ready)
    log.info(
        "rollout server ready on %s (model %s, device %s, tags %s)",
        url,
        args.model_path,
        args.device,
        MEMORY_TAGS,
    )
    try:
        await stop.wait()
    finally:
        log.info("rollout server stopping")
        server.scheduler.stop()
        for group in list(server.groups.values()):
            if group is not None:
                group.close()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: reads os.environ once, here, and passes it down."""
    environ = dict(os.environ)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    args = ServerArgs.from_argv(argv, environ)
    token, token_file = standalone_token(args.token_file, None)
    log.info("rollout server token file: %s", token_file)
    asyncio.run(serve(args, token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
