"""Per-step CPU overhead of awex 0.9.0's separate-mode sync (engines/weight_sync/awex_latency.py gaps 9
and 10), measured on CPU: awex's own step bodies, `NCCLWeightsWriter.write_weights` (writer: convert the
Megatron weights to HF names, build the P2P send ops, send, barrier, `gc.collect()`) and
`NCCLWorkerWeightsReader.update_weights` (reader: build the recv ops, receive, barrier, `gc.collect()`,
flush), run on a `fake` torch.distributed group (every collective returns at once), so what is timed is the
Python/CPU part only: the fixed latency that stays when the bytes take no time.

    python benchmarks/awex_step_overhead.py       # writes benchmarks/results/awex_step_overhead.json

Setup: a Qwen3 of 28 layers (the 0.6B/1.7B layer count, so 311 tensors per sync as on the H200) with tiny
widths; the writer process holds a real megatron-core GPTModel (local spec, CPU), the reader process an
`HFRolloutEngine`; both import torch, transformers, megatron.core and awex, as the real processes do. Each
role runs twice in fresh processes: awex 0.9.0 as is, then with `young_gc_in_separate_steps()` (gap 9) and
`cached_device_probe()` (gap 10). `step_ms` is the median over the steps after the first; `components_ms` are
per step (calls, ms) of the functions awex calls in the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=28, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)  # fmt: skip
HF_CONFIG = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "nnodes": 1, "node_rank": 0, "num_engines": 1,
             "engine_rank": 0, "meta_server_addr": "127.0.0.1:1", "comm_backend": "nccl"}  # fmt: skip


def _metas(ckpt: Path):
    """(awex HF engine, infer metas, train metas, resolver, the megatron GPTModel, hf PretrainedConfig)."""
    from types import SimpleNamespace

    from awex.meta.infer_meta_resolver import InferParamMetaResolver
    from awex.meta.train_meta_resolver import McoreParamMetaResolver
    from awex.util.common import simple_hf_config

    from mopd_hpc.engines.megatron.convert import Qwen3Shape
    from mopd_hpc.engines.megatron.model import build_gpt_model
    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
    from mopd_hpc.engines.weight_sync.awex_actor import pretrained_config
    from mopd_hpc.engines.weight_sync.awex_hf import hf_awex_engine

    engine = HFRolloutEngine.load(str(ckpt), "cpu", "float32")
    awex_engine = hf_awex_engine(HF_CONFIG, engine)
    infer = InferParamMetaResolver(awex_engine, convert_params=True).get_parameters_meta()
    infer_conf = {"engine_name": "hf", "infer_atten_tp_size": 1, "infer_engine_config": awex_engine.config,
                  "hf_config": simple_hf_config(awex_engine.hf_config), "infer_world_size": 1,
                  "expected_pp_ranks": [0], "device_backend": "cpu"}  # fmt: skip
    config = json.loads((ckpt / "config.json").read_text())
    model = build_gpt_model(Qwen3Shape.from_hf_config(config), dtype="float32", cpu_init=True)
    hf_cfg = pretrained_config(config)
    trainer = SimpleNamespace(model=[model], engine_name="mcore", enable_debug_mode=False)
    resolver = McoreParamMetaResolver(trainer, hf_cfg, infer_conf)
    return engine, infer, infer_conf, resolver, model, hf_cfg


def _role(role: str, run_dir: Path, patched: bool, steps: int) -> dict:
    """One measurement process: build awex's writer or reader object around a fake group, run `steps` steps."""
    import collections
    import contextlib
    import gc
    import io
    import threading
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{run_dir / f'pg_{role}_{patched}'}", rank=0, world_size=1
    )
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    import awex.util.device as device_util

    device_util.device_count = lambda: 1  # a CPU host: awex takes the local rank modulo the GPU count
    from mopd_hpc.engines.weight_sync import awex_latency as gaps
    from mopd_hpc.engines.weight_sync.awex_actor import register_local_spec_names
    from mopd_hpc.engines.weight_sync.awex_hf import HFScheduler

    register_local_spec_names()
    import awex.models.registry as registry
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader
    from awex.transfer.transfer_plan import TransferPlanBuilder
    from awex.util.process_group import init_custom_process_group
    from awex.writer.nccl_writer import NCCLWeightsWriter
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with contextlib.redirect_stdout(io.StringIO()):  # awex logs to stdout
        engine, infer, infer_conf, resolver, model, hf_cfg = _metas(run_dir / "ckpt")
        train = resolver.get_parameters_meta()
    if not patched:  # hf_awex_engine (in _metas) applied gaps 9 and 10: measure awex as shipped instead
        for module in gaps._GC_HOLDERS:
            sys.modules[module].gc = gc
        for cls, name in (
            (NCCLWeightsWriter, "_write_weights"),
            (NCCLWorkerWeightsReader, "_update_weights"),
        ):
            setattr(cls, name, cls.__dict__[name].__wrapped__)
        device_util.is_npu_available = device_util.is_npu_available.__wrapped__
    rank = 1 if role == "writer" else 0
    group = init_custom_process_group(
        backend="fake", store=FakeStore(), world_size=2, rank=rank, group_name="wx"
    )
    if role == "writer":
        del engine
        plan = TransferPlanBuilder(1, 1, 1).build_local_transfer_plan(infer, train, 1)
        side = object.__new__(NCCLWeightsWriter)
        side.__dict__.update(
            model=[model], hf_config=hf_cfg, rank_info=resolver._rank_info, transfer_rank=1, transfer_plan=plan,
            weight_converter=registry.get_train_weights_converter("mcore", "Qwen3ForCausalLM", hf_cfg,
                                                                  resolver._rank_info, infer_conf, tf_config=model.config),
            recv_ranks=list(plan.operations), recv_ranks_sample=list(plan.operations),
            num_to_sends=sum(len(o) for o in plan.operations.values()),
            required_param_names={op.send_shard_meta.name for ops in plan.operations.values() for op in ops},
            weights_update_group=group, use_batch_send_recv=True, enable_mem_debug=False, already_initialized=True,
            _history_write_weights_time={}, destroy_pg_after_update=False, lock=threading.Lock(),
            enable_colocate_mode=False, initialized=True, validated_steps=0, weights_validation_steps=0,
            start_step=-1, validate_weights_every_n_steps=1,
        )  # fmt: skip

        def step(s: int) -> None:
            side.write_weights(step_id=s)
    else:
        del model
        plan = TransferPlanBuilder(1, 1, 1).build_local_transfer_plan(infer, train, 0)
        params = dict(engine.model.named_parameters())
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
        side = object.__new__(NCCLWorkerWeightsReader)
        side.__dict__.update(
            parameters=params, transfer_plan=plan, weights_update_group=group, use_batch_send_recv=True,
            send_ranks_sample=list(plan.operations), rank_coordinate="0-0-0", transfer_rank=0, engine_rank=0,
            num_to_recvs=sum(len(o) for o in plan.operations.values()), already_initialized=True,
            _history_update_weights_time={}, destroy_pg_after_update=False, enable_colocate_mode=False,
            scheduler=HFScheduler(0, None), rank_info=type("R", (), {"global_rank": 0})(),
        )  # fmt: skip

        def step(s: int) -> None:
            side.update_weights(step_id=s)

    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def timed(owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                stats[key][0] += 1
                stats[key][1] += time.perf_counter() - t0

        setattr(owner, name, wrapper)

    class TimedGC:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    for module in gaps._GC_HOLDERS:
        proxy = TimedGC(sys.modules[module].gc)
        timed(proxy, "collect", "gc.collect")
        sys.modules[module].gc = proxy
    import awex.logging as awex_logging
    import awex.reader.nccl_reader as nccl_reader
    import awex.transfer.nccl_comm as nccl_comm
    import awex.writer.nccl_writer as nccl_writer
    import awex.writer.weights_writer as weights_writer

    timed(NCCLWeightsWriter, "convert_parameters", "convert_parameters")
    timed(weights_writer, "get_mcore_model_parameters", "get_mcore_model_parameters (in convert)")
    timed(nccl_writer, "nccl_build_send_ops", "nccl_build_send_ops")
    timed(nccl_reader, "nccl_build_recv_ops", "nccl_build_recv_ops")
    for module in (nccl_writer, nccl_reader, nccl_comm):
        timed(module, "batch_send_recv", "batch_send_recv (fake group)")
    timed(device_util, "get_device_type", "device_util.get_device_type")
    timed(awex_logging.Logger, "_log", "awex logger lines")
    times = []
    with contextlib.redirect_stdout(io.StringIO()):
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            step(s)
            times.append(time.perf_counter() - t0)
    return {"role": role, "patched": patched, "gc_objects": len(gc.get_objects()),
            "ops": sum(len(o) for o in plan.operations.values()), "step_ms": round(statistics.median(times[1:]) * 1e3, 2),
            "steps_ms": [round(t * 1e3, 2) for t in times],
            "components_ms": {k: [round(n / steps, 2), round(sec / steps * 1e3, 3)]
                              for k, (n, sec) in sorted(stats.items(), key=lambda kv: -kv[1][1])}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS / "awex_step_overhead.json")
    p.add_argument("--role", choices=("writer", "reader"), default=None, help="internal: one measurement")
    p.add_argument("--patched", action="store_true", help="internal: with gaps 9 and 10")
    p.add_argument("--run-dir", type=Path, default=None, help="internal")
    args = p.parse_args(argv)
    if args.role:
        print(json.dumps(_role(args.role, args.run_dir, args.patched, args.steps)))
        return 0
    import torch
    from results_file import write_results
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**SHAPE)).save_pretrained(str(Path(tmp) / "ckpt"))
        for role in ("writer", "reader"):
            for patched in (False, True):
                cmd = [sys.executable, __file__, "--role", role, "--run-dir", tmp, "--steps", str(args.steps)]
                proc = subprocess.run(cmd + ["--patched"] * patched, capture_output=True, text=True, cwd=REPO)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'role':7} {'awex':22} {'step ms':>8} {'gc.collect ms':>14} {'rest ms':>8} {'gc objects':>11}")
    for r in rows:
        gc_ms = r["components_ms"].get("gc.collect", [0, 0.0])[1]
        label = "+ gaps 9, 10" if r["patched"] else "0.9.0"
        print(
            f"{r['role']:7} {label:22} {r['step_ms']:8.1f} {gc_ms:14.1f} {r['step_ms'] - gc_ms:8.1f} {r['gc_objects']:11}"
        )
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    result = {"benchmark": "awex_step_overhead", "cpu": cpu, "python": platform.python_version(),
              "torch": torch.__version__, "tensors_per_sync": rows[0]["ops"], "steps": args.steps, "rows": rows}  # fmt: skip
    return write_results(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
