"""The HF rollout engine: a transformers causal LM, batched decoding, weight loading and offload.

Shape legend: B rows in the batch, L padded prompt length, V vocabulary size.

Decoding is a loop over the model's forward with a KV cache (no `model.generate`), so that each row keeps
its own sampling parameters, its own seed and its exact behavior log-probs (`sampling.py`). Prompts are
padded on the left; the attention mask hides the pads and position ids count real tokens only, so a row's
logits do not depend on the other rows beyond float rounding. Two decoders (an engine-internal choice by
device, not a config field):

- "loop" (the CPU default): a growing DynamicCache, one `torch.Generator` per row, finished rows leave the
  batch (their cache rows are dropped), one host sync per step.
- "static" (the CUDA default, its decode step compiled into CUDA graphs there: `compile_decode`):
  `static_decoder.py`, a preallocated StaticCache, one batched draw per step
  from the counter hash of `counter_rng.py`, finished rows masked, the host polled every few steps. Its
  draws differ from the loop's (another uniform per (seed, step)); μ is computed by the same code. Batches
  with a row asking input log-probs (logprob_start_len >= 0) or top log-probs, or a model whose attention
  is neither SDPA nor eager, run on the loop decoder. An SDPA model is switched to `grouped_attention.py`
  (its one-token step reads each K/V cache slot once, not through `repeat_kv` copies) with this decoder;
  its compiled step then attends over the written slots rounded up to one of a few spans (`attention_spans`).

Thread model: `generate` runs in the scheduler's worker thread; every forward pass and every weight
change holds `self.lock`, taken per decoding step, so weights can change between two steps of a batch
paused in place (as SGLang's in-place pause allows).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mopd_hpc.engines.expert_names import expert_views
from mopd_hpc.engines.moe_routing import RouterHooks
from mopd_hpc.engines.rollout.graph_shape import SPANS
from mopd_hpc.engines.rollout.grouped_attention import use_grouped_attention
from mopd_hpc.engines.rollout.hf_static import HFStaticDecoding
from mopd_hpc.engines.rollout.protocol import DEFAULT_WEIGHT_VERSION
from mopd_hpc.engines.rollout.rows import RowRequest, RowResult, StepGate
from mopd_hpc.engines.rollout.sampling import behavior_logprobs, sample_next

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODERS = ("auto", "loop", "static")


class WeightLoadError(ValueError):
    """Tensors given to the engine do not fit the model: unknown name or wrong shape."""


def _top(logp_row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = logp_row.topk(min(k, logp_row.shape[-1]))
    return [(float(v), int(i)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]


class HFRolloutEngine(HFStaticDecoding):
    """A transformers causal LM served for rollouts. Build with `HFRolloutEngine.load`. The static decoder's
    methods (its cache, mask, compiled forward) are `hf_static.HFStaticDecoding`'s."""

    def __init__(
        self,
        model: Any,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        decoder: str = "auto",
        compile_decode: bool | None = None,
        graph_shape: tuple[int, int] | None = None,
        attention_spans: int | None = None,
    ) -> None:
        """decoder: "auto" ("static" on CUDA, "loop" elsewhere), "loop" or "static" (see the module docstring).
        With "static", an SDPA model's attention becomes `grouped_attention.grouped_sdpa_attention` (the same
        attention; `grouped_attention` says whether it was switched).

        compile_decode (CUDA, static decoder only; None = on there, off elsewhere): the one-token decode
        forward runs through torch.compile(mode="reduce-overhead") (CUDA graphs), the StaticCache kept
        across batches of the same shape: 15x the eager static decoder at 128 rows x 128 tokens on an H200
        (benchmarks/results/hf_decode.json), after a compilation of ~40 s per (rows, cache length) shape.
        If compiling or the first compiled call fails, it is logged and the engine decodes eagerly from
        then on (`compile_active` says which). A CUDA graph holds its inputs' addresses: the cache is kept
        across batches (`release_cache`), and so are the parameters (`offload_weights` leaves them on the
        device; a move would make torch's CUDA-graph trees record the graph again at every weight sync, up to
        its re-record limit, then run without graphs).
        graph_shape (rows, cache length): with compile_decode, every batch that fits is padded to it (rows
        that decode nothing, `static_decoder.padding_rows`; a cache of that many slots), so that batches of
        other sizes and prompt widths replay the graphs of one compilation; a batch that does not fit gets
        its own shape (and compilation). None: each batch's own shape.
        attention_spans (static decoder on the grouped attention only; None = `graph_shape.SPANS` with
        compile_decode, else the written slots exactly through `static_decoder.kv_view`): each step attends
        over the first `graph_shape.attention_span(n, C, attention_spans)` cache slots, n those written (one
        CUDA graph per span: up to that many compilations per shape); 1: all C slots (the layout before
        issue 35). Eagerly the spans decode as the written slots do, up to float rounding.
        Raises:
            ValueError: an unknown decoder, compile_decode=True off CUDA or with the loop decoder, or a
                graph_shape entry or attention_spans < 1.
        """
        if decoder not in DECODERS:
            raise ValueError(f"decoder={decoder!r}: expected one of {DECODERS}")
        self.decoder = ("static" if device.type == "cuda" else "loop") if decoder == "auto" else decoder
        if compile_decode and (device.type != "cuda" or self.decoder != "static"):
            raise ValueError(
                f"compile_decode=True needs the static decoder on CUDA (device {device}, decoder "
                f"{self.decoder!r})"
            )
        if graph_shape is not None and min(graph_shape) < 1:
            raise ValueError(f"graph_shape={graph_shape}: expected (rows >= 1, cache length >= 1)")
        if attention_spans is not None and attention_spans < 1:
            raise ValueError(f"attention_spans={attention_spans}: expected >= 1")
        if compile_decode is None:
            compile_decode = device.type == "cuda" and self.decoder == "static"
        self.compile_decode = compile_decode
        self.attention_spans = SPANS if attention_spans is None and compile_decode else attention_spans
        # the static decoder's masked one-token step, without transformers' repeat_kv copies of the cache
        self.grouped_attention = self.decoder == "static" and use_grouped_attention(model)
        self.graph_shape = graph_shape
        self.compile_active = False
        self._compiled: Any = None
        self._compiled_calls: dict[tuple[int, ...], int] = {}  # calls per (ids, mask) shape
        self._kept_cache: tuple[tuple[int, int], Any] | None = None
        self.model = model
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.weight_version = DEFAULT_WEIGHT_VERSION
        #: The MoE routers' hooks (none for a dense model): the loop decoder records the routed experts.
        self.routing = RouterHooks(model)
        self.weights_on_device = True
        self.lock = threading.Lock()
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._has_cache_position = "cache_position" in params
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = cfg.eos_token_id if eos is None else eos
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)

    @classmethod
    def load(
        cls,
        model_path: str,
        device: str = "cpu",
        dtype: str = "auto",
        decoder: str = "auto",
        compile_decode: bool | None = None,
        graph_shape: tuple[int, int] | None = None,
        attention_spans: int | None = None,
    ) -> HFRolloutEngine:
        """Load an HF checkpoint directory onto `device` ("cpu", "cuda", "cuda:N") in `dtype`.

        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16". decoder, compile_decode,
        graph_shape, attention_spans: see `__init__`.
        Raises:
            ValueError: unknown dtype, device or decoder.
        """
        if decoder not in DECODERS:
            raise ValueError(f"decoder={decoder!r}: expected one of {DECODERS}")
        from transformers import AutoModelForCausalLM

        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected 'auto' or one of {sorted(DTYPES)}")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available on this host")
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype="auto" if dtype == "auto" else DTYPES[dtype]
        )
        model = model.to(dev).eval()
        model.requires_grad_(False)
        dtype_ = next(model.parameters()).dtype
        return cls(model, model_path, dev, dtype_, decoder, compile_decode, graph_shape, attention_spans)

    # ---- decoding -------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, keep_all: bool):
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._has_logits_to_keep and not keep_all:
            kwargs["logits_to_keep"] = 1
        with self.lock, torch.inference_mode():
            if not self.weights_on_device:
                raise RuntimeError("model weights are released (POST /resume_memory_occupation first)")
            return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs).logits

    def generate(self, rows: Sequence[RowRequest], gate: StepGate) -> list[RowResult]:
        """Decode `rows` as one batch on this engine's decoder; returns one result per row, in order."""
        if self.decoder == "static" and rows:
            # the routed experts are recorded by the loop decoder only (eager forwards: no CUDA graph)
            wants_extra = any(
                (r.return_logprob and r.logprob_start_len >= 0)
                or r.top_logprobs_num > 0
                or r.return_routed_experts
                for r in rows
            )
            mask_value = self._static_mask()
            if not wants_extra and mask_value is not None:
                return self._generate_static(rows, gate, mask_value)
        return self._generate_loop(rows, gate)

    def _generate_loop(self, rows: Sequence[RowRequest], gate: StepGate) -> list[RowResult]:
        from transformers import DynamicCache

        n, dev = len(rows), self.device
        results = [RowResult(weight_version=self.weight_version) for _ in rows]
        lengths = [len(r.prompt_ids) for r in rows]
        width = max(lengths)
        ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - lengths[i] :] = torch.tensor(row.prompt_ids)
            mask[i, width - lengths[i] :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        need_inputs = any(r.return_logprob and r.logprob_start_len >= 0 for r in rows)
        routing = self.routing if any(r.return_routed_experts for r in rows) and self.routing.moe else None
        if routing is not None:
            routing.recording, routing.recorded = True, []
        try:
            return self._decode_loop(
                rows, gate, results, ids, mask, cache, need_inputs, routing, width, lengths
            )
        finally:
            if routing is not None:
                routing.recording, routing.recorded = False, []

    def _decode_loop(self, rows, gate, results, ids, mask, cache, need_inputs, routing, width, lengths):
        """`_generate_loop`'s prefill and decode steps over the left-padded prompts `ids` / `mask` [n, width];
        `routing`: the router hooks recording each step's experts (None: not asked or a dense model)."""
        n, dev = len(rows), self.device
        temperature = torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.sampling.top_k for r in rows], dtype=torch.long, device=dev)
        generators = [torch.Generator(device=dev).manual_seed(r.seed) for r in rows]
        stops = [
            set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(self.eos_token_ids))
            for r in rows
        ]
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, keep_all=need_inputs)
        routes = routing.last_position_routes(n) if routing is not None else None
        if need_inputs:
            self._input_logprobs(rows, results, logits, ids, width, lengths, temperature, top_p, top_k)
        last = logits[:, -1]
        active = list(range(n))
        for i in list(active):
            if rows[i].sampling.max_new_tokens == 0:
                results[i].finish = {"type": "length", "length": 0}
                active.remove(i)
        keep = torch.tensor(active, dtype=torch.long, device=dev)
        last, mask = last[keep], mask[keep]
        if routes is not None:
            routes = routes[keep.cpu()]
        if len(active) < n:
            cache.batch_select_indices(keep)
        sel = keep
        while active:
            if not gate.between_steps():
                for i in active:
                    results[i].finish = {"type": "abort", "message": "aborted by /pause_generation"}
                break
            out = sample_next(last, temperature[sel], top_p[sel], top_k[sel], [generators[i] for i in active])
            tokens, lps = out.token_ids.tolist(), out.logprobs.tolist()
            still: list[int] = []
            for k, i in enumerate(active):
                res, row = results[i], rows[i]
                res.output_ids.append(tokens[k])
                if routes is not None and row.return_routed_experts:
                    res.routed_experts.append(routes[k])
                if row.return_logprob:
                    res.output_logprobs.append(lps[k])
                    if row.top_logprobs_num:
                        res.output_top.append(_top(out.dist_logprobs[k], row.top_logprobs_num))
                if tokens[k] in stops[i]:
                    res.finish = {"type": "stop", "matched": tokens[k]}
                elif len(res.output_ids) >= row.sampling.max_new_tokens:
                    res.finish = {"type": "length", "length": row.sampling.max_new_tokens}
                else:
                    still.append(k)
            if not still:
                break
            next_ids = out.token_ids[still][:, None]
            if len(still) < len(active):
                idx = torch.tensor(still, dtype=torch.long, device=dev)
                cache.batch_select_indices(idx)
                mask = mask[idx]
                active = [active[k] for k in still]
                sel = torch.tensor(active, dtype=torch.long, device=dev)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = mask.sum(-1, keepdim=True) - 1
            last = self._forward(next_ids, mask, pos, cache, keep_all=False)[:, -1]
            if routing is not None:
                routes = routing.last_position_routes(len(active))
        for res in results:  # the version at completion, as SGLang reports it (weights may change mid-batch)
            res.weight_version = self.weight_version
        return results

    def _input_logprobs(self, rows, results, logits, ids, width, lengths, temperature, top_p, top_k) -> None:
        """Fill input_logprobs of rows that asked (logprob_start_len >= 0), SGLang's [None] + ... layout."""
        for i, row in enumerate(rows):
            if not (row.return_logprob and row.logprob_start_len >= 0):
                continue
            pad, start = width - lengths[i], min(row.logprob_start_len, lengths[i])
            pred = logits[i, pad : width - 1]
            if pred.shape[0]:
                n = pred.shape[0]
                logp = behavior_logprobs(
                    pred, temperature[i].expand(n), top_p[i].expand(n), top_k[i].expand(n)
                )
            targets = ids[i, pad + 1 : width]
            for j in range(start, lengths[i]):
                if j == 0:
                    results[i].input_logprobs.append(None)
                    results[i].input_top.append(None)
                    continue
                results[i].input_logprobs.append(float(logp[j - 1, targets[j - 1]]))
                results[i].input_top.append(
                    _top(logp[j - 1], row.top_logprobs_num) if row.top_logprobs_num else None
                )

    # ---- weights -----------------------------------------------------------------------------------

    def load_named_tensors(self, named: Mapping[str, torch.Tensor], weight_version: str | None) -> int:
        """Copy tensors into the model's parameters (HF state_dict names, or a fused MoE layer's per-expert
        checkpoint names: `engines/expert_names.py`); all or nothing.

        Tied weights may come once or under both names. Dtypes are cast to the model's.
        Returns:
            the number of tensors loaded.
        Raises:
            WeightLoadError: an unknown name or a shape mismatch; nothing was changed.
        """
        state = self.model.state_dict(keep_vars=True)
        state = {**state, **expert_views(state, named)}  # per-expert names into fused experts (MoE)
        for name, tensor in named.items():
            if name not in state:
                known = ", ".join(list(state)[:4])
                raise WeightLoadError(f"weight {name!r}: not a parameter of the model (e.g. {known}, ...)")
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise WeightLoadError(
                    f"weight {name!r}: shape {tuple(tensor.shape)} != model's {tuple(state[name].shape)}"
                )
        with self.lock, torch.no_grad():
            if named:  # one multi-tensor copy (on CUDA a few fused kernels, not one per tensor)
                torch._foreach_copy_([state[name].data for name in named], list(named.values()))
            if weight_version is not None:
                self.weight_version = weight_version
        return len(named)

    def load_from_disk(self, model_path: str, weight_version: str | None) -> int:
        """Load every weight of the HF checkpoint at `model_path` (same architecture); all or nothing."""
        from transformers import AutoModelForCausalLM

        other = AutoModelForCausalLM.from_pretrained(model_path)
        if type(other) is not type(self.model):
            raise WeightLoadError(
                f"model_path={model_path!r}: architecture {type(other).__name__} != served "
                f"{type(self.model).__name__}"
            )
        count = self.load_named_tensors(other.state_dict(), weight_version)
        self.model_path = model_path
        return count

    def release_cache(self) -> None:
        """Give the caching allocator's unused blocks (a finished batch's KV cache and logits) back to the
        device, so that a colocated child can have them until the next batch (no-op on CPU). The compiled
        decoder keeps its StaticCache: its CUDA graphs hold the cache's addresses (a new cache would make
        torch record them again, and keep the old ones, every batch); the memory plan counts it as held."""
        if not self.compile_decode:
            self._kept_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def offload_weights(self) -> str:
        """Release the weights between phases: moved to host memory on GPU, or kept in place (a no-op) on CPU
        and with the compiled decoder, whose CUDA graphs hold the parameters' addresses (moving them back
        would give new ones, and a graph recording per weight sync; the memory plan counts the rollout
        engine's weights as resident, `plan/memory_plan.py`). Either way generation is refused until
        `onload_weights`. Returns what was done."""
        with self.lock:
            self.weights_on_device = False
            if self.device.type == "cpu":
                return "device is cpu: weights stay in place (no-op)"
            if self.compile_decode:
                return f"weights stay on {self.device}: the compiled decode step's CUDA graphs hold their addresses"
            self.model.to("cpu")
            torch.cuda.empty_cache()
            return f"weights moved from {self.device} to cpu"

    def onload_weights(self) -> str:
        """Move the weights back onto the serving device (where `offload_weights` moved them)."""
        with self.lock:
            if self.device.type != "cpu" and next(self.model.parameters()).device != self.device:
                self.model.to(self.device)
            self.weights_on_device = True
            return f"weights resident on {self.device}"

    def device_memory_allocated(self) -> int | None:
        """Bytes torch has allocated on the serving GPU; None on CPU."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "architectures": list(getattr(cfg, "architectures", None) or [type(self.model).__name__]),
            "model_type": getattr(cfg, "model_type", None),
            "served_model_name": self.model_path,
            "vocab_size": self.vocab_size,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "backend": "hf",
        }
