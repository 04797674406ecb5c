"""A transformers causal LM as both torch engines use it: dtypes, device resolution, loading, and the forward
pass that yields response-position logits and log-probs (`CausalLMForward`; no [B, L, V] logits exist).

Shape legend: B rows, L prompt + response positions, T response positions, V vocabulary, H hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.memory.estimates import MemoryModelError, ModelShape
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.mopd.logprobs import Backend, token_logprobs

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: Tokenizer files copied beside an exported student so the export is a complete HF checkpoint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def resolve_device(device: str) -> torch.device:
    """ "auto" → cuda (current device) when available, else cpu; "cuda"/"cuda:N" must be available.

    Raises:
        EngineError: CUDA asked for but not available, or an unparsable device string.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise EngineError(f"device={device!r}: {err}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device={device!r}: CUDA is not available on this host; use 'cpu' or 'auto'")
    return dev


def load_causal_lm(path: str | Path, dtype: str, device: torch.device) -> torch.nn.Module:
    """An HF checkpoint directory as a transformers `AutoModelForCausalLM` in `dtype` on `device`.

    Raises:
        EngineError: dtype not one of `DTYPES`. OSError: no checkpoint at `path`.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise EngineError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    return model.to(device)


class ResponseLogits(torch.nn.Module):
    """The causal LM as a module whose forward gives response-position logits (decoder, gather at the T
    positions, LM head, optional soft-capping): what `DistributedDataParallel` wraps, since DDP needs the
    whole forward to run through one module call. Its only submodule is `model` (the HF module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logit_positions: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, attention_mask [B, L] int64, logit_positions [B, T] int64 → [B, T, V] logits."""
        body = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out.last_hidden_state
        pos = logit_positions[..., None].expand(-1, -1, hidden.shape[-1])
        logits = head(hidden.gather(1, pos))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class CausalLMForward:
    """The forward pass both engines share: response-position logits and log-probs of a `TokenBatch`."""

    def __init__(self, model: torch.nn.Module, device: torch.device, backend: Backend = "auto") -> None:
        self.model = model
        self.module = ResponseLogits(model)
        self.device = device
        self.backend: Backend = backend
        self.softcap = self.module.softcap

    def response_logits(self, batch: TokenBatch, module: torch.nn.Module | None = None) -> torch.Tensor:
        """[B, T, V] logits (model dtype) at the positions that predict each response token, through
        `module` (a wrapper of `self.module` such as DistributedDataParallel) or `self.module`."""
        run = self.module if module is None else module
        return run(batch.input_ids, batch.attention_mask, batch.logit_positions)

    def token_logprobs(self, logits: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """[B, T] float32 log π(y_t) of the response tokens from `response_logits`; 0 at padding."""
        mask = batch.response_mask
        index = torch.where(mask, batch.response_ids, 0)
        return torch.where(mask, token_logprobs(logits, index, backend=self.backend), 0.0)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer of a transformers model in the backward, non-reentrant (works under DDP
    and with inputs that do not require grad): `activation_checkpointing_enable` (transformers >= 5.2x),
    else `gradient_checkpointing_enable`. Active in train mode only."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def memory_shape(model: torch.nn.Module) -> ModelShape | None:
    """The memory estimate's shape of a transformers model's config; None when it lacks a key it needs."""
    try:
        return ModelShape.from_hf_config(model.config.to_dict())
    except (MemoryModelError, AttributeError):
        return None
