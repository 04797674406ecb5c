"""The torch backend's scoring engine: a teacher's (or reference model's) forward-only transformers causal LM,
batched by rows (`engines/torch/hf_model.py`: loading and the response-position forward pass).

Shape legend: B rows, T response positions, V vocabulary, K top-k.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.memory.residency import Residency
from mopd_hpc.engines.protocol import EngineError, ResidencyReport
from mopd_hpc.engines.torch.hf_model import CausalLMForward, load_causal_lm, resolve_device
from mopd_hpc.mopd.logprobs import Backend
from mopd_hpc.mopd.topk import TeacherTopK


class TorchScoringEngine:
    """A teacher's forward-only engine: no optimizer, no gradient (`torch.inference_mode`), batched by
    rows. Build with `from_pretrained`."""

    def __init__(
        self, model: torch.nn.Module, path: str, device: torch.device, max_batch_rows: int, backend: Backend
    ) -> None:
        if max_batch_rows < 1:
            raise EngineError(f"max_batch_rows={max_batch_rows}: expected >= 1")
        model.eval().requires_grad_(False)
        self.path = path
        self.max_batch_rows = max_batch_rows
        self.forward = CausalLMForward(model, device, backend)
        self.residency = Residency(model, device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_rows: int = 64,
        logprob_backend: Backend = "auto",
    ) -> TorchScoringEngine:
        """Load the checkpoint at `path` once. Raises EngineError (dtype, device) or OSError (path)."""
        dev = resolve_device(device)
        return cls(load_causal_lm(path, dtype, dev), str(path), dev, max_batch_rows, logprob_backend)

    @property
    def model(self) -> torch.nn.Module:
        return self.forward.model

    @property
    def device(self) -> torch.device:
        return self.forward.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def score(
        self, batch: TokenBatch, k: int | None = None, *, host: bool = True
    ) -> tuple[torch.Tensor, TeacherTopK | None]:
        """One forward: ([B, T] float32 log-probs of the response tokens, top-k [B, T, min(k, V)] or None).

        Rows are scored `max_batch_rows` at a time, their results kept on the device and joined there; host
        (default): then copied to the CPU; False: left on the engine's device (the teacher server packs them
        there, `teacher.score_frames.pack_answer`, and copies the packed answer to the host once).
        Raises:
            EngineError: the weights are offloaded, or k < 1.
        """
        if not self.residency.on_device:
            raise EngineError("weights are offloaded; onload() before scoring")
        if k is not None and k < 1:
            raise EngineError(f"k={k}: expected >= 1 (or None for no top-k)")
        lps, ids, vals = [], [], []
        with torch.inference_mode():
            for start in range(0, batch.batch_size, self.max_batch_rows):
                part = batch.rows(start, start + self.max_batch_rows).to(self.device)
                logits = self.forward.response_logits(part)
                lps.append(self.forward.token_logprobs(logits, part))
                if k is not None:
                    top = TeacherTopK.from_logits(logits, k)
                    ids.append(top.indices)
                    vals.append(top.logprobs.float())
                del logits
        out = [torch.cat(lps), *((torch.cat(ids), torch.cat(vals)) if k is not None else ())]
        if host:
            out = [t.cpu() for t in out]
        return out[0], (TeacherTopK(out[1], out[2]) if k is not None else None)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        return self.score(batch)[0]

    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        top = self.score(batch, k)[1]
        assert top is not None
        return top

    def load_weights(self, path: str | Path) -> None:
        """Replace the weights by those of the checkpoint at `path` (same architecture and shapes)."""
        fresh = load_causal_lm(path, "float32", torch.device("cpu"))
        own = self.model.state_dict()
        theirs = fresh.state_dict()
        if set(own) != set(theirs) or any(own[n].shape != theirs[n].shape for n in own):
            raise EngineError(f"checkpoint {path} does not match the loaded model's names and shapes")
        with torch.no_grad():
            for name, tensor in theirs.items():
                own[name].copy_(tensor)
        self.path = str(path)

    def offload(self) -> ResidencyReport:
        return self.residency.offload()

    def onload(self) -> ResidencyReport:
        return self.residency.onload()
