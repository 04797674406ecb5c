"""A periodic export from the megatron actor (trainer/exports.py over `MegatronTrainEngine.save_pretrained`): the
megatron weights go through the converter (engines/megatron/convert.py `mcore_to_hf`), and the export loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`, its logits equal to the model whose
weights the actor holds (float32, 1e-5).

megatron's GPTModel needs CUDA, so the engine here holds a micro Qwen3's weights converted to megatron's names
(`hf_to_mcore`, padded vocabulary rows included) in a module whose state_dict is that megatron state, at TP 1
(`parallel.tp_info` answers TP 1 without megatron's parallel state); the conversion, the engine's export and the
exporter are the real code. Tied and untied embeddings. The GPU path of the same engine is tested by the
megatron GPU tests (test_megatron_*_gpu.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_models import save_micro_qwen3
from transformers import AutoModelForCausalLM, AutoTokenizer

from mopd_hpc.data.tokenizer import VOCAB_SIZE, build_char_tokenizer
from mopd_hpc.engines.megatron import engine as megatron_engine
from mopd_hpc.engines.megatron import parallel as megatron_parallel
from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, pad_vocab_size
from mopd_hpc.trainer.exports import list_exports, write_export


class _State(torch.nn.Module):
    """A module whose state_dict is the given megatron state (buffers under megatron's dotted names)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._names = dict(state)

    def state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - torch's signature
        return dict(self._names)


def megatron_actor(hf_dir: Path) -> tuple[megatron_engine.MegatronTrainEngine, torch.nn.Module]:
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    shape = Qwen3Shape.from_hf_config(hf.config, pad_vocab_size(hf.config.vocab_size, 1))
    actor = object.__new__(megatron_engine.MegatronTrainEngine)
    actor.model = _State(hf_to_mcore(hf.state_dict(), shape))
    actor.shape, actor.hf_config = shape, json.loads((hf_dir / "config.json").read_text())
    actor.residency = SimpleNamespace(on_device=True)
    actor.shard_plan = SimpleNamespace(tp=1)
    return actor, hf


@pytest.mark.parametrize("tied", [True, False])
def test_megatron_export_loads_and_equals_its_weights(tmp_path: Path, monkeypatch, tied: bool) -> None:
    monkeypatch.setattr(megatron_parallel, "tp_info", lambda: (1, 0, None))
    hf_dir = save_micro_qwen3(
        tmp_path / "hf", seed=4, vocab_size=VOCAB_SIZE, initializer_range=0.2, tied=tied
    )
    actor, hf = megatron_actor(hf_dir)
    assert actor.shape.padded_vocab_size > VOCAB_SIZE  # the converter drops megatron's padding rows
    for step in (1, 2, 3):
        path = write_export(actor, build_char_tokenizer(), tmp_path / "run", step, keep=2)
    assert [s for s, _ in list_exports(tmp_path / "run")] == [2, 3] and path.name == "step_000003"
    exported = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    assert exported.config.tie_word_embeddings == tied
    ids = torch.tensor([[1, 5, 9, 13, 7, 3, 11], [2, 4, 6, 8, 10, 12, 14]])
    with torch.inference_mode():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=1e-5
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("1+2=")["input_ids"] == build_char_tokenizer()("1+2=")["input_ids"]
