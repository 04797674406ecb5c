"""megatron-core Llama logits equal transformers' for the same weights, on one GPU (issue 33; the test
`config/capabilities.py` MODEL_FAMILIES names for the megatron engine's Llama).

Two micro Llama checkpoints written by transformers (the megatron engine reads them through the HF ⇄ megatron
converter, `engines/megatron/convert.py`; no q/k norms): `llama31` (Llama 3.1's RoPE frequency scaling,
`rope_type: llama3` factor 8, untied embeddings, 3 layers) and `llama32_tied` (factor 32, tied embeddings as
Llama 3.2 1B/3B, 2 layers); `rope_theta` 500000 and `original_max_position_embeddings` 64 so that the scaling
bends frequencies the 48-token rows reach (engines/megatron/rope.py). One subprocess (megatron's parallel state
is per process): `MegatronScoringEngine.from_pretrained` (TP 1) against `LlamaForCausalLM` /
`TorchScoringEngine` on the same checkpoint, both on cuda:0.

Tolerances as tests/test_megatron_moe_gpu.py (a dense model has no routing flips, so they hold with margin):
float32 logits and response log-probs within 2e-4 of transformers' (the dense conversion GPU test's,
`test_megatron_convert.py::test_megatron_engines_on_gpu`); bfloat16: megatron-bf16's mean |error| against the
float32 truth ≤ 2 · transformers-bf16's + 2e-3, and the median |megatron − transformers| in bf16 ≤ 0.05 nats.

Skips without CUDA or without megatron-core. Run: `.venv/bin/python -m pytest -q tests/test_megatron_llama_gpu.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_megatron_moe_gpu import BF16_MEAN_FACTOR, BF16_MEAN_SLACK, BF16_MEDIAN, REPO, TOL_FP32

_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine
    from mopd_hpc.engines.megatron.engine import initialize_parallel
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    root = sys.argv[1]
    device = initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=0)
    def scaling(factor):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
    CASES = {
        "llama31": dict(num_hidden_layers=3, tie_word_embeddings=False, rope_scaling=scaling(8.0)),
        "llama32_tied": dict(num_hidden_layers=2, tie_word_embeddings=True, rope_scaling=scaling(32.0)),
    }
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (5, 19, 3, 30)]
    outputs = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (7, 14, 11, 18)]
    batch = TokenBatch.from_samples(prompts, outputs, pad_id=0)
    mask = batch.response_mask.cuda()
    report = {}
    for name, fields in CASES.items():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=250, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
            initializer_range=0.05, **fields)
        model = LlamaForCausalLM(cfg)
        path = f"{root}/{name}"
        model.save_pretrained(path)
        lps, logits = {}, {}
        for dtype in ("float32", "bfloat16"):
            mc = MegatronScoringEngine.from_pretrained(path, dtype=dtype, device=device)
            with torch.no_grad():
                logits[("mc", dtype)] = mc.forward.response_logits(batch)[..., :250].float()
            lps[("mc", dtype)] = mc.logprobs(batch).cuda()
            del mc
            hf = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
            with torch.no_grad():
                out = hf(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda()).logits
            index = batch.logit_positions.cuda()[..., None].expand(-1, -1, out.shape[-1])
            logits[("hf", dtype)] = out.gather(1, index).float()
            del hf
            lps[("hf", dtype)] = TorchScoringEngine.from_pretrained(path, dtype=dtype, device="cuda").logprobs(batch).cuda()
            torch.cuda.empty_cache()
        def err(a, b):
            return (a - b).abs()[mask]
        truth = lps[("hf", "float32")]
        report[name] = {
            "logits_err_fp32": err(logits[("mc", "float32")], logits[("hf", "float32")]).max().item(),
            "logprob_err_fp32": err(lps[("mc", "float32")], truth).max().item(),
            "mean_err_bf16_megatron": err(lps[("mc", "bfloat16")], truth).mean().item(),
            "mean_err_bf16_hf": err(lps[("hf", "bfloat16")], truth).mean().item(),
            "median_bf16_megatron_vs_hf": err(lps[("mc", "bfloat16")], lps[("hf", "bfloat16")]).median().item(),
            "logprob_mean": truth[mask].mean().item(),
            "tokens": int(mask.sum()),
        }
    print(json.dumps(report))
    """
)


@pytest.mark.gpu
def test_megatron_llama_logits_equal_transformers(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    for name, r in report.items():
        assert r["tokens"] == 50 and r["logprob_mean"] < 0, (name, r)
        assert r["logits_err_fp32"] < TOL_FP32, (name, r)
        assert r["logprob_err_fp32"] < TOL_FP32, (name, r)
        bound = BF16_MEAN_FACTOR * r["mean_err_bf16_hf"] + BF16_MEAN_SLACK
        assert r["mean_err_bf16_megatron"] <= bound, (name, r)
        assert r["median_bf16_megatron_vs_hf"] <= BF16_MEDIAN, (name, r)
