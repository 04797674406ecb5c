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
