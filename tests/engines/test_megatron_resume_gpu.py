"""Exact resume of the megatron actor on one GPU: the checkpoint carries the distributed optimizer's parameter
state (fp32 main params, Adam's exp_avg and exp_avg_sq; engines/megatron/optimizer_state.py).

A random tiny Qwen3 (bf16, TP 1 × DP 1), four actors in one process on recorded steps (random rows, behavior
and teacher targets fixed per step):
- A: steps 1, 2, the checkpoint of step 2 (`save_checkpoint` with the engine's state_dict: model.pt, the
  parameter state in its own file optimizer_param_state.pt, read back memory-mapped, and the manifest of
  both), step 3;
- B: steps 1-3 straight, the same as A: is the step deterministic run to run? (its step-3 weights must equal
  A's bitwise: the comparison below is then bitwise, no tolerance);
- R: a fresh actor built from OTHER random weights loads A's step-2 checkpoint (`load_latest`, verified),
  then step 3: its weights, optimizer state (main params, exp_avg, exp_avg_sq gathered as the checkpoint
  does) and step count after the load equal B's after step 2 bitwise, its step-3 loss, lr and weights
  equal B's bitwise;
- N: the same load without the parameter state (what the checkpoint held before): its step-3 weights
  differ from B's (the comparison can fail).
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
from mopd_hpc.engines.megatron import optimizer_state
from mopd_hpc.engines.megatron.build import build_from_hf
from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
from mopd_hpc.engines.megatron.parallel import initialize_parallel
from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.trainer.checkpoint import load_latest, save_checkpoint

root, port = sys.argv[1], int(sys.argv[2])
cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
for seed, name in ((0, "ckpt"), (5, "other")):
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(os.path.join(root, name))
config = json.load(open(os.path.join(root, "ckpt", "config.json")))
device = initialize_parallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, tensor_parallel=1,
                             device_index=0)

def batch(step):
    g = torch.Generator().manual_seed(10 + step)
    tokens = TokenBatch.from_samples([torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3)],
                                     [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 4, 11)],
                                     pad_id=0)
    behavior = -torch.rand(3, tokens.response_width, generator=g) * 5
    target = -torch.rand(3, tokens.response_width, generator=g) * 5
    return TrainBatch.create(tokens, behavior_logprobs=behavior, targets=TeacherTargets(target, torch.ones_like(behavior)))

def actor(name):
    model, shape = build_from_hf(os.path.join(root, name), config, "bfloat16", device)
    return MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=1e-3), device, "bfloat16")

def weights(engine):
    return {k: v.detach().cpu().clone() for k, v in engine._local_state().items()}

def opt_state(engine):  # the gathered parameter state: list of {buffer: {dtypes: {param, exp_avg, exp_avg_sq}}}
    return [{(i, str(d), k): t.clone() for i, parts in s.items() if isinstance(i, int)
             for d, part in parts.items() for k, t in part.items() if isinstance(t, torch.Tensor)}
            for s in optimizer_state.gather(engine.optimizer)]

def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

def eq(a, b):  # nested dicts/lists of numbers and tensors, tensors bitwise
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN (no grad norm without clipping) equals NaN

def no_spans(stats):  # a step's statistics without its time/train/* spans (seconds: never equal run to run)
    return [{k: v for k, v in x.items() if not k.startswith("time/")} for x in stats]

def same_states(a, b):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))

def steps_of(sd):  # every "step" entry of the optimizer's state_dict (param groups)
    if isinstance(sd, dict):
        return [v for k, v in sd.items() if k == "step"] + [s for v in sd.values() for s in steps_of(v)]
    if isinstance(sd, (list, tuple)):
        return [s for v in sd for s in steps_of(v)]
    return []

ck = os.path.join(root, "checkpoints")
r = {}
a, b = actor("ckpt"), actor("ckpt")
stats = {"a": [], "b": []}
for step in (1, 2):
    stats["a"].append(a.train_step(batch(step)))
    stats["b"].append(b.train_step(batch(step)))
import copy
b_two = {"weights": weights(b), "opt": opt_state(b), "optimizer_sd": copy.deepcopy(b.optimizer.state_dict())}
save_checkpoint(ck, 2, a.state_dict(), data_state={}, extra={})
stats["a"].append(a.train_step(batch(3)))
stats["b"].append(b.train_step(batch(3)))
r["deterministic"] = same(weights(a), weights(b)) and eq(no_spans(stats["a"]), no_spans(stats["b"]))
loaded = load_latest(ck)
r["has_param_state"] = loaded.engine_state.get(optimizer_state.PARAM_STATE_KEY) is not None
step_dir = os.path.join(ck, "step_000002")
r["param_state_own_file"] = [  # its own file, in the manifest; model.pt holds only its layout
    os.path.isfile(os.path.join(step_dir, optimizer_state.PARAM_STATE_FILE)),
    optimizer_state.PARAM_STATE_FILE in json.load(open(os.path.join(step_dir, "manifest.json")))["files"],
    optimizer_state.PARAM_STATE_KEY in torch.load(os.path.join(step_dir, "model.pt"), weights_only=True),
]
fresh = actor("other")
r["fresh_differs"] = not same(weights(fresh), b_two["weights"])
fresh.load_state_dict(loaded.engine_state)
r["loaded_weights_equal"] = same(weights(fresh), b_two["weights"])
r["loaded_opt_state_equal"] = same_states(opt_state(fresh), b_two["opt"])
r["loaded_optimizer_sd_equal"] = eq(fresh.optimizer.state_dict(), b_two["optimizer_sd"])
r["loaded_steps"] = [fresh.steps, b.steps - 1, [float(x) for x in steps_of(fresh.optimizer.state_dict())],
                     [float(x) for x in steps_of(b_two["optimizer_sd"])]]
s3 = fresh.train_step(batch(3))
r["step3_stats_equal"] = eq(no_spans([s3]), no_spans(stats["b"][2:]))
r["lr"] = [s3["lr"], stats["b"][2]["lr"]]
r["step3_weights_equal"] = same(weights(fresh), weights(b))
r["step3_opt_state_equal"] = same_states(opt_state(fresh), opt_state(b))
r["step3_optimizer_sd_equal"] = eq(fresh.optimizer.state_dict(), b.optimizer.state_dict())
no_state = dict(loaded.engine_state)
no_state[optimizer_state.PARAM_STATE_KEY] = no_state[optimizer_state.PARAM_LAYOUT_KEY] = None
n = actor("other")
n.load_state_dict(no_state)
n.train_step(batch(3))
r["without_param_state_differs"] = not same(weights(n), weights(b))
json.dump(r, open(os.path.join(root, "report.json"), "w"))
"""


@pytest.mark.gpu
def test_megatron_resume_equals_the_straight_run_bitwise(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    script = tmp_path / "resume.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(free_port())], capture_output=True,
                          text=True, timeout=240, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "report.json").read_text())
    print(json.dumps(r))  # for the record (-s)
    assert r["deterministic"] is True  # two straight runs agree bitwise: no tolerance is needed below
    assert r["has_param_state"] is True
    assert r["param_state_own_file"] == [True, True, False]
    assert r["fresh_differs"] is True  # the resumed actor starts elsewhere: all it has is the checkpoint
    assert r["loaded_weights_equal"] is True
    assert r["loaded_opt_state_equal"] is True  # fp32 main params, exp_avg, exp_avg_sq after step 2
    assert r["loaded_optimizer_sd_equal"] is True  # step count, lr
    fresh_steps, straight_steps, fresh_sd_steps, straight_sd_steps = r["loaded_steps"]
    assert fresh_steps == straight_steps == 2 and fresh_sd_steps == straight_sd_steps
    assert r["step3_stats_equal"] is True and r["lr"][0] == r["lr"][1]
    assert r["step3_weights_equal"] is True
    assert r["step3_opt_state_equal"] is True and r["step3_optimizer_sd_equal"] is True
    assert r["without_param_state_differs"] is True
