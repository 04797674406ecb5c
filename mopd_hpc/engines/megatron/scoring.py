"""A teacher's forward-only engine on megatron-core (DESIGN.md §5): `MegatronScoringEngine`. GPU only.

The shared pieces live in `parallel.py` (`initialize_parallel`, `tp_info`), `build.py` (`build_from_hf`,
`read_hf_checkpoint`) and `engine.py` (the labels-path forward `MegatronForward`). `tp_info` is reached
through its module (`parallel.tp_info()`) at call time, so a test's stand-in for it applies here too.

Log-probs: GPTModel's labels path (vocab-parallel cross entropy, any tensor_parallel; `engine.py`).

Top-k (`MegatronScoringEngine.score(batch, k)`, any tensor_parallel): GPTModel's forward without labels gives
this rank's vocab-parallel logits [B, L, V'/tp] (model dtype); at the response positions
`mopd.vocab_parallel.vocab_parallel_score` takes the log-softmax normalizer (per-shard max and sum-exp
all-reduced over the TP group), the response tokens' log-probs (each read on the rank owning the id), each
shard's top-k with global ids (ids ≥ V, megatron's padding, excluded), then all-gathers the [B, T, tp·k]
candidates and takes their top-k. TP = 1 is the same code with no collective. No rank holds a float32
[B, T, V] tensor (the model-dtype logits, one float32 block of rows, [B, T, tp·k] candidates); every rank of
the TP group makes the same call and gets the same answer (a TP replica's followers drop theirs).

Shape legend: B rows, L prompt + response positions, T response positions, V vocabulary (V' padded), K top-k.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.megatron import build, parallel
from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, shard_tp
from mopd_hpc.engines.megatron.engine import MegatronForward
from mopd_hpc.engines.megatron.model import DTYPES, load_mcore_state
from mopd_hpc.engines.megatron.residency import scoring_residency
from mopd_hpc.engines.memory.residency import RequiresResident
from mopd_hpc.engines.protocol import EngineError, ResidencyReport
from mopd_hpc.mopd.topk import TeacherTopK
from mopd_hpc.mopd.vocab_parallel import (
    process_group_all_gather,
    process_group_all_reduce,
    vocab_parallel_score,
)


class MegatronScoringEngine(RequiresResident):
    """A teacher's forward-only engine on megatron-core: no optimizer state, no DDP wrapper; residency is
    parameters only. The teacher server's surface, as `TorchScoringEngine`: `score`, `vocab_size`,
    `load_weights`, `offload`/`onload`, `residency`, `path`, `pad_token_id`, `device`. Build with
    `from_pretrained` after `initialize_parallel`.

    Every CUDA call runs under `torch.cuda.device(self.device)`: the server calls the engine from worker
    threads, whose current CUDA device is not the one `initialize_parallel` set (megatron allocates on the
    current device).
    """

    OFFLOADED = "the teacher's weights are offloaded"

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        hf_config: Mapping[str, Any],
        *,
        path: str | Path | None = None,
        max_batch_rows: int = 16,
    ) -> None:
        if max_batch_rows < 1:
            raise EngineError(f"max_batch_rows={max_batch_rows}: expected >= 1")
        model.eval().requires_grad_(False)
        self.model, self.device, self.max_batch_rows = model, device, max_batch_rows
        self.hf_config = dict(hf_config)
        self.shape = Qwen3Shape.from_hf_config(self.hf_config)
        self.path = None if path is None else str(path)
        self.forward = MegatronForward(model, device)
        self.residency = scoring_residency(model, device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: str = "bfloat16",
        device: torch.device | str,
        max_batch_rows: int = 16,
    ) -> MegatronScoringEngine:
        """This TP rank's shard of the HF checkpoint at `path`, in `dtype`, on CUDA `device`.

        Raises:
            EngineError: dtype not one of `DTYPES`, a non-CUDA device, or a checkpoint without safetensors.
            OSError: no config.json at `path`.
        """
        if dtype not in DTYPES:
            raise EngineError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise EngineError(
                f"device={str(dev)!r}: the megatron engine runs on CUDA only; expected 'cuda:N'"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        config = json.loads((Path(path) / "config.json").read_text())
        with torch.cuda.device(dev):
            model, _ = build.build_from_hf(path, config, dtype, dev)
        return cls(model, dev, config, path=path, max_batch_rows=max_batch_rows)

    @property
    def vocab_size(self) -> int:
        """V of the HF checkpoint (never megatron's padded V'): token ids and top-k ids are in [0, V)."""
        return self.shape.vocab_size

    @property
    def pad_token_id(self) -> int | None:
        """The checkpoint config's `pad_token_id` (None when it names none)."""
        pad = self.hf_config.get("pad_token_id")
        return None if pad is None else int(pad)

    def _device_scope(self) -> contextlib.AbstractContextManager[Any]:
        """`torch.cuda.device(self.device)` (the calling thread's current device), or nothing off CUDA."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def logprobs(self, batch: TokenBatch, *, host: bool = True) -> torch.Tensor:
        """[B, T] float32 log π(y_t) through GPTModel's labels path (vocab-parallel cross entropy: any
        tensor_parallel); 0 at padded positions. On the CPU (host), else left on the engine's device (the
        teacher server packs it there and copies the packed answer to the host once,
        `teacher_wire.pack_answer`: no copy of the padded rows). Raises EngineError when offloaded."""
        self._require_resident("logprobs")
        with self._device_scope(), torch.inference_mode():
            parts = [
                self.forward.token_logprobs(batch.rows(i, min(i + self.max_batch_rows, batch.batch_size)))
                for i in range(0, batch.batch_size, self.max_batch_rows)
            ]
            out = torch.cat(parts, dim=0).float()
            return out.cpu() if host else out

    def score(
        self, batch: TokenBatch, k: int | None = None, *, host: bool = True
    ) -> tuple[torch.Tensor, TeacherTopK | None]:
        """([B, T] float32 log-probs of the response tokens, top-k [B, T, min(k, V)] or None), on the CPU
        (host False: on the engine's device, for `teacher.score_frames.pack_answer`; with or without k).

        Without k: the labels path (`logprobs`). With k: one forward without labels, then log-probs and top-k
        from the vocab-parallel logits (`vocab_parallel_score`, module docstring: collectives over the TP
        group at tensor_parallel > 1, which every rank of the group must enter for the same batch), 0 at
        padded positions. Rows are scored `max_batch_rows` at a time.

        Raises:
            EngineError: the weights are offloaded, or k < 1.
        """
        self._require_resident("score")
        if k is not None and k < 1:
            raise EngineError(f"k={k}: expected >= 1 (or None for no top-k)")
        if k is None:
            return self.logprobs(batch, host=host), None
        tp, rank, group = parallel.tp_info()
        gather = None if tp == 1 else process_group_all_gather(group)
        reduce = None if tp == 1 else process_group_all_reduce(group)
        lps, ids, vals = [], [], []
        with self._device_scope(), torch.inference_mode():
            for start in range(0, batch.batch_size, self.max_batch_rows):
                part = batch.rows(start, start + self.max_batch_rows).to(self.device)
                logits = self.forward.response_logits(part)  # [b, T, V'/tp] model dtype
                mask = part.response_mask
                token = torch.where(mask, part.response_ids, 0)
                lp, top_ids, top_lp = vocab_parallel_score(
                    logits, rank * logits.shape[-1], self.vocab_size, token, k, gather, reduce
                )
                lps.append(torch.where(mask, lp, 0.0))
                ids.append(top_ids)
                vals.append(top_lp)
                del logits
        out = [torch.cat(lps), torch.cat(ids), torch.cat(vals)]
        if host:
            out = [t.cpu() for t in out]
        return out[0], TeacherTopK(out[1], out[2])

    def topk(self, batch: TokenBatch, k: int) -> TeacherTopK:
        """The teacher's top-k per response position (any tensor_parallel; see `score`)."""
        top = self.score(batch, k)[1]
        assert top is not None
        return top

    def load_weights(self, path: str | Path) -> None:
        """Replace the weights by those of the HF checkpoint at `path` (same Qwen3 shape), in place: the
        parameters keep their dtype and device (host memory while offloaded).

        Raises:
            EngineError: the checkpoint's shape differs from the loaded model's, or it holds no safetensors.
        """
        config, hf = build.read_hf_checkpoint(path)
        shape = Qwen3Shape.from_hf_config(config)
        if shape != self.shape:
            raise EngineError(
                f"checkpoint {path} has shape {shape}; expected the loaded model's {self.shape}"
            )
        tp, rank, _ = parallel.tp_info()
        with self._device_scope(), torch.no_grad():
            try:
                load_mcore_state(self.model, shard_tp(hf_to_mcore(hf, shape), shape, tp, rank))
            except ValueError as err:  # ConversionError, or names that do not fit
                raise EngineError(f"checkpoint {path}: {err}") from None
        self.hf_config = dict(config)
        self.path = str(path)

    def offload(self) -> ResidencyReport:
        with self._device_scope():
            return self.residency.offload()

    def onload(self) -> ResidencyReport:
        with self._device_scope():
            return self.residency.onload()
