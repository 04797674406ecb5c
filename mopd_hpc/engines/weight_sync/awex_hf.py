"""AWEX's inference-engine interface for the HF rollout engine (issue 8): awex 0.9.0's reader side
(`WeightsReader` → `NCCLWorkerWeightsReader`) updates the transformers model that
`engines/rollout/hf_engine.py` serves, in place, from AWEX's NCCL writer on the Megatron actor.

What the SGLang adapter (`awex/engine/sglang.py` + its worker hooks) gives the reader, and the HF
equivalent here (the smallest set the reader touches):
- `execute_task_in_model_worker(fn, **kw)`: SGLang ships `fn` to every TP worker over ZMQ and returns
  the results in rank order; the HF model lives in this process (TP 1), so it is one direct call
  `[fn(model=..., model_context=..., **kw)]`, under the engine's lock so no decoding step reads a
  half-written weight;
- `model_context`: the keys awex's rank extractors read (tp/pp/dp/attn ranks and sizes, world size,
  global and local rank), `infer_engine_config` (the awex InferenceConfig) and `scheduler`: the
  reader uses `scheduler.gpu_id` (its CUDA device) and `scheduler.flush_cache()` after each update
  (SGLang drops its radix cache; the HF engine keeps no cache across requests: True);
- parameter metadata: the served model's `named_parameters()` are already HF names, so the infer-side
  converter is the identity (no fused qkv/gate_up as in SGLang); the tied `lm_head.weight` alias is added
  by awex itself; sharding: TP 1, every tensor whole (awex's generic `ShardingStrategy`);
- mixture-of-experts models (issue 33): transformers 5 holds a layer's experts fused (`mlp.experts.gate_up_proj`
  [E, 2·f_e, h], `mlp.experts.down_proj` [E, h, f_e]) while awex's mcore converter sends each expert under its
  checkpoint name (`mlp.experts.e.{gate,up,down}_proj.weight`, SGLang's loader names); the converter gives each
  fused tensor as those per-expert names, views of it (`engines/expert_names.checkpoint_named`: contiguous row
  blocks), so the plan pairs them one to one and the reader receives straight into the fused rows. The
  router (`mlp.gate.weight`) is sent in awex's `router_dtype` (infer_conf, read from the HF config, default
  bf16): the engine sets `router_dtype` on the served config to the router's own dtype, else an fp32 model's
  router would arrive rounded to bf16 (and awex's metadata check refuse the dtype). Views do not follow
  `module.to()` (the offload between phases gives the parameters new storage), so before each task in the
  model worker the reader's receive targets are rebuilt from the current parameters (`refresh_receive_targets`);
- update in place: the reader receives (NCCL recv) straight into the `nn.Parameter` objects it got from
  the converter; they stay valid across `offload_weights`/`onload_weights` (module.to() swaps `.data`);
- a default torch.distributed group: SGLang's scheduler has one (its TP world) and awex's
  `init_weights_update_group` asserts it; the HF engine is one process, so `initialize()` creates a
  world-1 default group on an in-memory HashStore (no port) when none exists;
- memory: `release_memory_occupation(["weights"])` / resume map to the engine's offload/onload
  ("kv_cache" is a no-op: nothing persists between requests).

awex 0.9.0 dispatches engine names with if-chains (`get_rank_info_extractor`,
`get_sharding_strategy_builder`, `get_infer_weights_converter`; unknown names raise), with no registry:
`register_hf_engine()` wraps the three factories (in their modules and where they were imported by name)
so that "hf" resolves, and delegates every other name unchanged. Idempotent.

The 0.9.0 gaps (awex.py, awex_actor.py): 1. `require_awex()` before any awex import; 2. `HFAwexEngine.initialize`
refuses a config whose node_rank is unset instead of silently skipping the reader (SGLangEngine's
behaviour); 3 and 5 are the writer's (awex_actor.py); 6. colocate mode with one rollout rank (infer world
1, e.g. one GPU shared by the actor and one engine): the reader's NCCL "ready" handshake is among the rollout
ranks (rank 0 receives from rank infer_world − 1), which is rank 0 itself, and NCCL's self-receive fails
("ncclInternalError … ncclSocketInit: … family 0", seen on the H200) → `register_hf_engine()` makes the
handshake skip that case (there is nobody to wait for; awex's own batch isend/irecv warm-up already skips a
world of 1); 7 (awex.py: fresh NCCL group) and 8-10 (awex_latency.py: fast MetaServer polling,
young-generation gc after a separate step, one NPU probe) are applied by `register_hf_engine()` as well, on
the reader's side; 11 (awex_latency.py: gc.freeze once) after the engine's first `update_weights`.

Colocate mode (one GPU, writer and reader in two processes): the writer copies the weights into grouped
buffers, shares them by CUDA IPC through the MetaServer and releases its own memory; the reader resumes its
weights (`onload_weights`), copies from the IPC buffers into its parameters and signals the writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from mopd_hpc.engines.expert_names import FUSED_NAME, checkpoint_named
from mopd_hpc.engines.weight_sync.awex import (
    AwexConfigError,
    require_awex,
    unsplit_custom_groups,
)
from mopd_hpc.engines.weight_sync.awex_latency import (
    cached_device_probe,
    fast_meta_server_polling,
    freeze_long_lived_objects,
    young_gc_in_separate_steps,
)
from mopd_hpc.engines.weight_sync.awex_spans import Spans

log = logging.getLogger(__name__)

ENGINE_NAME = "hf"
#: awex modules that imported a factory by name (each keeps its own reference) and the names they hold.
_FACTORY_HOLDERS = {
    "awex.sharding.param_sharding": ("get_rank_info_extractor", "get_sharding_strategy_builder"),
    "awex.sharding": ("get_rank_info_extractor", "get_sharding_strategy_builder"),
    "awex.models.registry": ("get_infer_weights_converter",),
    "awex.models": ("get_infer_weights_converter",),
    "awex.meta.infer_meta_resolver": (
        "get_rank_info_extractor",
        "get_sharding_strategy_builder",
        "get_infer_weights_converter",
    ),
    "awex.reader.weights_reader": ("get_rank_info_extractor", "get_infer_weights_converter"),
}


class HFToHFWeightConverter:
    """The infer-side converter of the HF engine: names are HF already; tensors are the parameters
    themselves (so the reader writes into them)."""

    def __init__(self, hf_config: Any, infer_engine_config: Any, rank_info: Any) -> None:
        self.model_config, self.infer_engine_config, self.rank_info = (
            hf_config,
            infer_engine_config,
            rank_info,
        )

    def convert_param(self, name: str, parameter: Any) -> list[tuple[str, Any]]:
        """[(name, parameter)], or for a fused expert tensor its experts under their checkpoint names (views
        of `parameter.detach()`: the reader writes the fused rows; module docstring)."""
        if FUSED_NAME.match(name) is None:
            return [(name, parameter)]
        return list(checkpoint_named([(name, parameter.detach())]))


#: awex's `router_dtype` spelling (infer_conf, read from the HF config) of a router's torch dtype.
_ROUTER_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def fused_experts(model: Any) -> bool:
    """Whether `model` holds any layer's experts fused (`expert_names.FUSED_NAME`)."""
    return any(FUSED_NAME.match(name) for name, _ in model.named_parameters())


def set_router_dtype(model: Any) -> str | None:
    """Set `model.config.router_dtype` (awex's spelling) to the dtype of its routers (`…mlp.gate.weight`), so
    awex's writer sends them unconverted; returns it, or None (no router: the config is left as it is)."""
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight") and str(param.dtype) in _ROUTER_DTYPES:
            model.config.router_dtype = _ROUTER_DTYPES[str(param.dtype)]
            return model.config.router_dtype
    return None


def refresh_receive_targets(model_context: Mapping[str, Any]) -> bool:
    """Rebuild the receive targets (name → tensor) of the worker reader awex keeps on the scheduler from the
    model's current parameters (awex's own `WorkerWeightsReader.initialize`: the converter, the tied lm_head
    alias); False when no reader is built yet. Needed for the expert views, which a `module.to()` leaves on the
    old storage (module docstring)."""
    reader = getattr(model_context["scheduler"], "awes_weights_reader", None)
    if reader is None:
        return False
    from awex.reader.weights_reader import WorkerWeightsReader

    WorkerWeightsReader.initialize(reader)
    return True


def hf_rank_info(model_context: Mapping[str, Any], engine_rank: int) -> Any:
    """awex RankInfo of the HF engine's (only) worker, from `model_context` (vLLM's generic extractor)."""
    from awex.sharding.vllm_sharding import get_vllm_rank_info

    return get_vllm_rank_info(model_context, engine_rank)


def hf_sharding_strategy(model_name: str, infer_engine_config: Any, rank_info: Any, **kwargs: Any) -> Any:
    """awex's ShardingStrategy of `model_name` (registered or the generic one) with engine name "hf"."""
    from awex.models import get_sharding_strategy

    return get_sharding_strategy(model_name)(
        engine_name=ENGINE_NAME, enable_dp_attention=False, enable_dp_lm_head=False,
        moe_dense_tp_size=rank_info.tp_size, tp_size=rank_info.tp_size, ep_size=1, ep_tp_size=1,
        rank_info=rank_info, device_backend=getattr(infer_engine_config, "device_backend", None), **kwargs,
    )  # fmt: skip


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, "_mopd_hf", False):
        return original
    if name == "get_rank_info_extractor":

        def wrapped(engine_name: str) -> Any:
            return hf_rank_info if engine_name == ENGINE_NAME else original(engine_name)
    elif name == "get_sharding_strategy_builder":

        def wrapped(engine_name: str) -> Any:
            return hf_sharding_strategy if engine_name == ENGINE_NAME else original(engine_name)
    else:

        def wrapped(
            engine_name: str, model_name: str, hf_config: Any, rank_info: Any, infer_engine_config: Any
        ):
            if engine_name == ENGINE_NAME:
                return HFToHFWeightConverter(hf_config, infer_engine_config, rank_info)
            return original(engine_name, model_name, hf_config, rank_info, infer_engine_config)

    wrapped._mopd_hf = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapped


def _skip_self_handshake(original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, "_mopd_hf", False):
        return original

    def shake_hands(self: Any) -> Any:
        if self.enable_colocate_mode and self.world_size == 1:
            log.info("AWEX colocate with one rollout rank: no reader handshake (gap 6)")
            return None
        return original(self)

    shake_hands._mopd_hf = True  # type: ignore[attr-defined]
    shake_hands.__wrapped__ = original  # type: ignore[attr-defined]
    return shake_hands


def register_hf_engine() -> None:
    """Make awex 0.9.0 resolve the engine name "hf" and skip the colocate self-handshake (gap 6; module
    docstring). Idempotent.

    Raises:
        AwexUnavailableError: awex or megatron.core is not importable.
    """
    import importlib

    require_awex()
    for module_name, names in _FACTORY_HOLDERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _wrap(name, getattr(module, name)))
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader

    NCCLWorkerWeightsReader._shake_hands_with_writer = _skip_self_handshake(
        NCCLWorkerWeightsReader._shake_hands_with_writer
    )
    unsplit_custom_groups()  # gap 7 (awex.py), on the reader's side too
    fast_meta_server_polling()  # gap 8 (awex_latency.py)
    young_gc_in_separate_steps()  # gap 9 (awex_latency.py)
    cached_device_probe()  # gap 10 (awex_latency.py)


class HFScheduler:
    """What awex's worker reader uses of SGLang's scheduler: gpu_id, server_args, flush_cache()."""

    def __init__(self, gpu_id: int, server_args: Any) -> None:
        self.gpu_id, self.local_rank, self.server_args = gpu_id, gpu_id, server_args
        self.flushes = 0

    def flush_cache(self) -> bool:
        """SGLang drops its prefix cache here; the HF engine keeps none between requests."""
        self.flushes += 1
        return True


def hf_model_context(config: Any, gpu_id: int) -> dict[str, Any]:
    """The `model_context` awex tasks receive for the HF engine's single worker (TP 1, PP 1, DP 1)."""
    return {
        "tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0,
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_rank": 0, "ep_size": 1, "ep_rank": 0,
        "world_size": 1, "global_rank": 0, "local_rank": gpu_id,
        "scheduler": HFScheduler(gpu_id, config), "infer_engine_config": config,
    }  # fmt: skip


def ensure_default_group() -> None:
    """A world-1 default process group (HashStore, no port) unless one exists: awex's reader asserts one."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _engine_base() -> type:
    require_awex()
    from awex.engine.core import InferenceEngine

    return InferenceEngine


def hf_awex_engine(config: Mapping[str, Any] | Any, engine: Any) -> Any:
    """An awex `InferenceEngine` serving `engine` (an `HFRolloutEngine`); config: `AwexJobConfig.
    inference_config(...)` or an awex InferenceConfig. Registers the "hf" engine name first.

    Raises:
        AwexConfigError: tp/pp/dp is not 1 (the HF engine is one process), or node_rank is unset (gap 2).
    """
    register_hf_engine()
    return _engine_class()(config, engine)


_CLASS: list[type] = []


def _engine_class() -> type:
    if _CLASS:
        return _CLASS[0]
    from awex.config import InferenceConfig
    from awex.reader.weights_reader import get_weights_exchange_reader

    class HFAwexEngine(_engine_base()):  # type: ignore[misc]
        """awex's inference-engine interface over an in-process HFRolloutEngine (module docstring)."""

        def __init__(self, config: Mapping[str, Any] | Any, engine: Any) -> None:

            cfg = InferenceConfig.from_dict(dict(config)) if isinstance(config, Mapping) else config
            sizes = {"tp_size": cfg.tp_size, "pp_size": cfg.pp_size, "dp_size": cfg.dp_size}
            if any(v not in (None, 1) for v in sizes.values()):
                raise AwexConfigError(
                    f"HF engine AWEX config {sizes}: the HF engine is one process, expected 1"
                )
            if cfg.node_rank is None:
                raise AwexConfigError(
                    "InferenceConfig.node_rank is None: awex 0.9.0 would silently skip the reader "
                    "(gap 2); build the config with AwexJobConfig.inference_config(engine_rank, node_rank=0)"
                )
            cfg.tp_size = cfg.pp_size = cfg.dp_size = cfg.ep_size = 1
            cfg.enable_dp_attention = cfg.enable_dp_lm_head = False
            hf_config = engine.model.config
            if not getattr(hf_config, "architectures", None):
                hf_config.architectures = [type(engine.model).__name__]
            set_router_dtype(engine.model)
            #: The model holds fused experts: the reader's receive targets are views, rebuilt before each task.
            self.fused_experts = fused_experts(engine.model)
            super().__init__(hf_config)
            self._config, self.engine = cfg, engine
            gpu = engine.device.index if engine.device.type == "cuda" else 0
            self.model_context = hf_model_context(cfg, gpu if gpu is not None else 0)
            self.released_tags: set[str] = set()
            self.weights_exchange_reader: Any = None
            #: Sub-phase seconds of the running update (`awex_spans.py`); last_spans: the last finished one's.
            self.spans = Spans()
            self.last_spans: dict[str, float] = {}

        @property
        def engine_name(self) -> str:
            return ENGINE_NAME

        @property
        def config(self) -> Any:
            return self._config

        @property
        def num_engines(self) -> int:
            return self._config.num_engines

        @property
        def engine_rank(self) -> int:
            return self._config.engine_rank

        def initialize(self) -> None:
            """Build awex's reader (publishes the engine count; metadata is resolved here, on CPU-cheap
            calls into the model). Only node 0 of an engine drives it (gap 2, checked at construction)."""
            if self._config.node_rank != 0:
                log.info("node_rank=%s: this node does not drive the AWEX reader", self._config.node_rank)
                return
            ensure_default_group()
            self.weights_exchange_reader = get_weights_exchange_reader(self)
            self.weights_exchange_reader.initialize()

        def execute_task_in_model_worker(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
            """Run an awex task in the (in-process) model worker; results in worker order (one)."""
            with self.engine.lock:
                if self.fused_experts:
                    refresh_receive_targets(self.model_context)
                return [fn(model=self.engine.model, model_context=self.model_context, **kwargs)]

        def update_weights(self, **kwargs: Any) -> None:
            """Receive one AWEX update for step `global_step` (blocks until the writer sends it); the
            engine's weight_version becomes str(global_step)."""
            if self.weights_exchange_reader is None:
                raise AwexConfigError("update_weights before initialize(): the AWEX reader is not built")
            t0 = time.perf_counter()
            self.weights_exchange_reader.update_weights(step_id=self.global_step, **kwargs)
            self.spans.add("reader_update", time.perf_counter() - t0)
            self.last_spans = self.spans.take()
            self.engine.weight_version = str(self.global_step)
            freeze_long_lived_objects()  # gap 11 (awex_latency.py): acts once, after the first update

        def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> None:
            self.engine.load_from_disk(model_path, str(self.global_step))

        def release_memory_occupation(self, tags: list[str] | None = None) -> None:
            tags = [tags] if isinstance(tags, str) else list(tags or ["kv_cache", "weights"])
            if "weights" in tags and "weights" not in self.released_tags:
                self.spans.timed("engine_offload", self.engine.offload_weights)()
            self.released_tags |= set(tags)

        def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
            tags = [tags] if isinstance(tags, str) else list(tags or ["kv_cache", "weights"])
            if "weights" in tags and "weights" in self.released_tags:
                self.spans.timed("engine_onload", self.engine.onload_weights)()
            self.released_tags -= set(tags)

    _CLASS.append(HFAwexEngine)
    return HFAwexEngine
