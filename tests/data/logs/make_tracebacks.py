"""Write real Python tracebacks (real exceptions, printed by the interpreter's traceback module) to OUT_DIR.

usage: python make_tracebacks.py OUT_DIR

One `<scenario>.err` per scenario: address_in_use (two real binds of one port), cuda_oom (torch.OutOfMemoryError
with torch's message), nccl_rank<N> for N in 0..7 (torch.distributed.DistBackendError, the watchdog's message,
different rank/pid/time per file), tokenizer (mopd_hpc's TokenizerMismatchError), config (a real ConfigError from
loading configs/local_cpu.yaml with a bad override), value_error (a plain ValueError).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path

OUT = Path(sys.argv[1])
REPO = Path(__file__).resolve().parents[3]


def _write(name: str, fn) -> None:
    with open(OUT / f"{name}.err", "w", encoding="utf-8") as fh:
        fh.write(f"INFO starting {name} pid={os.getpid()}\n")
        try:
            fn()
        except BaseException:  # noqa: BLE001 - every scenario's exception is printed as Python would
            traceback.print_exc(file=fh)


def start_http_server(port: int) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", port))
    finally:
        server.close()
        holder.close()


def address_in_use() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    start_http_server(port)


def cuda_oom() -> None:
    import torch

    def allocate_logits() -> None:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "3.12 GiB is free. Including non-PyTorch memory, this process has 136.68 GiB memory in use. Of the "
            "allocated memory 131.02 GiB is allocated by PyTorch, and 4.21 GiB is reserved by PyTorch but "
            "unallocated."
        )

    allocate_logits()


def nccl(rank: int) -> None:
    import torch.distributed as dist

    def all_reduce_grads() -> None:
        raise dist.DistBackendError(
            f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={40 + rank}, "
            f"OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for {600000 + 37 * rank} "
            f"milliseconds before timing out. pid={os.getpid() + rank} at 0x7f{rank:02x}a1b2c3d4"
        )

    all_reduce_grads()


def tokenizer() -> None:
    from mopd_hpc.mopd.compatibility import TokenizerMismatchError

    raise TokenizerMismatchError(
        "teacher 'math' (/models/qwen3-8b) does not share the tokenizer of actor 'student' (/models/llama-1b): "
        "vocab size 151669 != 128256; first differing token id 0: '!' vs '<|begin_of_text|>'"
    )


def config() -> None:
    from mopd_hpc.config.loader import load_run_config

    load_run_config(REPO / "configs" / "local_cpu.yaml", ["loss.no_such_knob=1"])


def value_error() -> None:
    raise ValueError("batch_size=0: expected a positive integer")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    _write("address_in_use", address_in_use)
    _write("cuda_oom", cuda_oom)
    for r in range(8):
        _write(f"nccl_rank{r}", lambda r=r: nccl(r))
    _write("tokenizer", tokenizer)
    _write("config", config)
    _write("value_error", value_error)
