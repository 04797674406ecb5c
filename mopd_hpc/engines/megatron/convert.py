"""HF Qwen3 / Qwen3-MoE / Llama ⇄ megatron-core (local layer spec) state dicts, and their tensor-parallel shards.

Name map (HF `Qwen3ForCausalLM` → megatron-core `GPTModel` with `get_gpt_layer_local_spec(qk_layernorm=True,
normalization="RMSNorm")`; algo_awex.md §4.1), `N` the layer. `LlamaForCausalLM` is the same without the
q/k norms (`qk_layernorm=False`); `Qwen3MoeForCausalLM` the same with a router and experts in place of the
MLP of its MoE layers (engines/megatron/convert_moe.py, `get_gpt_layer_local_spec(num_experts=E)`):

    model.embed_tokens.weight                       → embedding.word_embeddings.weight       [V', h]
    model.layers.N.input_layernorm.weight           → decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.{q,k,v}_proj.weight    → decoder.layers.N.self_attention.linear_qkv.weight
    model.layers.N.self_attn.q_norm.weight          → decoder.layers.N.self_attention.q_layernorm.weight
    model.layers.N.self_attn.k_norm.weight          → decoder.layers.N.self_attention.k_layernorm.weight
    model.layers.N.self_attn.o_proj.weight          → decoder.layers.N.self_attention.linear_proj.weight
    model.layers.N.post_attention_layernorm.weight  → decoder.layers.N.pre_mlp_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj.weight        → decoder.layers.N.mlp.linear_fc1.weight
    model.layers.N.mlp.down_proj.weight             → decoder.layers.N.mlp.linear_fc2.weight
    model.norm.weight                               → decoder.final_layernorm.weight
    lm_head.weight (absent when tied)               → output_layer.weight (absent when tied)

Layouts (H query heads, G query groups = KV heads, d head dim, h hidden, f FFN size):
- linear_qkv [(H/G + 2)·G·d, h]: per query group g the rows of its H/G query heads, then its key head,
  then its value head (megatron-core `SelfAttention.get_query_key_value_tensors` splits it that way);
- linear_fc1 [2f, h] = cat(gate_proj, up_proj) (megatron's `glu`: first half gated by SiLU).
- V' ≥ V: megatron pads the vocabulary (`padded_vocab_size`); padded rows are zero and dropped on export.

Tensor parallel (Megatron-LM `ColumnParallelLinear` / `RowParallelLinear`): column-parallel weights
(linear_qkv, linear_fc1 (each expert's too), word embeddings, output layer) split dim 0, row-parallel ones
(linear_proj, linear_fc2) dim 1, norms and the router are replicated. linear_qkv splits by whole query groups (G % tp == 0), linear_fc1
splits gate and up separately (rank r holds [gate_r; up_r]). Every function here is a pure tensor
reshuffle: `mcore_to_hf(hf_to_mcore(sd))` and `gather_tp(shard_tp(sd))` give the input back bitwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.engines.megatron.convert_moe import mlp_hf_to_mcore, mlp_mcore_to_hf


class ConversionError(ValueError):
    """A state dict does not match the model shape it is converted for (missing or extra key, wrong
    shape, a size that does not divide); the message names the key, the value and what was expected."""


@dataclass(frozen=True, slots=True)
class Qwen3Shape:
    """The sizes a conversion of a Qwen3, Qwen3-MoE or Llama model needs. Build with `from_hf_config` or
    `create`.

    Fields: num_layers, hidden_size (h), num_attention_heads (H), num_query_groups (G = KV heads),
    head_dim (d), ffn_hidden_size (f: the dense layers' MLP), vocab_size (V, HF), padded_vocab_size
    (V' ≥ V, megatron), tie_word_embeddings, qk_layernorm (Qwen3's q/k norms; False for Llama),
    num_experts (E, 0 = dense), moe_ffn_hidden_size (f_e, each expert's), moe_router_topk (k, experts per
    token), moe_layers (the MoE layers' indices), norm_topk_prob (the k selected probabilities renormalized
    to sum 1, Qwen3-MoE's `norm_topk_prob`).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qk_layernorm: bool = True
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True

    @classmethod
    def create(cls, **fields: Any) -> Qwen3Shape:
        """Validate and build; padded_vocab_size defaults to vocab_size. Raises ConversionError."""
        fields.setdefault("padded_vocab_size", fields.get("vocab_size"))
        fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
        shape = cls(**fields)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim"):
            if getattr(shape, name) < 1:
                raise ConversionError(f"{name}={getattr(shape, name)}: expected an integer >= 1")
        if shape.num_attention_heads % shape.num_query_groups:
            raise ConversionError(
                f"num_attention_heads={shape.num_attention_heads} is not a multiple of "
                f"num_query_groups={shape.num_query_groups} (GQA needs whole groups)"
            )
        if shape.moe_layers and not (
            shape.num_experts >= 1
            and 1 <= shape.moe_router_topk <= shape.num_experts
            and shape.moe_ffn_hidden_size >= 1
            and all(0 <= n < shape.num_layers for n in shape.moe_layers)
        ):
            raise ConversionError(
                f"MoE layers {list(shape.moe_layers)}: expected num_experts >= 1 (got {shape.num_experts}), "
                f"1 <= moe_router_topk <= num_experts (got {shape.moe_router_topk}), moe_ffn_hidden_size >= 1 "
                f"(got {shape.moe_ffn_hidden_size}) and layer indices below num_layers={shape.num_layers}"
            )
        if shape.padded_vocab_size < shape.vocab_size:
            raise ConversionError(
                f"padded_vocab_size={shape.padded_vocab_size}: expected >= vocab_size={shape.vocab_size}"
            )
        return shape

    @classmethod
    def from_hf_config(cls, config: Any, padded_vocab_size: int | None = None) -> Qwen3Shape:
        """From a transformers `Qwen3Config`, `Qwen3MoeConfig` or `LlamaConfig` (or any object/mapping with their
        attribute names; `model_type` "llama" has no q/k norms). Qwen3-MoE's MoE layers are those not in
        `mlp_only_layers` with (n + 1) % `decoder_sparse_step` == 0 (transformers' `Qwen3MoeDecoderLayer`).

        Raises:
            ConversionError: biases (Llama's `attention_bias` / `mlp_bias`), which the converter does not map.
        """
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        layers = int(get("num_hidden_layers"))
        for bias in ("attention_bias", "mlp_bias"):
            if get(bias, False):
                raise ConversionError(f"{bias}=True: the converter maps bias-free linear layers only")
        # transformers 5 writes config.json's `num_experts` as `num_local_experts`
        experts = int(get("num_experts", 0) or get("num_local_experts", 0) or 0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            step, dense = int(get("decoder_sparse_step", 1) or 1), set(get("mlp_only_layers", None) or ())
            moe_layers = tuple(n for n in range(layers) if n not in dense and (n + 1) % step == 0)
        return cls.create(
            qk_layernorm=get("model_type", "qwen3") != "llama",
            num_experts=experts,
            moe_ffn_hidden_size=int(get("moe_intermediate_size", 0) or 0) if experts else 0,
            moe_router_topk=int(get("num_experts_per_tok", 0) or 0) if experts else 0,
            moe_layers=moe_layers,
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            ffn_hidden_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            padded_vocab_size=padded_vocab_size or int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        return (self.heads_per_group + 2) * self.num_query_groups * self.head_dim


def pad_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: the next multiple of divisible_by·tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MC_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: HF layer-local name → megatron layer-local name, for the tensors that map one to one.
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def _direct(shape: Qwen3Shape) -> dict[str, str]:
    """The one-to-one names of a layer of `shape` (no q/k norms without qk_layernorm)."""
    return {k: v for k, v in _DIRECT.items() if shape.qk_layernorm or k not in _QK_NORMS}


def _take(sd: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in sd:
        raise ConversionError(f"state dict has no {key!r}; expected a tensor of shape {list(shape)}")
    t = sd[key]
    if tuple(t.shape) != shape:
        raise ConversionError(f"{key} has shape {list(t.shape)}; expected {list(shape)}")
    return t


def _check_no_extra(sd: Mapping[str, Any], used: set[str], side: str) -> None:
    extra = sorted(k for k in sd if k not in used and not k.endswith("._extra_state"))
    if extra:
        raise ConversionError(f"{side} state dict has {len(extra)} unexpected key(s), first {extra[0]!r}")


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Qwen3Shape) -> torch.Tensor:
    """[H·d, h], [G·d, h], [G·d, h] → linear_qkv [(H/G + 2)·G·d, h] in megatron's per-group order."""
    g, d, h = shape.num_query_groups, shape.head_dim, q.shape[-1]
    return torch.cat(
        [q.reshape(g, shape.heads_per_group * d, h), k.reshape(g, d, h), v.reshape(g, d, h)], dim=1
    ).reshape(shape.qkv_rows, h)


def unpack_qkv(qkv: torch.Tensor, shape: Qwen3Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_qkv` (also on one TP shard, given a shape with that shard's group count)."""
    g, d, h = shape.num_query_groups, shape.head_dim, qkv.shape[-1]
    q, k, v = qkv.reshape(g, -1, h).split([shape.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, h).clone(), k.reshape(-1, h).clone(), v.reshape(-1, h).clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.clone()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def hf_to_mcore(hf: Mapping[str, torch.Tensor], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    """An HF Qwen3 / Qwen3-MoE / Llama state dict (checkpoint names; transformers 5's fused in-memory experts:
    `convert_moe.split_fused_experts` first) → the megatron-core (TP 1) state dict of the same weights.

    Tensors keep their dtype; outputs are new tensors (the input is not aliased).
    Raises:
        ConversionError: a missing, extra or misshapen tensor.
    """
    s, h = shape, shape.hidden_size
    d, hq, hkv = s.head_dim, s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
    used: set[str] = set()

    def take(key: str, dims: tuple[int, ...]) -> torch.Tensor:
        used.add(key)
        return _take(hf, key, dims)

    out = {
        "embedding.word_embeddings.weight": _pad_rows(
            take("model.embed_tokens.weight", (s.vocab_size, h)), s.padded_vocab_size
        )
    }
    for n in range(s.num_layers):
        src, dst = f"model.layers.{n}.", f"decoder.layers.{n}."
        dims = {
            "input_layernorm.weight": (h,),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "self_attn.o_proj.weight": (h, hq),
            "post_attention_layernorm.weight": (h,),
        }
        for hf_name, mc_name in _direct(s).items():
            out[dst + mc_name] = take(src + hf_name, dims[hf_name]).clone()
        q, k, v = (take(src + name, (rows, h)) for name, rows in zip(_QKV, (hq, hkv, hkv), strict=True))
        out[dst + "self_attention.linear_qkv.weight"] = pack_qkv(q, k, v, s)
        out |= mlp_hf_to_mcore(take, src, dst, s, n in s.moe_layers)
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", (h,)).clone()
    if not s.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(take("lm_head.weight", (s.vocab_size, h)), s.padded_vocab_size)
    elif "lm_head.weight" in hf:  # a tied checkpoint may still list lm_head: it must be the embedding
        used.add("lm_head.weight")
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise ConversionError("tie_word_embeddings=True but lm_head.weight != model.embed_tokens.weight")
    _check_no_extra(hf, used, "HF")
    return out


def mcore_to_hf(mc: Mapping[str, torch.Tensor], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    """A megatron-core (TP 1) state dict → the HF state dict, checkpoint names (`_extra_state` entries are
    ignored; padded vocabulary rows are dropped; no `lm_head.weight` when tied). Raises ConversionError."""
    s, h, v, vp = shape, shape.hidden_size, shape.vocab_size, shape.padded_vocab_size
    d, hq = s.head_dim, s.num_attention_heads * s.head_dim
    used: set[str] = set()

    def take(key: str, dims: tuple[int, ...]) -> torch.Tensor:
        used.add(key)
        return _take(mc, key, dims)

    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight", (vp, h))[:v].clone()}
    inverse = {mc_name: hf_name for hf_name, mc_name in _direct(s).items()}
    dims = {
        "input_layernorm.weight": (h,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, hq),
        "pre_mlp_layernorm.weight": (h,),
    }
    for n in range(s.num_layers):
        src, dst = f"decoder.layers.{n}.", f"model.layers.{n}."
        for mc_name, hf_name in inverse.items():
            out[dst + hf_name] = take(src + mc_name, dims[mc_name]).clone()
        q, k, vv = unpack_qkv(take(src + "self_attention.linear_qkv.weight", (s.qkv_rows, h)), s)
        out[dst + _QKV[0]], out[dst + _QKV[1]], out[dst + _QKV[2]] = q, k, vv
        out |= mlp_mcore_to_hf(take, src, dst, s, n in s.moe_layers)
    out["model.norm.weight"] = take("decoder.final_layernorm.weight", (h,)).clone()
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight", (vp, h))[:v].clone()
    _check_no_extra(mc, used, "megatron")
    return out


# ------------------------------------------------------------------------------------ tensor parallel

#: Megatron layer-local name → split dim (0 column-parallel, 1 row-parallel); absent = replicated.
_TP_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
#: An expert's linear layers: megatron shards each expert like a dense MLP (expert TP = tensor_parallel).
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.\d+\.(linear_fc[12]\.weight)$")
_TOP_TP_DIM = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0}


def tp_split_dim(name: str) -> int | None:
    """The dim a megatron weight is split along under tensor parallelism; None when replicated."""
    if name in _TOP_TP_DIM:
        return _TOP_TP_DIM[name]
    m = _MC_LAYER.match(name)
    if m is None:
        return None
    expert = _EXPERT.match(m.group(2))
    return _TP_DIM.get("mlp." + expert.group(1) if expert else m.group(2))


def check_tp(shape: Qwen3Shape, tp: int) -> None:
    """Raises ConversionError: tp < 1, or tp does not divide the query groups, the FFN sizes or the padded
    vocabulary (each named with its size)."""
    sizes = [
        ("num_query_groups", shape.num_query_groups),
        ("ffn_hidden_size", shape.ffn_hidden_size),
        ("padded_vocab_size", shape.padded_vocab_size),
    ]
    if shape.moe_layers:
        sizes.append(("moe_ffn_hidden_size", shape.moe_ffn_hidden_size))
    for what, size in sizes:
        if tp < 1 or size % tp:
            raise ConversionError(f"tensor_parallel={tp} does not divide {what}={size}")


def shard_tp(
    mc: Mapping[str, torch.Tensor], shape: Qwen3Shape, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The TP rank `rank`'s shard of a full megatron state dict (what that rank's GPTModel holds).

    Raises:
        ConversionError: tp does not divide the query groups, FFN size or padded vocabulary; rank ∉ [0, tp).
    """
    check_tp(shape, tp)
    if not 0 <= rank < tp:
        raise ConversionError(f"rank={rank}: expected 0 <= rank < tensor_parallel={tp}")
    out: dict[str, torch.Tensor] = {}
    for name, t in mc.items():
        dim = tp_split_dim(name)
        if name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
        elif dim is None:
            out[name] = t.clone()
        else:
            out[name] = t.chunk(tp, dim=dim)[rank].clone()
    return out


def gather_tp(shards: Sequence[Mapping[str, torch.Tensor]], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    """Inverse of `shard_tp` over all ranks' shards (rank order). Replicated tensors must agree.

    Raises:
        ConversionError: ranks hold different keys, or a replicated tensor differs between ranks.
    """
    tp = len(shards)
    check_tp(shape, tp)
    names = list(shards[0])
    for r, shard in enumerate(shards):
        if set(shard) != set(names):
            raise ConversionError(
                f"TP rank {r} holds keys {sorted(set(shard) ^ set(names))[:3]} that rank 0 does not"
            )
    out: dict[str, torch.Tensor] = {}
    for name in names:
        parts = [s[name] for s in shards]
        dim = tp_split_dim(name)
        if name.endswith("linear_fc1.weight"):
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
            out[name] = torch.cat([*gates, *ups], dim=0)
        elif dim is None:
            for r, p in enumerate(parts[1:], start=1):
                if not torch.equal(p, parts[0]):
                    raise ConversionError(f"replicated {name} differs between TP rank 0 and rank {r}")
            out[name] = parts[0].clone()
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out


def hf_layer_index(name: str) -> int | None:
    """The layer number of an HF Qwen3 weight name, None for embeddings, final norm and lm_head."""
    m = _HF_LAYER.match(name)
    return int(m.group(1)) if m else None
