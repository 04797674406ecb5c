"""Actor → rollout weight sync on two GPUs (issue 8): the NCCL path of `TorchBroadcastSender` and the AWEX
path (awex 0.9.0's NCCL writer on a Megatron actor → `awex_hf` reader in the HF engine), against the NCCL
broadcast bandwidth measured in the same run.

    python benchmarks/weight_sync.py               # 2 GPUs; writes benchmarks/results/weight_sync.json
    python benchmarks/weight_sync.py --methods awex --sizes 0.6b

Setup per size (Qwen3 shapes ~0.6B and ~1.7B, bf16, random weights: `gpu_models.make_checkpoint`, seed 0):
the actor holds the model on GPU 0; an HF rollout server (`python -m mopd_hpc.engines.rollout.hf_server`,
CUDA_VISIBLE_DEVICES=1) serves the same architecture on GPU 1. One sync = POST /update_weights_from_distributed while rank 0 broadcasts every
tensor (flattened per dtype) and the server loads them into its model.

AWEX (method "awex"): a writer process (GPU 0: `MegatronTrainEngine` built from the checkpoint,
`AwexActorPublisher`, the MetaServer) and a reader process (GPU 1: `HFRolloutEngine` + `hf_awex_engine`);
one sync = `publish(step)` on the writer while the reader's `update_weights()` waits (the reader is
given 0.5 s to reach its receive first); timed on the writer, device synchronized (`reader_times_s`, the
reader's update_weights, include that 0.5 s: they start before the writer's sleep). The first update
(metadata exchange, plan, NCCL group) is reported apart as `first_s`. awex sends the tied embedding twice
(as model.embed_tokens and as the lm_head alias both sides add): `sent_bytes`; `bytes` (the floor) counts
each weight once, as the torch rows do.

AWEX colocate (method "awex_colocate", one GPU): writer and reader share GPU 0 (CUDA_VISIBLE_DEVICES=0 for
both), as a colocated job's actor rank r and rollout engine r do. One publish = awex's colocate protocol:
the actor's optimizer state goes to the host, its weights are copied into grouped buffers shared by CUDA
IPC through the MetaServer, the actor's weights go to the host, the reader onloads the HF engine's weights
and copies the shared buffers into them. `sync_s` is that publish (writer side); `onload_s` is the actor's
onload that the next train step needs (optimizer state and weights back from the host), reported apart.

`bandwidth_gbps`: a 2-process NCCL broadcast of a 1 GiB buffer GPU 0 → GPU 1 (median of 10).
`copy_gbps` (colocate rows' floor): a 1 GiB device-to-device copy on GPU 0 (bytes copied per second).
`sync_floor_ratio` = measured sync seconds / (bytes sent / bandwidth); goal ≤ 1.25.
The awex rows carry `writer_spans_s` / `reader_spans_s`: the median seconds of each sub-phase of a sync
(`engines/weight_sync/awex_spans.py`).

ipc (method "ipc", one GPU, weight_sync.backend ipc): the actor (this process, `IpcSync`) and an HF rollout
server on GPU 0. One sync = the weights copied into the persistent buffer shared once by CUDA IPC, then POST
/update_weights_from_ipc, where the server copies the buffer into its parameters: two device copies of
`bytes`, so its ratio to one `copy_gbps` copy is ≥ 2 by construction. `spans_s`: export, fill, post, copy.

Multi-rank rows (methods awex_tp2_colocate on 2 GPUs, awex_tp2 on 4; `weight_sync_ranks.py`): AWEX from both
ranks of a TP 2 megatron actor (rank 1 through the follower's `AwexRankWriter`) to 2 HF engines; `sync_s` is
the slowest rank's publish; `bytes_per_trainer_rank` from awex's own plan (`awex_plan`); the floor divides
the largest by the NCCL all-reduce bus bandwidth measured in the same run (`allreduce_busbw_gbps`). Where the
GPUs are too few a row says `skipped` and why (also in a CPU run).

    python benchmarks/weight_sync.py --methods awex_colocate,ipc --sizes 0.6b   # one GPU is enough
    python benchmarks/weight_sync.py --device cpu --methods ipc --sizes tiny     # the same protocol on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_models import SHAPES, make_checkpoint  # noqa: E402  (Qwen3-0.6B / 1.7B shapes, random checkpoints)
from weight_sync_ranks import RANK_METHODS, nccl_gbps, plan_bytes, rank_fields, skipped_row  # noqa: E402

from mopd_hpc.atomic import atomic_write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the rollout server child, SIGKILL it after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def nccl_broadcast_gbps(port: int) -> float:
    """GB/s of a 2-rank NCCL broadcast GPU 0 → GPU 1 (median; `weight_sync_ranks.nccl_gbps`)."""
    return nccl_gbps(port, "broadcast", world=2)


def copy_gbps(nbytes: int = 1 << 30, repeats: int = 10, device: str = "cuda:0") -> float:
    """GB/s of a copy of `nbytes` within `device` (GPU 0: device to device; cpu: memcpy), bytes copied per
    second, median."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    times = []
    for i in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del src, dst
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def _median_spans(spans: list[dict]) -> dict[str, float]:
    """Per span name, the median seconds over the syncs that recorded it."""
    names = sorted({k for s in spans for k in s})
    return {k: round(statistics.median([s[k] for s in spans if k in s]), 4) for k in names}


async def _wait_ready(ready: Path, proc: subprocess.Popen, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server exited with {proc.returncode}")
        if ready.exists():
            return json.loads(ready.read_text())["url"]
        await asyncio.sleep(0.5)
    raise TimeoutError(f"rollout server not ready after {timeout_s} s")


async def measure(size: str, http_port: int, group_port: int, repeats: int, bw: float, tmp: Path) -> dict:
    from mopd_hpc.engines.rollout.client import RolloutClient
    from mopd_hpc.engines.weight_sync.torch import TorchBroadcastSender
    from mopd_hpc.runtime.http_auth import standalone_token

    ckpt = tmp / size
    model = make_checkpoint(SHAPES[size], ckpt, seed=0, device="cuda:0")
    ready = tmp / f"{size}.ready.json"
    token, token_file = standalone_token(tmp / "token", None)  # the server requires it on every route
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "mopd_hpc.engines.rollout.hf_server", "--model", str(ckpt), "--port", str(http_port),
           "--device", "cuda", "--dtype", "bfloat16", "--ready-file", str(ready),
           "--token-file", str(token_file)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    try:
        url = await _wait_ready(ready, proc)
        async with RolloutClient(url, token=token) as client:
            sender = TorchBroadcastSender("127.0.0.1", group_port, 2, backend="nccl", device="cuda:0")
            await sender.init_group([client])
            named = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied: one copy
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            await sender.send(named, [client])  # warm-up
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await sender.send(named, [client])
                times.append(time.perf_counter() - t0)
            info = await client.model_info()
            await sender.destroy([client])
        sync_s = statistics.median(times)
        floor_s = nbytes / (bw * 1e9)
        return {"size": size, "bytes": nbytes, "sync_s": round(sync_s, 4), "floor_s": round(floor_s, 4),
                "sync_floor_ratio": round(sync_s / floor_s, 3), "effective_gbps": round(nbytes / sync_s / 1e9, 1),
                "weight_version": info.get("weight_version"), "times_s": [round(t, 4) for t in times]}  # fmt: skip
    finally:
        _stop_server(proc)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


async def measure_ipc(size: str, http_port: int, repeats: int, cbw: float, tmp: Path, device: str) -> dict:
    """weight_sync.backend ipc for one size: the actor (this process, `IpcSync`) and an HF rollout server on
    the same device (GPU 0, as a colocated job's rank 0 and engine 0; or the CPU). One sync = copy the
    weights into the persistent shared buffer + POST /update_weights_from_ipc (the server copies the buffer
    into its parameters and synchronizes). The first sync (allocate, share, map) is `first_s`."""
    from mopd_hpc.engines.rollout.client import RolloutClient
    from mopd_hpc.runtime.http_auth import standalone_token
    from mopd_hpc.trainer.weight_sync import IpcSync

    ckpt = tmp / f"ipc_{size}"
    model = make_checkpoint(SHAPES[size], ckpt, seed=0, device="cuda:0" if device == "cuda" else "cpu")
    named = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied: one copy
    nbytes = sum(t.numel() * t.element_size() for _, t in named)

    class Actor:
        def named_weights(self):
            return iter(named)

    ready = tmp / f"ipc_{size}.ready.json"
    token, token_file = standalone_token(tmp / "token", None)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "mopd_hpc.engines.rollout.hf_server", "--model", str(ckpt), "--port", str(http_port),
           "--device", device, "--dtype", "bfloat16", "--ready-file", str(ready),
           "--token-file", str(token_file)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    try:
        url = await _wait_ready(ready, proc)
        async with RolloutClient(url, token=token) as client:
            sync = IpcSync(Actor())
            t0 = time.perf_counter()
            await sync.push(0, [client])
            first_s = time.perf_counter() - t0
            times, spans = [], []
            for step in range(1, repeats + 1):
                t0 = time.perf_counter()
                await sync.push(step, [client])
                times.append(time.perf_counter() - t0)
                spans.append(dict(sync.spans))
            info = await client.model_info()
            buffers = len(sync.buffers.handles)
            await sync.close([client])
        sync_s, floor_s = statistics.median(times), nbytes / (cbw * 1e9)
        return {"method": "ipc", "device": device, "size": size, "bytes": nbytes, "buffers": buffers,
                "sync_s": round(sync_s, 4), "floor_s": round(floor_s, 5), "sync_floor_ratio": round(sync_s / floor_s, 2),
                "effective_gbps": round(nbytes / sync_s / 1e9, 1), "first_s": round(first_s, 3),
                "spans_s": _median_spans(spans), "times_s": [round(t, 4) for t in times],
                "weight_version": info.get("weight_version")}  # fmt: skip
    finally:
        _stop_server(proc)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _awex_role(
    role: str, run_dir: Path, port: int, repeats: int, mode: str, rank: int = 0, tp: int = 1, engines: int = 1
) -> None:
    """One process of the AWEX benchmark (see `measure_awex`): trainer rank `rank` of a TP `tp` actor on GPU
    `rank` (rank 0 also runs the MetaServer; the others write through `AwexRankWriter`, as the actor's followers
    do), or HF engine `rank` of `engines` (colocate: on trainer rank `rank`'s GPU; separate: on GPU tp + rank)."""
    from mopd_hpc.engines.weight_sync.awex import AwexJobConfig, read_meta_server_address

    ckpt = run_dir / "ckpt"
    cfg = AwexJobConfig(mode=mode, comm_backend="nccl", ipc_backend="cuda", meta_server_addr="",
                        num_engines=engines, engine_tp=1, engine_pp=1, infer_world=engines, train_world=tp,
                        model_arch="Qwen3ForCausalLM")  # fmt: skip
    gpu = rank if role == "writer" or mode == "colocate" else tp + rank
    os.environ.update(cfg.trainer_env(rank if role == "writer" else 0, "127.0.0.1", gpu))
    steps = range(1, repeats + 2)
    if role == "writer":
        from mopd_hpc.config.loss import LossConfig
        from mopd_hpc.config.models import OptimizerConfig
        from mopd_hpc.engines.megatron.build import build_from_hf
        from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
        from mopd_hpc.engines.megatron.parallel import initialize_parallel
        from mopd_hpc.engines.weight_sync.awex_actor import AwexActorPublisher, start_run_meta_server
        from mopd_hpc.trainer.rank_writer import AwexRankWriter

        device = initialize_parallel(rank=rank, world_size=tp, master_addr="127.0.0.1", master_port=port,
                                     tensor_parallel=tp, device_index=rank)  # fmt: skip
        config = json.loads((ckpt / "config.json").read_text())
        model, shape = build_from_hf(ckpt, config, "bfloat16", device)
        actor = MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=1e-6), device)
        if rank == 0:
            addr = start_run_meta_server(run_dir, host="127.0.0.1")
            publisher = AwexActorPublisher(cfg.with_meta_server(addr), actor)
            publisher.initialize()
        else:
            publisher = AwexRankWriter(cfg, actor, run_dir, address_timeout_s=300)
        actor.onload()  # colocate: awex released the actor's memory (no-op when resident)
        seconds, onload_s, spans = [], [], []
        for step in steps:
            time.sleep(0.5)
            seconds.append(publisher.publish(step))
            spans.append(getattr(publisher, "last_spans", {}))
            t0 = time.perf_counter()
            actor.onload()  # what the next train step needs in colocate mode
            onload_s.append(time.perf_counter() - t0)
        (run_dir / f"writer{rank}.json").write_text(
            json.dumps({"seconds": seconds, "onload_s": onload_s, "spans": spans})
        )
        while rank == 0 and not all((run_dir / f"reader{e}.json").exists() for e in range(engines)):
            time.sleep(0.2)  # the MetaServer lives in this process
        return
    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
    from mopd_hpc.engines.weight_sync.awex_hf import hf_awex_engine

    torch.cuda.set_device(gpu)
    engine = HFRolloutEngine.load(str(ckpt), f"cuda:{gpu}", "bfloat16")
    addr = read_meta_server_address(run_dir, timeout_s=300)
    awex_engine = hf_awex_engine(cfg.with_meta_server(addr).inference_config(engine_rank=rank), engine)
    awex_engine.initialize()
    seconds, spans = [], []
    for step in steps:
        awex_engine.set_global_step(step)
        t0 = time.perf_counter()
        awex_engine.update_weights()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        spans.append(getattr(awex_engine, "last_spans", {}))
    (run_dir / f"reader{rank}.json").write_text(
        json.dumps({"seconds": seconds, "version": engine.weight_version, "spans": spans})
    )


def measure_awex(
    size: str,
    port: int,
    repeats: int,
    bw: float,
    tmp: Path,
    mode: str = "separate",
    method: str | None = None,
) -> dict:
    """The AWEX path for one size: writer and reader processes (module docstring); `bw` in GB/s is the
    floor's bandwidth (NCCL broadcast for separate, device copy for colocate, the NCCL all-reduce bus
    bandwidth for a multi-rank `method` of weight_sync_ranks.RANK_METHODS, whose layout it runs)."""
    layout = RANK_METHODS.get(method or "")
    tp, engines = (layout.tensor_parallel, layout.engines) if layout else (1, 1)
    run_dir = tmp / f"awex_{method or mode}_{size}"
    run_dir.mkdir()
    model = make_checkpoint(SHAPES[size], run_dir / "ckpt", seed=0, device="cuda:0")
    named = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    embed = model.state_dict()["model.embed_tokens.weight"]
    sent = nbytes + (embed.numel() * embed.element_size() if SHAPES[size]["tie_word_embeddings"] else 0)
    del model, named, embed
    torch.cuda.empty_cache()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    if mode == "colocate":  # every process sees the actor's GPUs, as colocated children do
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(tp))
    procs = []
    sides = [("writer", r) for r in range(tp)] + [("reader", e) for e in range(engines)]
    for role, rank in sides:
        log = open(run_dir / f"{role}{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, __file__, "--awex-role", role, "--run-dir", str(run_dir), "--repeats", str(repeats),
               "--base-port", str(port), "--awex-mode", mode, "--awex-rank", str(rank), "--awex-tp", str(tp),
               "--awex-engines", str(engines)]  # fmt: skip
        procs.append(
            (f"{role}{rank}", subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        )
    try:
        for name, proc, _ in procs:
            if proc.wait(timeout=480) != 0:
                tail = (run_dir / f"{name}.log").read_text()[-1500:]
                raise RuntimeError(f"awex {name} exited {proc.returncode}: {tail}")
    finally:
        for _, proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    written = [json.loads((run_dir / f"writer{r}.json").read_text()) for r in range(tp)]
    writer = [max(w["seconds"][i] for w in written) for i in range(len(written[0]["seconds"]))]  # the slowest
    reader = json.loads((run_dir / "reader0.json").read_text())
    sync_s = statistics.median(writer[1:])
    floor_s = nbytes / (bw * 1e9)
    extra = (
        {"onload_s": round(statistics.median(written[0]["onload_s"][1:]), 4)} if mode == "colocate" else {}
    )
    extra |= {"writer_spans_s": _median_spans(written[0].get("spans", [])[1:]),
              "reader_spans_s": _median_spans(reader.get("spans", [])[1:])}  # fmt: skip
    row = extra | {"method": method or ("awex" if mode == "separate" else "awex_colocate"), "size": size, "bytes": nbytes, "sent_bytes": sent, "sync_s": round(sync_s, 4),
            "floor_s": round(floor_s, 4), "sync_floor_ratio": round(sync_s / floor_s, 3),
            "effective_gbps": round(nbytes / sync_s / 1e9, 1), "first_s": round(writer[0], 3),
            "times_s": [round(t, 4) for t in writer[1:]], "reader_times_s": [round(t, 4) for t in reader["seconds"][1:]],
            "weight_version": reader["version"]}  # fmt: skip
    if layout:
        config = json.loads((run_dir / "ckpt" / "config.json").read_text())
        row |= rank_fields(method, plan_bytes(config, method), sync_s, bw)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.6b,1.7b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--base-port", type=int, default=29610, help="bandwidth rendezvous; +1 http; +2 sync group"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "weight_sync.json")
    p.add_argument(
        "--methods",
        default=None,
        help="comma list of torch, awex, awex_colocate, ipc, awex_tp2_colocate, awex_tp2 (default: all that fit "
        "the GPUs, and the multi-rank rows, skipped with their reason where the GPUs are too few)",
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the ipc method only, on this CPU"
    )
    p.add_argument("--awex-role", choices=("writer", "reader"), default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--awex-mode", choices=("separate", "colocate"), default="separate", help=argparse.SUPPRESS
    )
    p.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    for name in ("--awex-rank", "--awex-tp", "--awex-engines"):
        p.add_argument(name, type=int, default=0 if name == "--awex-rank" else 1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.awex_role is not None:
        _awex_role(args.awex_role, args.run_dir, args.base_port, args.repeats, args.awex_mode, args.awex_rank,
                   args.awex_tp, args.awex_engines)  # fmt: skip
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    one_gpu = "awex_colocate,ipc"
    ranked = ",".join(RANK_METHODS)  # rows of their own GPU count: skipped with the reason below it
    single = "torch,awex," + one_gpu if gpus >= 2 else one_gpu if gpus else "ipc"
    methods = (args.methods or f"{single},{ranked}").split(",")
    if args.device == "cpu" and set(methods) - {"ipc", *RANK_METHODS}:
        print("weight_sync: --device cpu runs the ipc method only (--methods ipc)", file=sys.stderr)
        return 2
    own = set(one_gpu.split(",")) | set(RANK_METHODS)
    if args.device == "cuda" and (gpus < 1 or (gpus < 2 and set(methods) - own)):
        print(
            f"weight_sync: {gpus} CUDA GPU(s); torch and awex need 2, awex_colocate and ipc 1",
            file=sys.stderr,
        )
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bw = nccl_broadcast_gbps(args.base_port) if gpus >= 2 else None
    runs_ranked = any(m in RANK_METHODS and skipped_row(m, "", gpus) is None for m in methods)
    abw = nccl_gbps(args.base_port + 40, "all_reduce", world=2) if runs_ranked else None
    cbw = copy_gbps(device="cuda:0" if args.device == "cuda" else "cpu")
    print(f"measured NCCL broadcast GPU0->GPU1: {bw} GB/s; all-reduce bus bandwidth GPUs 0-1: {abw} GB/s; "
          f"copy on {args.device}: {cbw:.1f} GB/s", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            for k, size in enumerate(args.sizes.split(",")):
                try:
                    if method in RANK_METHODS:
                        port = args.base_port + 50 + 10 * list(RANK_METHODS).index(method) + k
                        row = skipped_row(method, size, gpus) or measure_awex(
                            size, port, args.repeats, abw, Path(tmp), RANK_METHODS[method].mode, method
                        )
                    elif method == "ipc":
                        row = asyncio.run(
                            measure_ipc(
                                size, args.base_port + 30 + k, args.repeats, cbw, Path(tmp), args.device
                            )
                        )
                    elif method == "awex_colocate":
                        row = measure_awex(
                            size, args.base_port + 20 + k, args.repeats, cbw, Path(tmp), "colocate"
                        )
                    elif method == "awex":
                        row = measure_awex(size, args.base_port + 10 + k, args.repeats, bw, Path(tmp))
                    else:
                        ports = (args.base_port + 1 + 2 * k, args.base_port + 2 + 2 * k)
                        row = {"method": "torch"} | asyncio.run(
                            measure(size, *ports, args.repeats, bw, Path(tmp))
                        )
                except Exception as exc:  # noqa: BLE001 - report it in the table
                    row = {"method": method, "size": size, "error": f"{type(exc).__name__}: {exc}"[:1500]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                partial = {"benchmark": "weight_sync", "bandwidth_gbps": bw and round(bw, 1),
                           "allreduce_busbw_gbps": abw and round(abw, 1), "copy_gbps": round(cbw, 1),
                           "rows": rows}  # fmt: skip
                atomic_write_json(args.out, partial)  # survives a run cut short
    print(f"\n{'method':17} {'size':6} {'GB':>6} {'sync s':>8} {'floor s':>8} {'ratio':>6} {'onload s':>8}")
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r['method']:17} {r['size']:6} {'error' if 'error' in r else 'skipped'}: "
                  f"{r.get('error', r.get('skipped'))[:300]}")  # fmt: skip
        else:
            print(
                f"{r['method']:17} {r['size']:6} {r['bytes'] / 1e9:6.2f} {r['sync_s']:8.3f} {r['floor_s']:8.3f} "
                f"{r['sync_floor_ratio']:6.2f} {r.get('onload_s', ''):>8}"
            )
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {"benchmark": "weight_sync", "device": device, "torch": torch.__version__,
              "gpus": gpus, "bandwidth_gbps": bw and round(bw, 1), "allreduce_busbw_gbps": abw and round(abw, 1),
              "copy_gbps": round(cbw, 1), "rows": rows}  # fmt: skip
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
