"""The actor's side of AWEX weight sync (issue 8): the MetaServer on the actor's rank 0, and awex 0.9.0's
`MegatronEngine` + `NCCLWeightsWriter` over a `MegatronTrainEngine`.

Protocol (separate mode, algo_awex.md §2.2): the actor's rank 0 starts the MetaServer and records its
address in `run_dir/awex_meta_server.json`; rollout engines read it and build their readers
(`awex_hf.hf_awex_engine` for the HF engine). Each sync, every trainer rank calls `publish(step)` while
every rollout engine calls `update_weights()` with the same step id (`set_global_step`): the first call
on both sides exchanges parameter metadata through the MetaServer, builds the same transfer plan and joins
one NCCL group of infer_world + train_world ranks; every call then sends each parameter shard by batched
P2P along the plan. The writer converts the Megatron weights to HF names with awex's registered Qwen3
converter (GQA-aware linear_qkv split, linear_fc1 → gate/up) on every write.

Environment that awex reads itself (set at the edge, e.g. from `AwexJobConfig.trainer_env`):
AWEX_MASTER_ADDR (else awex probes 8.8.8.8 for its IP) and DEVICE (the writer's CUDA ordinal).

A fourth 0.9.0 gap: awex's mcore converter knows the TransformerEngine spec's fused norm name
(`self_attention.linear_qkv.layer_norm_weight`) but not the local spec's `input_layernorm.weight`
(NotImplementedError "Unsupported parameter name"); `register_local_spec_names()` renames it on the way in
(`pre_mlp_layernorm` is already understood).

A fifth 0.9.0 gap (colocate): `NCCLWeightsWriter._write_weights_in_colocate_mode` frees the storage of every
converted tensor after grouping them (`release_tensors`: `untyped_storage().resize_(0)`), assuming they are
its own copies; awex's mcore converter returns views of the parameters (`param.detach()`, qkv slices), and
with Megatron DDP every parameter is a view into one flat buffer, so this freed the whole buffer and the
offload that follows read freed memory (CUDA "illegal memory access", seen on the H200).
`protect_parameter_storage()` makes awex's writer skip any tensor that shares storage with a registered
model's parameters (the residency offload right after moves those to the host properly).

Gap 3 (colocate): awex's `NCCLWeightsWriter._init_writer_in_colocate_mode` reads
`asystem_train_config`, never set → `initialize()` applies `awex.patch_colocate_writer`; awex's
`MegatronEngine` leaves release/resume unimplemented → `_ResidentMegatronEngine` maps them to the
actor's `DDPResidency` by part (`residency_parts`: "optimizer", "weights" = the DDP buffers).
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mopd_hpc.engines.weight_sync.awex import (
    AwexJobConfig,
    patch_colocate_writer,
    require_awex,
    unsplit_custom_groups,
    write_meta_server_address,
)
from mopd_hpc.engines.weight_sync.awex_latency import (
    cached_device_probe,
    fast_meta_server_polling,
    freeze_long_lived_objects,
    young_gc_in_separate_steps,
)
from mopd_hpc.engines.weight_sync.awex_spans import Spans, time_colocate_writer

log = logging.getLogger(__name__)


#: awex modules holding `get_train_weights_converter` by name.
_TRAIN_CONVERTER_HOLDERS = (
    "awex.models.registry",
    "awex.meta.train_meta_resolver",
    "awex.writer.weights_writer",
)
_LOCAL_INPUT_NORM = re.compile(r"^((?:module\.)*decoder\.layers\.\d+\.)input_layernorm\.weight$")


def local_spec_name(name: str) -> str:
    """megatron local-spec name → the TE-spec name awex's mcore converter understands (only the
    pre-attention norm differs: `input_layernorm.weight` → `self_attention.linear_qkv.layer_norm_weight`)."""
    return _LOCAL_INPUT_NORM.sub(r"\1self_attention.linear_qkv.layer_norm_weight", name)


def register_local_spec_names() -> None:
    """Wrap awex's `get_train_weights_converter` so that its converters accept the local layer spec's
    norm names (module docstring). Idempotent."""
    require_awex()
    for module_name in _TRAIN_CONVERTER_HOLDERS:
        module = importlib.import_module(module_name)
        original = module.get_train_weights_converter
        if getattr(original, "_mopd_local_spec", False):
            continue

        def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            converter = _original(*args, **kwargs)
            convert = converter.convert_param

            def convert_param(name: str, parameter: Any, vp_stage: int | None = None) -> Any:
                return convert(local_spec_name(name), parameter, vp_stage=vp_stage)

            converter.convert_param = convert_param
            return converter

        wrapped._mopd_local_spec = True  # type: ignore[attr-defined]
        module.get_train_weights_converter = wrapped


#: Models whose parameter storage awex's colocate writer must not free (gap 5), by id.
_PROTECTED: dict[int, Any] = {}


def _parameter_storages() -> set[int]:
    return {
        p.untyped_storage().data_ptr()
        for model in _PROTECTED.values()
        for p in model.parameters()
        if p.untyped_storage().size()
    }


def _safe_release_tensors(tensors: Any) -> None:
    """awex's `release_tensors`, skipping tensors that share storage with a protected model's parameters."""
    import torch

    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    keep = _parameter_storages()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in keep:
            storage.resize_(0)


def protect_parameter_storage(model: Any) -> None:
    """Register `model` (an nn.Module) so that awex's colocate writer never frees its parameters' storage
    (gap 5, module docstring); installs the guarded `release_tensors` in awex's NCCL writer. Idempotent."""
    require_awex()
    module = importlib.import_module("awex.writer.nccl_writer")
    if module.release_tensors is not _safe_release_tensors:
        module.release_tensors = _safe_release_tensors
    _PROTECTED[id(model)] = model


def start_run_meta_server(run_dir: str | Path, host: str = "127.0.0.1") -> str:
    """Start awex's MetaServer (a daemon subprocess bound to `host`) and write its address to
    `run_dir/awex_meta_server.json`. Call on the actor's rank 0 only. Returns "host:port"."""
    require_awex()
    from awex.meta.meta_server import start_meta_server

    ip, port = start_meta_server(host=host)
    write_meta_server_address(run_dir, ip, port)
    return f"{ip}:{port}"


def stop_run_meta_server() -> None:
    """Stop the MetaServer this process started (no-op if none)."""
    from awex.meta.meta_server import stop_meta_server

    stop_meta_server()


def pretrained_config(hf_config: Mapping[str, Any]) -> Any:
    """A transformers `PretrainedConfig` from an HF config.json dict (awex reads its attributes, e.g.
    architectures[0] to pick its converters)."""
    from transformers import AutoConfig

    fields = dict(hf_config)
    model_type = fields.pop("model_type", "qwen3")
    cfg = AutoConfig.for_model(model_type, **fields)
    if not getattr(cfg, "architectures", None):
        cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def residency_parts(tags: Any) -> tuple[str, ...]:
    """awex's memory tags → `DDPResidency` parts: None → both; a bare string (awex passes "weights" so once) or a
    list; tags other than "optimizer" and "weights" (e.g. "kv_cache") are not the actor's and are dropped."""
    from mopd_hpc.engines.megatron.residency import PARTS

    chosen = [tags] if isinstance(tags, str) else list(PARTS if tags is None else tags)
    return tuple(part for part in PARTS if part in chosen)


def _megatron_engine_class() -> type:
    from awex.engine.mcore import MegatronEngine

    class _ResidentMegatronEngine(MegatronEngine):
        """awex's MegatronEngine with release/resume backed by the actor's residency (colocate mode), part by
        part: awex releases the optimizer, resumes the weights for its copy, then releases them."""

        residency: Any = None
        spans: Any = None  # awex_spans.Spans: actor_offload_<parts> / actor_onload_<parts> seconds

        def release_memory_occupation(self, tags: list[str] | None = None) -> None:
            parts = residency_parts(tags)
            if self.residency is not None and self.enable_colocate_mode and parts:
                t0 = time.perf_counter()
                self.residency.offload(parts)
                if self.spans is not None:
                    self.spans.add(f"actor_offload_{'+'.join(parts)}", time.perf_counter() - t0)

        def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
            parts = residency_parts(tags)
            if self.residency is not None and self.enable_colocate_mode and parts:
                t0 = time.perf_counter()
                self.residency.onload(parts)
                if self.spans is not None:
                    self.spans.add(f"actor_onload_{'+'.join(parts)}", time.perf_counter() - t0)

        def release_grad_memory(self, empty_cache: bool = True) -> None:
            return None

    return _ResidentMegatronEngine


class AwexActorPublisher:
    """One trainer rank's AWEX writer over a `MegatronTrainEngine` (its bare GPTModel, whose parameters
    are views into the DDP buffers, so every publish sends the current weights).

    Args:
        cfg: the job's AWEX settings with the MetaServer address filled in.
        actor: the `MegatronTrainEngine` (needs `.model`, `.hf_config`, `.residency`).
    """

    def __init__(self, cfg: AwexJobConfig, actor: Any) -> None:
        register_local_spec_names()
        unsplit_custom_groups()  # gap 7: the actor's default group has a bound device (awex.py)
        fast_meta_server_polling()  # gap 8 (awex_latency.py)
        young_gc_in_separate_steps()  # gap 9 (awex_latency.py)
        cached_device_probe()  # gap 10 (awex_latency.py)
        self.cfg, self.actor = cfg, actor
        self.engine = _megatron_engine_class()(
            cfg.trainer_config(), pretrained_config(actor.hf_config), [actor.model]
        )
        self.engine.residency = getattr(actor, "residency", None)
        if cfg.colocate:
            protect_parameter_storage(actor.model)
        self.seconds: list[float] = []
        #: Sub-phase seconds of the running publish (`awex_spans.py`); `last_spans`: the last finished one's.
        self.spans = Spans()
        self.engine.spans = self.spans
        self.last_spans: dict[str, float] = {}

    def initialize(self) -> None:
        """Build awex's writer (its real set-up happens in the first publish, with the readers). In colocate
        mode awex then releases the actor's memory (optimizer and weights offloaded; `actor.onload()` before
        the next train step), and so it does after every publish."""
        self.engine.initialize()
        if self.cfg.colocate:
            patch_colocate_writer(self.engine.weights_exchange_writer, self.cfg.ipc_backend)
            time_colocate_writer(self.engine.weights_exchange_writer, self.spans)
        self.spans.take()  # initialize()'s own offloads are not a publish's

    def publish(self, step: int) -> float:
        """Send the actor's weights as step `step` (blocks until every reader got its shards; the device is
        synchronized before returning, so the weights may change right after). Returns the seconds taken."""
        import torch

        self.engine.set_global_step(step)
        t0 = time.perf_counter()
        self.engine.write_weights()
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - t0)
        self.last_spans = self.spans.take()
        freeze_long_lived_objects()  # gap 11 (awex_latency.py): acts once, after the first sync
        return self.seconds[-1]
