"""AWEX from every rank of a TP = 2 megatron actor to HF rollout engines (issue 18), parameters bitwise equal
after each update:
- colocate (2 GPUs): actor ranks 0 and 1 on GPUs 0 and 1, HF engines 0 and 1 on the same GPUs (every process
  sees both GPUs and starts on its own ordinal, as `plan/placement.py` places colocated children); awex
  pairs trainer rank r with the rollout rank on its (host, device) and moves the weights by CUDA IPC;
- separate (4 GPUs): actor ranks on GPUs 0 and 1, HF engines on GPUs 2 and 3, one NCCL group of 4 ranks.

Each side is its own process, as in the job: trainer rank 0 starts the MetaServer (address in the run dir)
and writes through `AwexActorPublisher`; trainer rank 1 through `trainer/rank_writer.AwexRankWriter` (the
follower's writer: the address from the run dir, its writer built at the first publish), every trainer rank
a writer at transfer rank infer_world + rank (2 + r), with its own AWEX_MASTER_ADDR / DEVICE
(`AwexJobConfig.trainer_env`). Before each of two updates both TP ranks perturb their shards (the same noise
stream on both ranks: the replicated norms stay equal across TP); the actor's HF weights (gathered per HF
tensor over TP, `named_weights`) are the oracle: every HF parameter of every engine must equal them bitwise
(bf16 on both sides).
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
TP = 2
ENGINES = 2

_SETUP = """
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from mopd_hpc.engines.weight_sync.awex import AwexJobConfig, read_meta_server_address
ENGINES, TP, STEPS = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
run_dir, port, mode, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
ckpt = os.path.join(run_dir, "ckpt")
cfg = AwexJobConfig(mode=mode, comm_backend="nccl", ipc_backend="cuda", meta_server_addr="", num_engines=ENGINES,
                    engine_tp=1, engine_pp=1, infer_world=ENGINES, train_world=TP, model_arch="Qwen3ForCausalLM")
"""

_WRITER = """
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.megatron.build import build_from_hf
from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
from mopd_hpc.engines.megatron.parallel import initialize_parallel
from mopd_hpc.engines.weight_sync.awex_actor import AwexActorPublisher, start_run_meta_server
from mopd_hpc.trainer.rank_writer import AwexRankWriter
os.environ.update(cfg.trainer_env(rank, "127.0.0.1", rank))  # the edge: AWEX_MASTER_ADDR, DEVICE = rank
device = initialize_parallel(rank=rank, world_size=TP, master_addr="127.0.0.1", master_port=port,
                             tensor_parallel=TP, device_index=rank)
config = json.load(open(os.path.join(ckpt, "config.json")))
model, shape = build_from_hf(ckpt, config, "bfloat16", device)
actor = MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=1e-5), device, "bfloat16")
if rank == 0:  # the controller's AwexSync.start: the MetaServer, then its writer
    writer = AwexActorPublisher(cfg.with_meta_server(start_run_meta_server(run_dir, host="127.0.0.1")), actor)
    writer.initialize()
    actor.onload()  # colocate: awex released the actor's memory for the rollout engine (no-op if resident)
else:  # a follower: its writer is built at the first publish
    writer = AwexRankWriter(cfg, actor, run_dir, address_timeout_s=300)
g = torch.Generator(device=device).manual_seed(0)  # the same stream on both TP ranks
seconds = []
for step in range(1, STEPS + 1):
    actor.onload()
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) * 0.05)
    weights = {k: v.cpu() for k, v in actor.named_weights()}  # a TP collective: both ranks
    if rank == 0:
        torch.save(weights, os.path.join(run_dir, f"actor_{step}.pt.tmp"))
        os.replace(os.path.join(run_dir, f"actor_{step}.pt.tmp"), os.path.join(run_dir, f"actor_{step}.pt"))
    seconds.append(writer.publish(step))
json.dump({"seconds": seconds}, open(os.path.join(run_dir, f"writer{rank}.json"), "w"))
while not all(os.path.exists(os.path.join(run_dir, f"reader{e}.json")) for e in range(ENGINES)):
    time.sleep(0.2)  # rank 0 keeps the MetaServer up for the readers
"""

_READER = """
from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
from mopd_hpc.engines.weight_sync.awex_hf import hf_awex_engine
os.environ["AWEX_MASTER_ADDR"] = "127.0.0.1"
gpu = rank if mode == "colocate" else TP + rank  # colocate: the GPU of trainer rank `rank`
torch.cuda.set_device(gpu)
engine = HFRolloutEngine.load(ckpt, f"cuda:{gpu}", "bfloat16")
addr = read_meta_server_address(run_dir, timeout_s=300)
awex_engine = hf_awex_engine(cfg.with_meta_server(addr).inference_config(engine_rank=rank), engine)
awex_engine.initialize()
report = {"steps": []}
for step in range(1, STEPS + 1):
    awex_engine.set_global_step(step)
    t0 = time.perf_counter()
    awex_engine.update_weights()
    report["steps"].append({"seconds": time.perf_counter() - t0, "version": engine.weight_version})
    state = {k: v.cpu() for k, v in engine.model.state_dict().items()}
    torch.save(state, os.path.join(run_dir, f"reader{rank}_{step}.pt"))
json.dump(report, open(os.path.join(run_dir, f"reader{rank}.json"), "w"))
"""


def _script(path: Path, body: str) -> Path:
    """The MetaServer's spawn re-imports the script: its body runs under a main guard."""
    main = "def main():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    source = _SETUP + main + '\nif __name__ == "__main__":\n    main()\n'
    path.write_text(source)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "gpus"), [("colocate", 2), ("separate", 4)])
def test_every_tp_rank_writes_and_the_hf_engines_match_bitwise(tmp_path: Path, mode: str, gpus: int) -> None:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus:
        pytest.skip(
            f"needs {gpus} CUDA devices (AWEX {mode}: a TP {TP} megatron actor and {ENGINES} HF engines), found {found}"
        )
    pytest.importorskip("awex", reason="awex is not installed")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=True)  # fmt: skip
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path / "ckpt"))
    writer, reader = _script(tmp_path / "writer.py", _WRITER), _script(tmp_path / "reader.py", _READER)
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}  # all, as colocated
    procs = {}
    for name, script, rank in [("writer0", writer, 0), ("writer1", writer, 1)] + [
        (f"reader{e}", reader, e) for e in range(ENGINES)
    ]:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
        argv = [
            sys.executable,
            str(script),
            str(tmp_path),
            str(port),
            mode,
            str(rank),
            str(ENGINES),
            str(TP),
            str(STEPS),
        ]
        procs[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log)
    try:
        for name, (proc, _) in procs.items():
            rc = proc.wait(timeout=300)
            assert rc == 0, f"{name} exited {rc}:\n" + (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for r in range(TP):  # every trainer rank published every step
        assert len(json.loads((tmp_path / f"writer{r}.json").read_text())["seconds"]) == STEPS
    for step in range(1, STEPS + 1):
        actor = torch.load(tmp_path / f"actor_{step}.pt")
        if step > 1:  # the actor moved between updates
            assert not torch.equal(torch.load(tmp_path / f"actor_{step - 1}.pt")["model.norm.weight"],
                                   actor["model.norm.weight"])  # fmt: skip
        for e in range(ENGINES):
            got = torch.load(tmp_path / f"reader{e}_{step}.pt")
            assert set(actor) <= set(got) and len(actor) == len(got) - 1  # + the tied lm_head
            for name, tensor in actor.items():
                assert got[name].dtype == tensor.dtype == torch.bfloat16
                assert torch.equal(got[name], tensor), f"engine {e}, step {step}: {name} differs"
            assert torch.equal(got["lm_head.weight"], actor["model.embed_tokens.weight"])
            row = json.loads((tmp_path / f"reader{e}.json").read_text())["steps"][step - 1]
            assert row["version"] == str(step)
