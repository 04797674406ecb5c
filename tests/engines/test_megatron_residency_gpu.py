"""Residency of the Megatron actor by parts on one GPU (issue 8): the optimizer state alone, then the weights,
back in either order, and training on after it exactly as an actor that never left the GPU.

AWEX's colocate protocol moves the parts separately (optimizer out; weights kept for its copy, then out);
`DDPResidency` mirrors the optimizer state into pinned host tensors reused across offloads. For a bf16 actor
(fp32 main params in the optimizer) and an fp32 one (the optimizer steps the DDP buffer's own params, which
must move once, with the buffer), after two train steps with offloads between them the loss, the weights and
the log-probs equal those of an identical actor that stayed resident, bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_ports import free_port

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.megatron.build import build_from_hf
from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
from mopd_hpc.engines.megatron.parallel import initialize_parallel
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.mopd.targets import TeacherTargets

root, port = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
Qwen3ForCausalLM(cfg).save_pretrained(os.path.join(root, "ckpt"))
config = json.load(open(os.path.join(root, "ckpt", "config.json")))
device = initialize_parallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, tensor_parallel=1,
                             device_index=0)
g = torch.Generator().manual_seed(1)
batch = TokenBatch.from_samples([torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3)],
                                [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 4, 11)], pad_id=0)
report = {}
for dtype in ("bfloat16", "float32"):
    def actor():
        model, shape = build_from_hf(os.path.join(root, "ckpt"), config, dtype, device)
        return MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=1e-3), device, dtype)
    moved, stayed = actor(), actor()
    behavior = stayed.logprobs(batch).float()
    train = TrainBatch.create(batch, behavior_logprobs=behavior.clone(),
                              targets=TeacherTargets(behavior - 0.5, torch.ones_like(behavior)))
    losses = {"moved": [moved.train_step(train)["loss"]], "stayed": [stayed.train_step(train)["loss"]]}
    res = moved.residency
    lp = moved.logprobs(batch)
    torch.cuda.synchronize()
    mem = {"start": torch.cuda.memory_allocated(device)}
    res.offload(("optimizer",))
    mem["optimizer_out"] = torch.cuda.memory_allocated(device)
    r = {}
    try:
        moved.train_step(train)
        r["refused_train"] = False
    except EngineError:
        r["refused_train"] = True
    res.offload(("weights",))
    mem["all_out"] = torch.cuda.memory_allocated(device)
    r["resident_after_weights_out"] = dict(res.resident)
    res.onload(("weights",))
    mem["weights_in"] = torch.cuda.memory_allocated(device)
    r["resident_after_weights_in"] = dict(res.resident)
    res.onload()
    mem["all_in"] = torch.cuda.memory_allocated(device)
    res.offload()  # both parts at once, then back: a second round reuses the pinned mirrors
    res.onload(("optimizer",))  # brings the weights first
    r["resident_end"] = dict(res.resident)
    r["lp_after_round_trips"] = torch.equal(moved.logprobs(batch), lp)
    losses["moved"].append(moved.train_step(train)["loss"])
    losses["stayed"].append(stayed.train_step(train)["loss"])
    a, b = dict(moved.named_weights()), dict(stayed.named_weights())
    r["weights_equal"] = all(torch.equal(a[k], b[k]) for k in b)
    r["lp_equal"] = torch.equal(moved.logprobs(batch), stayed.logprobs(batch))
    r.update(losses=losses, mem=mem, mirrors=len(res._mirrors))
    report[dtype] = r
    del moved, stayed
    torch.cuda.empty_cache()
json.dump(report, open(os.path.join(root, "report.json"), "w"))
"""


@pytest.mark.gpu
def test_parts_move_separately_and_training_continues_bitwise(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    script = tmp_path / "residency.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(free_port())], capture_output=True,
                          text=True, timeout=240, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for dtype, r in report.items():
        mem = r["mem"]
        assert mem["optimizer_out"] < mem["start"], dtype  # the optimizer state left alone
        assert mem["all_out"] < mem["optimizer_out"], dtype  # then the weights
        mib = 1 << 20
        assert abs(mem["weights_in"] - mem["optimizer_out"]) <= mib, (
            dtype
        )  # weights back, optimizer still out
        assert abs(mem["all_in"] - mem["start"]) <= mib, dtype
        assert r["refused_train"] is True, dtype  # no train step with the optimizer on the host
        assert r["resident_after_weights_out"] == {"optimizer": False, "weights": False}
        assert r["resident_after_weights_in"] == {"optimizer": False, "weights": True}
        assert r["resident_end"] == {"optimizer": True, "weights": True}
        assert r["lp_after_round_trips"] is True, dtype
        assert r["losses"]["moved"] == r["losses"]["stayed"], dtype
        assert r["weights_equal"] is True and r["lp_equal"] is True, dtype
        assert r["mirrors"] > 0, dtype
