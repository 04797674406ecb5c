"""Random-weight Qwen3 student and teacher checkpoints for the GPU benchmarks and tests (one place for all).

    python benchmarks/gpu_models.py DIR [--size 0.6b|1.7b]   # DIR/student and DIR/teacher, then exit

`make_models(directory, size)` writes `student/` (seed 0) and `teacher/` (seed 1), each a bf16 safetensors
checkpoint with config.json and the char tokenizer (`mopd_hpc.data.tokenizer`), built on the GPU when there
is one. `ensure_models(directory, size)` does the same in a child process, and only when
`student/config.json` is absent: the caller never opens a CUDA context of its own (a benchmark that reads
GPU memory measures its children only). `benchmarks/gpu_step.py --make-models` is this module's CLI too.
Weights are random: the figures they give are about the machinery's cost, not learning.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: Qwen3 shapes by size name (HF Qwen3Config fields; vocabulary 151,936 as the released models).
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # a CPU smoke size (benchmarks/weight_sync.py's ipc method on a machine without a GPU)
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=8192, tie_word_embeddings=True),
    # benchmarks/hf_decode.py's CPU size (its README figures: 64 x 128 rows x tokens on one thread)
    "decode-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}  # fmt: skip
#: (name, seed) of the checkpoints `make_models` writes.
MODELS = (("student", 0), ("teacher", 1))


def make_checkpoint(
    shape: dict,
    directory: Path,
    seed: int,
    tokenizer: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device: str | None = None,
) -> torch.nn.Module:
    """A random-initialized Qwen3 checkpoint (safetensors in `dtype` + config.json [+ the char tokenizer]);
    initialized in float32 under `torch.manual_seed(seed)` on `device` (None: the GPU when there is one, else
    the CPU), then cast. Returns the model, in `dtype` on that device (a caller that only needs the files
    drops it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    cfg = Qwen3Config(**shape, max_position_embeddings=40960, rope_theta=1_000_000.0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(str(directory))
    if tokenizer:
        from mopd_hpc.data.tokenizer import build_char_tokenizer

        build_char_tokenizer().save_pretrained(str(directory))
    return model


def make_models(directory: Path, size: str) -> Path:
    """`directory`/student and /teacher of the `SHAPES[size]` shape, in this process; returns `directory`.

    Raises:
        KeyError: size not in SHAPES.
    """
    for name, seed in MODELS:
        make_checkpoint(SHAPES[size], Path(directory) / name, seed, tokenizer=True)
    return Path(directory)


def ensure_models(directory: Path, size: str = "0.6b", timeout_s: float | None = 300) -> Path:
    """`make_models(directory, size)` in a child process unless `directory`/student/config.json exists;
    returns `directory`. Raises subprocess.CalledProcessError / TimeoutExpired when the child fails."""
    if not (Path(directory) / "student" / "config.json").exists():
        argv = [sys.executable, str(Path(__file__).resolve()), str(directory), "--size", size]
        subprocess.run(argv, check=True, timeout=timeout_s, cwd=REPO)
    return Path(directory)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="student/ and teacher/ are written here")
    p.add_argument("--size", default="1.7b", choices=sorted(SHAPES))
    args = p.parse_args(argv)
    make_models(args.directory, args.size)
    print(f"wrote {args.directory}/student and /teacher ({args.size} shape, random weights)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # mopd_hpc, when run as a script from anywhere
    raise SystemExit(main())
