"""Shared test helpers for the tiny models: load the builder script, build micro models once per session.

`tools/` is not a package, so the builder is loaded from its path with importlib.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILDER_PATH = REPO_ROOT / "tools" / "build_tiny_models.py"
MODEL_NAMES = ("teacher_chain_sum", "teacher_leg_counting", "student")
#: The shape fields of the released Qwen3-0.6B's config.json (as `benchmarks/gpu_models.py` SHAPES["0.6b"]):
#: what the memory-plan and floor tests read for a production model. Copy before changing (`{**QWEN3_0_6B, …}`).
QWEN3_0_6B = {
    "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip
#: Qwen3-1.7B: the 0.6B's fields but hidden 2048, MLP 6144.
QWEN3_1_7B = {**QWEN3_0_6B, "hidden_size": 2048, "intermediate_size": 6144}


def load_builder() -> ModuleType:
    """The `tools/build_tiny_models.py` module (imported once, cached in sys.modules)."""
    name = "mopd_tools_build_tiny_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BUILDER_PATH)
    assert spec is not None and spec.loader is not None, BUILDER_PATH
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_micro_models(out: Path, threads: int = 1) -> int:
    """Run the builder's `main` in-process with `--micro`; returns its exit status.

    The builder sets torch's thread count; the caller's count is restored afterwards.
    """
    import torch

    before = torch.get_num_threads()
    try:
        return load_builder().main(["--out", str(out), "--micro", "--threads", str(threads)])
    finally:
        torch.set_num_threads(before)


def save_micro_qwen3(
    path: Path, seed: int, *, vocab_size: int = 32, initializer_range: float | None = None, tied: bool = True
) -> Path:
    """A 1-layer Qwen3ForCausalLM (hidden 32, 2 heads, GQA 2:1, tied embeddings unless `tied` is False) saved
    as an HF checkpoint.

    Seeded: the same `seed` gives the same weights. No tokenizer (tests talk in token ids). Built in
    well under a second; `initializer_range` None keeps transformers' default (0.02), 0.2 makes the
    distributions far from uniform.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    extra = {} if initializer_range is None else {"initializer_range": initializer_range}
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
        **extra,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    return path


#: The micro Qwen3-MoE's experts and experts per token (`save_micro_moe`).
MOE_EXPERTS, MOE_TOP_K = 4, 2


def save_micro_moe(path: Path, seed: int = 0, aux: float = 0.05, vocab_size: int = 32) -> Path:
    """A 2-layer Qwen3MoeForCausalLM (hidden 32, 4 experts of f_e 16, top 2, router_aux_loss_coef `aux`)
    saved as an HF checkpoint; the router weights drawn large (transformers initializes them to 0) so that
    routing depends on the token. Seeded; no tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, router_aux_loss_coef=aux, initializer_range=0.2, norm_topk_prob=True,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(path))
    return path


def save_micro_model_dir(path: Path, seed: int = 0) -> Path:
    """A micro Qwen3 checkpoint with the tiny models' character tokenizer: config.json, model.safetensors and
    the tokenizer files, as a child reads them (vocabulary of 45 tokens)."""
    from mopd_hpc.data.tokenizer import VOCAB_SIZE, build_char_tokenizer, save_char_tokenizer

    save_micro_qwen3(path, seed, vocab_size=VOCAB_SIZE)
    save_char_tokenizer(build_char_tokenizer(), path)
    return path


def write_hub_snapshot(cache: Path, repo_id: str, source: Path, revision: str = "0" * 39 + "1") -> Path:
    """Put the files of directory `source` into the Hugging Face hub cache `cache` as the hub writes them:
    `models--org--name/blobs/<sha256>` files, `snapshots/<revision>/<name>` symlinks to them, `refs/main`
    naming the revision. Returns the snapshot directory."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if not file.is_file():
            continue
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def write_stub_checkpoint(path: Path, config: dict) -> Path:
    """A checkpoint directory that passes `mopd-submit --check`'s file checks without real weights: the given
    config.json (e.g. a production model's shape, for the memory plan; model_type qwen3 and architectures
    [Qwen3ForCausalLM] unless it names them: the megatron engine's check reads the architecture),
    the tiny tokenizer's files and a one-tensor model.safetensors (its header consistent with its size)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from mopd_hpc.data.tokenizer import build_char_tokenizer, save_char_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    base = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    save_char_tokenizer(build_char_tokenizer(), path)
    save_file({"stub": np.zeros(4, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


#: A chat template in the tiny tokenizer's alphabet (roles, contents, the generation prompt).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }},{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def hub_cache_for(configs: list[Path], root: Path) -> Path:
    """A hub cache under `root` holding every hub id the run configs `configs` name as a model path
    (Qwen/Qwen3-0.6B, ...), each one micro model with the tiny tokenizer: `mopd-submit` resolves the ids and
    checks the files there, as on a host that has downloaded them. Returns the cache (for HF_HUB_CACHE)."""
    from mopd_hpc.config import RunConfig
    from mopd_hpc.launch.hub_cache import is_hub_id
    from mopd_hpc.launch.model_check import model_paths

    ids = [
        m.value
        for path in configs
        for m in model_paths(RunConfig.from_yaml(path))
        if is_hub_id(m.value) and not (REPO_ROOT / m.value).is_dir()
    ]
    model = save_micro_model_dir(root / "micro")
    # the hub's chat models ship a chat template (Qwen3: in tokenizer_config.json); a stand-in in the tiny
    # tokenizer's alphabet, as transformers also reads it, so a `template: chat` source passes --check
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for repo_id in dict.fromkeys(ids):
        write_hub_snapshot(root / "cache", repo_id, model)
    return root / "cache"
