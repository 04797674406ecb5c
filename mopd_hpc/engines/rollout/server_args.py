"""The command line of the HF rollout server (`hf_server.py`), resolved: `ServerArgs.from_argv(argv, environ)`.

Each flag not given falls back to its variable of `ENV`; the guard passes the port as the named port `http`
(`MOPD_PORT_HTTP`, `runtime/child_env.py`). The HTTP handlers (`http_app.py`) read the record too.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mopd_hpc.engines.serving import cli_port
from mopd_hpc.runtime import child_env

#: The server's one-line description (`--help`).
DESCRIPTION = (
    "The HF rollout server: SGLang 0.5.23's HTTP surface for RL over a transformers model (DESIGN.md §5)."
)
#: Environment variables read (once, in `main`) at the edge.
ENV = {
    "port": child_env.port_env_name("http"),
    "ready_file": child_env.ROLLOUT_READY_FILE,
    "model_path": child_env.ROLLOUT_MODEL,
    "device": child_env.ROLLOUT_DEVICE,
}


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """Command line of the server, resolved. Build with `ServerArgs.from_argv(argv, environ)`.

    `token_file` is the path of the standalone server's token (`main` reads it; never the token itself: the
    record is shown by /server_info)."""

    model_path: str
    host: str
    port: int
    device: str = "cpu"
    dtype: str = "auto"
    max_batch_rows: int = 64
    graph_rows: int | None = None
    graph_length: int | None = None
    compile_decode: bool = True
    random_seed: int = 0
    ready_file: str | None = None
    num_threads: int | None = None
    weight_sync_timeout_s: float = 600.0
    token_file: str | None = None

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None, environ: Mapping[str, str]) -> ServerArgs:
        """Parse `argv`; a flag not given falls back to its variable of `ENV` in `environ`.

        Exits with status 2 (argparse) naming the flag or variable when the model path or port is missing
        or malformed.
        """
        p = argparse.ArgumentParser(
            prog="python -m mopd_hpc.engines.rollout.hf_server", description=DESCRIPTION
        )
        p.add_argument(
            "--model", "--model-path", dest="model_path", help=f"HF checkpoint dir (env {ENV['model_path']})"
        )
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        p.add_argument("--port", type=int, default=None, help=f"TCP port, 0 = any (env {ENV['port']})")
        p.add_argument(
            "--device", default=None, help=f"cpu | cuda | cuda:N (env {ENV['device']}; default cpu)"
        )
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        p.add_argument("--max-batch-rows", type=int, default=64, help="rows decoded together at most")
        p.add_argument("--graph-rows", type=int, default=None, help="CUDA: rows of --graph-length's shape")
        p.add_argument(
            "--graph-length",
            type=int,
            default=None,
            help="CUDA: the KV-cache slots every compiled batch of at most --graph-rows rows is padded to, with "
            "that many rows (one compilation for every batch that fits; hf_engine.HFRolloutEngine graph_shape)",
        )
        p.add_argument(
            "--no-compile-decode",
            dest="compile_decode",
            action="store_false",
            help="CUDA: decode eagerly (default: the decode step compiled into CUDA graphs)",
        )
        p.add_argument("--random-seed", type=int, default=0, help="seeds rows that carry no sampling_seed")
        p.add_argument(
            "--ready-file", default=None, help=f"JSON written when listening (env {ENV['ready_file']})"
        )
        p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        p.add_argument("--weight-sync-timeout-s", type=float, default=600.0, help="collective timeout, s")
        p.add_argument(
            "--token-file",
            default=None,
            help="0600 file of the token every route but /health requires (created when missing; "
            "default: a new one in a private temporary directory)",
        )
        ns = p.parse_args(argv)
        model_path = ns.model_path or environ.get(ENV["model_path"])
        if not model_path:
            p.error(f"no model: pass --model or set {ENV['model_path']}")
        port = cli_port(p, ns.port, environ, ENV["port"])
        return cls(
            **vars(ns)
            | {
                "model_path": model_path,
                "port": port,
                "device": ns.device or environ.get(ENV["device"]) or "cpu",
                "ready_file": ns.ready_file or environ.get(ENV["ready_file"]),
            }
        )
