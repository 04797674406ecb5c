"""AWEX end to end without SGLang (issue 8): awex 0.9.0's MegatronEngine + NCCLWeightsWriter on a Megatron
actor updates the HF rollout engine through `awex_hf`, in both modes:
- colocate (one GPU shared by the two processes): CUDA IPC through the MetaServer; awex releases the
  actor's memory after initialize() and after every publish, so the writer onloads it before training on;
- separate (actor on GPU 0, rollout on GPU 1): NCCL P2P between the two.

Two processes (writer, reader) meet at the MetaServer the actor's rank 0 starts (address file in the run
dir). The actor is converted from one HF micro Qwen3 (bf16), perturbed by noise before each of two
updates; after each update every HF parameter must equal the actor's (gathered to HF names) bitwise
(bf16 on both sides: no dtype conversion), and greedy generation must equal a reference HF engine loaded
with the actor's weights, and differ from generation before the update. qwen3_moe: the same with a micro
Qwen3-MoE (issue 33): the writer sends each expert under its checkpoint name, the reader receives it into
transformers' fused experts (`awex_hf.HFToHFWeightConverter`); compared per expert (`split_fused_experts`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_ports import free_port

REPO = Path(__file__).resolve().parents[2]
STEPS = 2

_SETUP = """
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from mopd_hpc.engines.weight_sync.awex import AwexJobConfig, read_meta_server_address
run_dir, port = sys.argv[1], int(sys.argv[2])
ckpt = os.path.join(run_dir, "ckpt")
cfg = AwexJobConfig(mode=sys.argv[3], comm_backend="nccl", ipc_backend="cuda", meta_server_addr="", num_engines=1,
                    engine_tp=1, engine_pp=1, infer_world=1, train_world=1, model_arch=sys.argv[4])
compile_decode = None if sys.argv[4] == "Qwen3ForCausalLM" else False  # MoE: the eager static decoder
os.environ.update(cfg.trainer_env(0, "127.0.0.1", 0))  # AWEX_MASTER_ADDR (both sides), DEVICE (writer)
"""

_WRITER = textwrap.dedent(
    """
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.megatron.build import build_from_hf
    from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
    from mopd_hpc.engines.megatron.parallel import initialize_parallel
    from mopd_hpc.engines.weight_sync.awex_actor import AwexActorPublisher, start_run_meta_server
    device = initialize_parallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                                 tensor_parallel=1, device_index=0)
    addr = start_run_meta_server(run_dir, host="127.0.0.1")
    config = json.load(open(os.path.join(ckpt, "config.json")))
    model, shape = build_from_hf(ckpt, config, "bfloat16", device)
    actor = MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=1e-5), device, "bfloat16")
    publisher = AwexActorPublisher(cfg.with_meta_server(addr), actor)
    publisher.initialize()
    actor.onload()  # colocate: awex released the actor's memory for the rollout engine (no-op if resident)
    g = torch.Generator(device=device).manual_seed(0)
    for step in range(1, STEPS_VALUE + 1):
        with torch.no_grad():
            for p in actor.model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) * 0.05)
        torch.save({k: v.cpu() for k, v in actor.named_weights()}, os.path.join(run_dir, f"actor_{step}.pt.tmp"))
        os.replace(os.path.join(run_dir, f"actor_{step}.pt.tmp"), os.path.join(run_dir, f"actor_{step}.pt"))
        publisher.publish(step)
        actor.onload()
    json.dump({"seconds": publisher.seconds}, open(os.path.join(run_dir, "writer.json"), "w"))
    while not os.path.exists(os.path.join(run_dir, "reader.json")):  # keep the MetaServer up for the reader
        time.sleep(0.2)
    """
).replace("STEPS_VALUE", str(STEPS))

_READER = textwrap.dedent(
    """
    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
    from mopd_hpc.engines.rollout.rows import RowRequest
    from mopd_hpc.engines.rollout.protocol import SamplingParams
    from mopd_hpc.engines.weight_sync.awex_hf import hf_awex_engine

    class Go:
        def between_steps(self):
            return True

    rows = [RowRequest(prompt_ids=(3, 17, 42, 5), sampling=SamplingParams(max_new_tokens=12, temperature=0.0,
                       ignore_eos=True), seed=0, return_logprob=True)]
    def gen(engine):
        r = engine.generate(rows, Go())[0]
        return {"ids": r.output_ids, "lps": r.output_logprobs}

    engine = HFRolloutEngine.load(ckpt, "cuda:0", "bfloat16", compile_decode=compile_decode)
    report = {"before": gen(engine), "steps": []}
    addr = read_meta_server_address(run_dir, timeout_s=300)
    awex_engine = hf_awex_engine(cfg.with_meta_server(addr).inference_config(engine_rank=0), engine)
    awex_engine.initialize()
    ref = HFRolloutEngine.load(ckpt, "cuda:0", "bfloat16", compile_decode=compile_decode)
    for step in range(1, STEPS_VALUE + 1):
        awex_engine.set_global_step(step)
        t0 = time.perf_counter()
        awex_engine.update_weights()
        seconds = time.perf_counter() - t0
        torch.save({k: v.cpu() for k, v in engine.model.state_dict().items()}, os.path.join(run_dir, f"reader_{step}.pt"))
        ref.load_named_tensors(torch.load(os.path.join(run_dir, f"actor_{step}.pt")), None)
        report["steps"].append({"seconds": seconds, "version": engine.weight_version, "gen": gen(engine),
                                "ref": gen(ref), "flushes": awex_engine.model_context["scheduler"].flushes})
    json.dump(report, open(os.path.join(run_dir, "reader.json"), "w"))
    """
).replace("STEPS_VALUE", str(STEPS))


def _checkpoint(path: Path, family: str) -> str:
    """A bf16 micro checkpoint of `family` at `path` (tied embeddings); returns its architecture."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
        model = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():  # transformers starts the routers at 0: routing that depends on the token
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return type(model).__name__


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["colocate", "separate"])
def test_awex_updates_the_hf_engine_bitwise(tmp_path: Path, mode: str, family: str) -> None:
    gpus = 1 if mode == "colocate" else 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s)")
    pytest.importorskip("awex", reason="awex is not installed")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.megatron.convert_moe import split_fused_experts

    arch = _checkpoint(tmp_path / "ckpt", family)
    procs = {}
    for role, body, gpu in (
        ("writer", _WRITER, "0"),
        ("reader", _READER, "0" if mode == "colocate" else "1"),
    ):
        script = tmp_path / f"{role}.py"
        main = "def main():\n" + textwrap.indent(body, "    ") + '\nif __name__ == "__main__":\n    main()\n'
        script.write_text(_SETUP + main)  # guarded: the MetaServer's spawn re-imports the script
        log = open(tmp_path / f"{role}.log", "w")  # noqa: SIM115 - closed with the process below
        # as the guard does: each child sees only its GPU (separate: writer GPU 0, reader GPU 1; colocate: both 0)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        procs[role] = (subprocess.Popen([sys.executable, str(script), str(tmp_path), str(free_port()), mode, arch],
                                        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log)  # fmt: skip
    try:
        for role, (proc, _) in procs.items():
            rc = proc.wait(timeout=180)
            assert rc == 0, f"{role} exited {rc}:\n" + (tmp_path / f"{role}.log").read_text()[-4000:]
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    report = json.loads((tmp_path / "reader.json").read_text())
    assert len(json.loads((tmp_path / "writer.json").read_text())["seconds"]) == STEPS
    for step in range(1, STEPS + 1):
        actor = torch.load(tmp_path / f"actor_{step}.pt")
        reader = split_fused_experts(torch.load(tmp_path / f"reader_{step}.pt"))  # experts by checkpoint name
        assert set(actor) <= set(reader) and len(actor) == len(reader) - 1  # + the tied lm_head
        for name, tensor in actor.items():
            assert reader[name].dtype == tensor.dtype == torch.bfloat16
            assert torch.equal(reader[name], tensor), f"step {step}: {name} differs"
        assert torch.equal(reader["lm_head.weight"], actor["model.embed_tokens.weight"])
        if step > 1:  # the actor moved between updates, and so did the rollout engine
            prev = torch.load(tmp_path / f"actor_{step - 1}.pt")
            assert not torch.equal(prev["model.norm.weight"], actor["model.norm.weight"])
        row = report["steps"][step - 1]
        assert row["version"] == str(step) and row["flushes"] == step
        assert row["gen"] == row["ref"]  # generation uses exactly the actor's weights
        assert row["gen"]["lps"] != report["before"]["lps"]
