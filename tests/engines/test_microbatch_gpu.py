"""Micro-batches and activation recompute in the megatron actor on one GPU (issue 21): the same step in 1 and
in 4 micro-batches gives the same loss and gradient, and a lower peak of allocated memory; full recompute
gives the same gradient with a lower peak still.

A random Qwen3 shape (4 layers, hidden 256, 4 heads / 2 KV heads, head 64, vocab 4,096; saved as an HF
checkpoint so every engine starts from the same weights) and one step of 16 rows × 1,024 positions (256
prompt + 768 response tokens): activations, not weights, dominate memory. Each case builds a fresh
`MegatronTrainEngine` in one subprocess (megatron's parallel state is per process), runs one `train_step`
and reports the loss, the accumulated gradient (the DDP's fp32 `main_grad` of every parameter, read after the
step: the next step zeroes it) and the step's peak allocated memory above what was allocated before it.

Tolerances, relative L2 norm of the gradient (and relative loss):
- float32: 1e-5. The micro-batches sum the same per-token terms in another order and run kernels of other
  shapes; float32's unit roundoff is 6e-8, and the loss's terms of both signs amplify it (5.7e-7 measured
  for the same comparison on CPU, tests/engines/test_micro_batch.py).
- bfloat16: 2e-2. The forward and backward run in bf16 (unit roundoff u = 2^-8 = 3.9e-3): each
  micro-batch's gradient is rounded to bf16 once (≤ u/2 per element) before it is added into the fp32
  main-grad buffer (grad_reduce_in_fp32), and activations computed by kernels of another batch shape differ
  by O(u) per layer; over 4 layers that is a few u, bounded here by 5u ≈ 2e-2.
Memory: 4 micro-batches must peak below 60 % of 1 micro-batch's step (activations scale with the
micro-batch's positions: ideally ~25 % plus what does not scale — weights' gradients, optimizer state), and
recompute below 1 micro-batch without it.

Run on a GPU machine: `python -m pytest -q -m gpu tests/engines/test_microbatch_gpu.py -s` (under a minute).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ROWS, PROMPT, RESPONSE = 16, 256, 768
#: 4 micro-batches of 4 rows × 1,024 positions.
BUDGET = 4 * (PROMPT + RESPONSE)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}

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
from mopd_hpc.engines.micro_batch import MicroBatching
from mopd_hpc.mopd.targets import TeacherTargets

root, rows, prompt, response, budget = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                  tie_word_embeddings=True)
Qwen3ForCausalLM(cfg).save_pretrained(os.path.join(root, "ckpt"))
config = json.load(open(os.path.join(root, "ckpt", "config.json")))
device = initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=0)
g = torch.Generator().manual_seed(1)
tokens = TokenBatch.from_samples(torch.randint(1, 4096, (rows, prompt), generator=g).tolist(),
                                 torch.randint(1, 4096, (rows, response), generator=g).tolist(), pad_id=0)
shape = (rows, response)
behavior = -8.0 + 0.5 * torch.randn(shape, generator=g)
targets = TeacherTargets(-8.0 + 0.5 * torch.randn(shape, generator=g), torch.ones(shape))
batch = TrainBatch.create(tokens, behavior, targets=targets)
report = {}
for dtype in ("float32", "bfloat16"):
    for name, micro in (("one", MicroBatching()), ("four", MicroBatching(budget)),
                        ("recompute", MicroBatching(None, True))):
        model, mshape = build_from_hf(os.path.join(root, "ckpt"), config, dtype, device)
        engine = MegatronTrainEngine(model, mshape, config, LossConfig(), OptimizerConfig(lr=1e-4, grad_clip=None),
                                     device, dtype, micro)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        stats = engine.train_step(batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - before
        grad = torch.cat([p.main_grad.detach().float().flatten().cpu() for p in model.parameters()])
        torch.save(grad, os.path.join(root, f"grad_{dtype}_{name}.pt"))
        report[f"{dtype}/{name}"] = {"loss": stats["loss"], "micro_batches": stats["micro_batches"],
                                     "peak_bytes": peak, "grad_norm": stats["grad_norm"]}
        del engine, model
        torch.cuda.empty_cache()
json.dump(report, open(os.path.join(root, "report.json"), "w"), indent=1)
"""


@pytest.mark.gpu
def test_megatron_micro_batches_and_recompute_same_step_less_memory(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    script = tmp_path / "micro.py"
    script.write_text(_SCRIPT)
    args = [str(tmp_path), str(ROWS), str(PROMPT), str(RESPONSE), str(BUDGET)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    print(json.dumps(report, indent=1))
    for dtype, tol in TOLERANCE.items():
        one, four, rec = (report[f"{dtype}/{n}"] for n in ("one", "four", "recompute"))
        assert (one["micro_batches"], four["micro_batches"], rec["micro_batches"]) == (1, 4, 1)
        g1 = torch.load(tmp_path / f"grad_{dtype}_one.pt")
        assert float(g1.norm()) > 0
        for name, run in (("four", four), ("recompute", rec)):
            g = torch.load(tmp_path / f"grad_{dtype}_{name}.pt")
            grad_rel = float((g - g1).norm() / g1.norm())
            loss_rel = abs(run["loss"] - one["loss"]) / abs(one["loss"])
            print(f"{dtype} {name}: grad rel {grad_rel:.2e}, loss rel {loss_rel:.2e}, peak "
                  f"{run['peak_bytes'] / 2**20:.0f} MiB vs {one['peak_bytes'] / 2**20:.0f} MiB")  # fmt: skip
            assert grad_rel <= tol, (dtype, name, grad_rel)
            assert loss_rel <= tol, (dtype, name, loss_rel)
        assert four["peak_bytes"] < 0.6 * one["peak_bytes"], (dtype, four, one)
        assert rec["peak_bytes"] < one["peak_bytes"], (dtype, rec, one)
