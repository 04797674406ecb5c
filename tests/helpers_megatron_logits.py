"""The GPU comparison of the megatron scoring engine's logits and log-probs with transformers' on the same
checkpoint, shared by tests/engines/test_megatron_moe_gpu.py and tests/engines/test_megatron_llama_gpu.py (the tolerances are
explained in the former's docstring).

A test's script defines `root`, `device` (after `initialize_parallel`), `batch` (a `TokenBatch`), `mask` (its
response mask on cuda), `HF_CLASS` (the transformers causal-LM class), `CASES` (name → config fields) and
`make_model(fields)`, then appends `COMPARE`, which prints one JSON line: per case the float32 errors, the
bfloat16 errors against the float32 truth and between the two stacks, the mean log-prob and the token count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOL_FP32 = 2e-4  # tests/engines/test_megatron_convert.py::test_megatron_engines_on_gpu
BF16_MEAN_FACTOR, BF16_MEAN_SLACK, BF16_MEDIAN = 2.0, 2e-3, 0.05

COMPARE = textwrap.dedent(
    """
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    report = {}
    for name, fields in CASES.items():
        torch.manual_seed(0)
        model = make_model(fields)
        path = f"{root}/{name}"
        model.save_pretrained(path)
        lps, logits = {}, {}
        for dtype in ("float32", "bfloat16"):
            mc = MegatronScoringEngine.from_pretrained(path, dtype=dtype, device=device)
            with torch.no_grad():
                logits[("mc", dtype)] = mc.forward.response_logits(batch)[..., :250].float()
            lps[("mc", dtype)] = mc.logprobs(batch).cuda()
            del mc
            hf = HF_CLASS.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
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
            "max_err_bf16_megatron": err(lps[("mc", "bfloat16")], truth).max().item(),
            "median_bf16_megatron_vs_hf": err(lps[("mc", "bfloat16")], lps[("hf", "bfloat16")]).median().item(),
            "logprob_mean": truth[mask].mean().item(),
            "tokens": int(mask.sum()),
        }
    print(json.dumps(report))
    """
)


def run_and_check(script: str, tmp_path: Path, tokens: int) -> dict:
    """Run `script` + `COMPARE` in a subprocess on cuda:0 (skips without CUDA or megatron-core) and assert
    every case's errors within the tolerances; the report."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", script + COMPARE, str(tmp_path)],
        capture_output=True, text=True, timeout=400, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    for name, r in report.items():
        assert r["tokens"] == tokens and r["logprob_mean"] < 0, (name, r)
        assert r["logits_err_fp32"] < TOL_FP32, (name, r)
        assert r["logprob_err_fp32"] < TOL_FP32, (name, r)
        bound = BF16_MEAN_FACTOR * r["mean_err_bf16_hf"] + BF16_MEAN_SLACK
        assert r["mean_err_bf16_megatron"] <= bound, (name, r)
        assert r["median_bf16_megatron_vs_hf"] <= BF16_MEDIAN, (name, r)
    return report
