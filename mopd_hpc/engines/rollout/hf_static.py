"""The HF rollout engine's static decoder path (`hf_engine.py`'s module docstring: "static"): the StaticCache,
the boolean attention mask, the decode forward compiled into CUDA graphs (`compile_decode`) and the batch
through `static_decoder.decode_static`.

`HFStaticDecoding` is a base of `hf_engine.HFRolloutEngine`, whose `__init__` sets what its methods read:
`model`, `device`, `dtype`, `lock`, `weights_on_device`, `eos_token_ids`, `weight_version`, `compile_decode`,
`compile_active`, `graph_shape`, `attention_spans`, `grouped_attention`, `_compiled`, `_compiled_calls`,
`_kept_cache`, `_cache_kw`, `_has_logits_to_keep`, `_has_cache_position`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from mopd_hpc.engines.rollout.graph_shape import attention_span
from mopd_hpc.engines.rollout.grouped_attention import NAME as GROUPED_SDPA
from mopd_hpc.engines.rollout.rows import RowRequest, RowResult, StepGate

log = logging.getLogger(__name__)


def allow_recompiles(entries: int) -> None:
    """Raise torch dynamo's per-frame recompile limit (process-wide) to at least `entries`: the compiled decode
    forward keeps one graph per (rows, cache length, attention span), and past the limit dynamo would run
    the forward eagerly without saying so in the result."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), entries))


class HFStaticDecoding:
    """The static decoder's methods of `hf_engine.HFRolloutEngine` (see the module docstring)."""

    def _forward_static(self, ids, mask4d, pos, cache, cache_position) -> torch.Tensor:
        """One forward into a StaticCache with a prepared 4D mask: the last position's logits [B, V]."""
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if self._has_cache_position:  # transformers versions whose StaticCache writes at cache_position
            kwargs["cache_position"] = cache_position
        with self.lock, torch.inference_mode():
            if not self.weights_on_device:
                raise RuntimeError("model weights are released (POST /resume_memory_occupation first)")
            if self.compile_decode and ids.shape[1] == 1:
                out = self._compiled_forward(ids, mask4d, pos, kwargs)
                if out is not None:
                    return out
            out = self.model(input_ids=ids, attention_mask=mask4d, position_ids=pos, **kwargs).logits
            return out[:, -1]

    def _compiled_forward(self, ids, mask4d, pos, kwargs) -> torch.Tensor | None:
        """The decode forward through the compiled model; None (and compiling off) once it failed."""
        cache = kwargs[self._cache_kw]
        # For the first calls of each shape (its compilation, CUDA-graph warm-up and recording), snapshot the
        # cache's write offsets (StaticLayer advances its own in place), so that an eager retry after a
        # failure mid-call writes where this call should have.
        offsets = None
        shape = (*ids.shape, *mask4d.shape)
        if self._compiled_calls.get(shape, 0) < 3:
            offsets = [
                (layer, layer.cumulative_length.clone())
                for layer in getattr(cache, "layers", [])
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
            ]
        try:
            if self._compiled is None:
                allow_recompiles(4 * (self.attention_spans or 1))
                self._compiled = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
            torch.compiler.cudagraph_mark_step_begin()
            out = self._compiled(input_ids=ids, attention_mask=mask4d, position_ids=pos, **kwargs).logits
            self.compile_active = True
            self._compiled_calls[shape] = self._compiled_calls.get(shape, 0) + 1
            return out[:, -1].clone()  # the graph's output buffer is overwritten by the next replay
        except Exception:  # noqa: BLE001 - any compile/capture failure: decode eagerly, say so
            log.exception("compiled decode forward failed; decoding eagerly from now on")
            for layer, offset in offsets or []:
                layer.cumulative_length.copy_(offset)
            self.compile_decode, self.compile_active, self._compiled = False, False, None
            return None

    def _static_cache(self, rows: int, length: int) -> Any:
        """A StaticCache of `length` slots; with compile_decode, the last one again (reset) if its shape fits."""
        from transformers import StaticCache

        if self.compile_decode and self._kept_cache is not None and self._kept_cache[0] == (rows, length):
            cache = self._kept_cache[1]
            with torch.inference_mode():  # its tensors were made by a forward under inference mode
                cache.reset()
            return cache
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._kept_cache = ((rows, length), cache) if self.compile_decode else None
        return cache

    def _static_mask(self):
        """What the model's attention takes for a boolean "may attend" mask; None: not supported."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl in ("sdpa", GROUPED_SDPA):
            return lambda see: see
        if impl == "eager":
            low = torch.finfo(self.dtype).min
            return lambda see: torch.zeros(see.shape, dtype=self.dtype, device=see.device).masked_fill(
                ~see, low
            )
        return None

    def _generate_static(self, rows: Sequence[RowRequest], gate: StepGate, mask_value) -> list[RowResult]:
        from mopd_hpc.engines.rollout.static_decoder import (
            StaticRow,
            cache_length,
            decode_static,
            kv_view,
            padding_rows,
        )

        srows = [
            StaticRow(
                prompt_ids=tuple(r.prompt_ids),
                temperature=r.sampling.temperature,
                top_p=r.sampling.top_p,
                top_k=r.sampling.top_k,
                max_new_tokens=r.sampling.max_new_tokens,
                stop_ids=frozenset(r.sampling.stop_token_ids)
                | (frozenset() if r.sampling.ignore_eos else self.eos_token_ids),
                seed=r.seed,
            )
            for r in rows
        ]
        min_length = 0
        if self.compile_decode and self.graph_shape is not None:
            graph_rows, graph_length = self.graph_shape
            if len(srows) <= graph_rows and cache_length(srows)[1] <= graph_length:
                srows += padding_rows(graph_rows - len(srows))
                min_length = graph_length
        length = cache_length(srows, min_length)[1]
        cache = self._static_cache(len(srows), length)
        forward, span = self._forward_static, None
        if self.grouped_attention and self.attention_spans is not None:  # it reads the prefix its mask spans

            def span(written: int, length=length, spans=self.attention_spans) -> int:
                return attention_span(written, length, spans)

        elif not self.compile_decode and (set_end := kv_view(cache)) is not None:

            def span(written: int) -> int:
                return written

            def forward(ids, mask4d, pos, cache, cache_position, set_end=set_end):
                set_end(mask4d.shape[-1])
                return self._forward_static(ids, mask4d, pos, cache, cache_position)

        outs = decode_static(srows, forward, cache, gate, self.device, mask_value, span, min_length)
        version = self.weight_version  # the version at completion, as SGLang reports it
        return [
            RowResult(
                output_ids=o.output_ids,
                output_logprobs=o.output_logprobs if r.return_logprob else [],
                finish=o.finish,
                weight_version=version,
            )
            for r, o in zip(rows, outs[: len(rows)], strict=True)
        ]
