"""The megatron actor's loss and gradient against the torch actor's, for every estimator × correction ×
composition point that the loss section accepts (issue 20). Run as a script in its own process (megatron's
parallel state is per process): `python tests/mopd/objective_parity.py OUT_DIR DEVICE` with DEVICE `cpu` or `cuda`.

Both engines start from one HF checkpoint (a micro Qwen3, float32, untied embeddings so lm_head and the
embedding are separate parameters), score one batch (4 rows of different lengths, one with an empty
response), and for each point compute the loss and its gradient:
- torch: `TorchTrainEngine.compute_loss` + backward, the HF parameters' .grad.
- megatron, DEVICE cuda: a fresh `MegatronTrainEngine` (megatron DDP, distributed optimizer, fp32) per point,
  `train_step` once; the DDP's fp32 `main_grad` of every parameter read after the step.
- megatron, DEVICE cpu: megatron-core's GPTModel runs a forward on CPU once its rotary embedding's
  `torch.cuda.current_device()` answers "cpu" (it moves inv_freq there); megatron's DDP and optimizer need
  CUDA, so `MegatronTrainEngine.compute_loss` runs on an engine without them (the bare GPTModel) + backward.
The megatron gradients are mapped to HF names through the converter (`mcore_to_hf`: fused QKV split, gate/up
split) and compared by relative L2 norm over all parameters. Writes OUT_DIR/parity.json: point → {loss_torch,
loss_megatron, grad_rel, grad_norm}.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

VOCAB = 128
TOPK_A, TOPK_B = 8, VOCAB  # teacher b's k = V: the exact reverse KL


def points() -> dict[str, dict]:
    """name → LossConfig fields: every point `--check` accepts, apart from the KL penalty (reference model)."""
    out: dict[str, dict] = {}
    for correction in ("truncate", "mask", "none"):
        for comp, extra in (
            ("pure", {}),
            ("rl", {"rl_coefficient": 0.5}),
            ("alpha", {"orm_alpha": 0.5}),
            ("rl_alpha", {"rl_coefficient": 0.5, "orm_alpha": 0.5}),
        ):
            out[f"sampled/{correction}/{comp}"] = {"estimator": "sampled", "correction": correction, **extra}
    out["sampled/truncate/pure/seq-mean"] = {"correction": "truncate", "normalizer": "seq-mean-token-mean"}
    out["sampled/none/advantage_clip"] = {"correction": "none", "advantage_clip": 0.5}
    out["topk/none/pure"] = {"estimator": "topk", "topk": TOPK_A}
    out["topk/none/rl"] = {"estimator": "topk", "topk": TOPK_A, "rl_coefficient": 0.5}
    out["topk/none/pure/seq-mean"] = {
        "estimator": "topk",
        "topk": TOPK_A,
        "normalizer": "seq-mean-token-mean",
    }
    out["rl_only"] = {"distillation_coefficient": 0.0, "rl_coefficient": 1.0}
    return out


def save_checkpoint(path: Path, seed: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.1,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(str(path))
    return path


def make_batch(student: Path, teacher: Path):
    """The batch every point trains on: μ, S/W, two teachers' top-k, per-row weights and A_ORM."""
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.mopd.targets import aggregate_teacher_targets

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 4)]
    outputs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 4, 11, 0)]
    tokens = TokenBatch.from_samples(prompts, outputs, pad_id=0)
    own = TorchScoringEngine.from_pretrained(student, dtype="float32", device="cpu")
    lp_student, _ = own.score(tokens)
    mask = tokens.response_mask
    behavior = torch.where(mask, lp_student + 0.4 * torch.randn(lp_student.shape, generator=g), 0.0)
    scorer = TorchScoringEngine.from_pretrained(teacher, dtype="float32", device="cpu")
    lp_a, top_a = scorer.score(tokens, TOPK_A)
    lp_b, top_b = scorer.score(tokens, TOPK_B)  # one teacher model scored twice: two "teachers"
    weights = [{"a": 1.0}, {"a": 0.5, "b": 0.5}, {"b": 1.0}, {"a": 1.0}]
    targets = aggregate_teacher_targets({"a": lp_a, "b": lp_b - 0.3}, weights)
    top_b = type(top_b)(top_b.indices, top_b.logprobs - 0.3)
    w = {tid: torch.tensor([row.get(tid, 0.0) for row in weights]) for tid in ("a", "b")}
    return TrainBatch.create(
        tokens, behavior, targets=targets, teacher_topk={"a": top_a, "b": top_b}, teacher_weights=w,
        orm_advantages=torch.tensor([1.0, -0.5, 0.25, -1.0]),
    )  # fmt: skip


def torch_side(student: Path, cfg, batch, device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.torch.engine import TorchTrainEngine

    engine = TorchTrainEngine.from_pretrained(
        student, dtype="float32", device=str(device), optimizer=OptimizerConfig(lr=1e-3), loss=cfg
    )
    engine.model.train()
    loss, _, _ = engine.compute_loss(batch.to(device))
    loss.backward()
    grads = {
        n: p.grad.detach().cpu().clone() for n, p in engine.model.named_parameters() if p.grad is not None
    }
    return float(loss), grads


def megatron_side(student: Path, cfg, batch, device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    from types import SimpleNamespace

    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.megatron.build import build_from_hf, read_hf_checkpoint, rope_theta
    from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, mcore_to_hf
    from mopd_hpc.engines.megatron.engine import MegatronForward, MegatronTrainEngine
    from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state

    config, hf = read_hf_checkpoint(student)
    if device.type == "cuda":
        model, shape = build_from_hf(student, config, "float32", device)
    else:  # megatron's CUDA RNG tracker is not set up on CPU: initialize on the CPU, then load (as build_from_hf)
        shape = Qwen3Shape.from_hf_config(config)
        model = build_gpt_model(shape, "float32", 1, rope_theta=rope_theta(config), cpu_init=True,
                                layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)))  # fmt: skip
        load_mcore_state(model, hf_to_mcore(hf, shape))
    if device.type == "cuda":
        engine = MegatronTrainEngine(
            model, shape, config, cfg, OptimizerConfig(lr=1e-3, grad_clip=None), device, "float32"
        )
        loss = engine.train_step(batch)["loss"]
        grads = {n: p.main_grad.detach().float().cpu() for n, p in model.named_parameters()}
    else:
        engine = object.__new__(MegatronTrainEngine)  # no megatron DDP / optimizer: those need CUDA
        engine.loss_config, engine.shape, engine.device = cfg, shape, device
        engine.forward = MegatronForward(model, device)
        engine.residency = SimpleNamespace(on_device=True)
        engine.ddp = engine.model = model
        model.train()
        value, _, _ = engine.compute_loss(batch.to(device))
        value.backward()
        loss = float(value)
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    global LAST_ENGINE
    LAST_ENGINE = engine
    return loss, mcore_to_hf(grads, shape)


#: The last megatron engine built (for the student's own top-k, `MegatronTrainEngine.topk`).
LAST_ENGINE = None


def main(out: Path, device_name: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from mopd_hpc.config.loss import LossConfig

    if device_name == "cuda":
        from mopd_hpc.engines.megatron.parallel import initialize_parallel

        device = initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=0)
    else:
        from megatron.core import parallel_state

        torch.cuda.current_device = lambda: "cpu"  # GPTModel's rotary embedding moves inv_freq there
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        device = torch.device("cpu")
    student = save_checkpoint(out / "student", 0)
    teacher = save_checkpoint(out / "teacher", 1)
    batch = make_batch(student, teacher)
    report = {}
    for name, fields in points().items():
        cfg = LossConfig(**fields)
        loss_t, grad_t = torch_side(student, cfg, batch, device)
        loss_m, grad_m = megatron_side(student, cfg, batch, device)
        keys = sorted(grad_t)
        assert sorted(grad_m) == keys, (sorted(grad_m), keys)
        gt = torch.cat([grad_t[k].flatten() for k in keys])
        gm = torch.cat([grad_m[k].flatten() for k in keys])
        report[name] = {
            "loss_torch": loss_t,
            "loss_megatron": loss_m,
            "grad_rel": float((gm - gt).norm() / gt.norm()),
            "grad_norm": float(gt.norm()),
        }
        print(name, report[name], flush=True)
    # the student's own top-k (no gradient) of both engines: the last point's weights (after its step on cuda:
    # the torch engine gets those weights through the converter)
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.megatron.convert import mcore_to_hf
    from mopd_hpc.engines.torch.engine import TorchTrainEngine

    megatron = LAST_ENGINE
    hf = TorchTrainEngine.from_pretrained(
        student, dtype="float32", device=str(device), optimizer=OptimizerConfig(lr=1e-3), loss=LossConfig()
    )
    state = {k: v.detach() for k, v in megatron.model.state_dict().items() if isinstance(v, torch.Tensor)}
    hf.model.load_state_dict(mcore_to_hf(state, megatron.shape), strict=False)
    got, want = megatron.topk(batch.tokens, 5), hf.topk(batch.tokens.to(device), 5)
    mask = batch.tokens.response_mask
    report["student_topk"] = {
        "logprob_err": float((got.logprobs - want.logprobs.cpu()).abs()[mask].max()),
        "ids_equal_frac": float((got.indices == want.indices.cpu()).all(-1)[mask].float().mean()),
    }
    print("student_topk", report["student_topk"], flush=True)
    (out / "parity.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
