"""Which slice of each HF Qwen3 tensor a megatron tensor-parallel rank holds, and the way back (pure torch).

A `ShardPlan` (shape, tp) lists every HF tensor of the model with how megatron-core's TP = tp ranks hold it
(Megatron-LM `ColumnParallelLinear` / `RowParallelLinear` / `VocabParallelEmbedding`; the fused layouts of
`convert.py`). Shape legend: H query heads, G query groups (KV heads), d head dim, h hidden, f FFN size,
V vocabulary, V' ≥ V the padded vocabulary (a multiple of tp), r the TP rank of T = tp:

    kind        HF tensor (shape)                        rank r holds (its "piece")
    column      q_proj [H·d, h]                          rows of its G/T query groups' heads: chunk r of dim 0
                k_proj, v_proj [G·d, h]                  rows of its G/T KV heads: chunk r of dim 0
                gate_proj, up_proj [f, h]                chunk r of dim 0
    row         o_proj [h, H·d], down_proj [h, f]        chunk r of dim 1
    vocab       embed_tokens, lm_head [V, h]             chunk r of dim 0 of the tensor zero-padded to V' rows
                                                         (the last ranks' pieces may carry padding rows)
    replicated  every norm [h] / [d]                     the whole tensor

A rank's megatron tensors are its pieces fused: linear_qkv_r = `pack_qkv(q_r, k_r, v_r)` at G/T groups (whole
groups: megatron splits linear_qkv [(H/G + 2)·G·d, h] in dim 0 by group), linear_fc1_r = [gate_r; up_r]
(megatron splits gate and up separately), so `mcore_shard(pieces(hf, r))` is `shard_tp(hf_to_mcore(hf), tp, r)`
of convert.py, and `hf_pieces(mcore_shard)` reads the pieces back from what a rank's GPTModel holds.

Why per HF tensor: weight sync and the HF export gather one HF tensor at a time over the TP group
(`engines/megatron/tp_gather.py`): every rank cuts its piece out of its own megatron state, an all-gather
of that piece gives the whole tensor (`gather`), and no rank ever holds the whole model's megatron state
dict (the all-gather of `MegatronTrainEngine.full_mcore_state`). Everything here is a pure reshuffle:
`gather([split(t, r) for r in range(tp)]) == t` bitwise, for every dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mopd_hpc.engines.megatron.convert import ConversionError, Qwen3Shape, check_tp, pack_qkv, unpack_qkv

Kind = Literal["column", "row", "vocab", "replicated"]
#: HF layer-local name → (megatron layer-local name, kind, part of a fused megatron tensor or None).
_LAYER: dict[str, tuple[str, Kind, str | None]] = {  # in the order of Qwen3ForCausalLM.state_dict()
    "self_attn.q_proj.weight": ("self_attention.linear_qkv.weight", "column", "q"),
    "self_attn.k_proj.weight": ("self_attention.linear_qkv.weight", "column", "k"),
    "self_attn.v_proj.weight": ("self_attention.linear_qkv.weight", "column", "v"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "row", None),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", "replicated", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", "replicated", None),
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", "column", "gate"),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", "column", "up"),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "row", None),
    "input_layernorm.weight": ("input_layernorm.weight", "replicated", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "replicated", None),
}
_SPLIT_DIM = {"column": 0, "vocab": 0, "row": 1, "replicated": None}


@dataclass(frozen=True, slots=True)
class TensorShard:
    """How the TP ranks hold one HF tensor.

    Attributes:
        hf_name: the HF state-dict name. mcore_name: the megatron tensor it lives in.
        kind: "column", "row", "vocab" or "replicated" (module docstring's table).
        part: "q", "k", "v" (of linear_qkv), "gate", "up" (of linear_fc1), or None (the whole megatron tensor).
        hf_shape: the HF tensor's shape. piece_shape: the shape of every rank's piece (equal on all ranks).
    """

    hf_name: str
    mcore_name: str
    kind: Kind
    part: str | None
    hf_shape: tuple[int, ...]
    piece_shape: tuple[int, ...]

    @property
    def dim(self) -> int | None:
        """The HF tensor's split dim (None: replicated)."""
        return _SPLIT_DIM[self.kind]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Every HF tensor of a Qwen3 dense model at tensor_parallel `tp`, in HF state-dict order. Build with
    `ShardPlan.create(shape, tp)`; `tensors` maps hf_name → `TensorShard`."""

    shape: Qwen3Shape
    tp: int
    tensors: Mapping[str, TensorShard]

    @classmethod
    def create(cls, shape: Qwen3Shape, tp: int) -> ShardPlan:
        """Raises ConversionError: tp < 1, or tp does not divide the query groups, the FFN size or the
        padded vocabulary (pad it with `convert.pad_vocab_size(V, tp)`)."""
        check_tp(shape, tp)
        s, h, f, d = shape, shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
        hq, hkv = s.num_attention_heads * d, s.num_query_groups * d
        layer_shapes = {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (hq, h),
            "self_attn.k_proj.weight": (hkv, h),
            "self_attn.v_proj.weight": (hkv, h),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "self_attn.o_proj.weight": (h, hq),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        out: dict[str, TensorShard] = {}

        def add(hf_name: str, mcore_name: str, kind: Kind, part: str | None, dims: tuple[int, ...]) -> None:
            piece = list(dims)
            if kind == "vocab":
                piece[0] = s.padded_vocab_size // tp
            elif kind != "replicated":
                piece[_SPLIT_DIM[kind]] //= tp
            out[hf_name] = TensorShard(hf_name, mcore_name, kind, part, dims, tuple(piece))

        add("model.embed_tokens.weight", "embedding.word_embeddings.weight", "vocab", None, (s.vocab_size, h))
        for n in range(s.num_layers):
            for local, (mc_local, kind, part) in _LAYER.items():
                add(
                    f"model.layers.{n}.{local}",
                    f"decoder.layers.{n}.{mc_local}",
                    kind,
                    part,
                    layer_shapes[local],
                )
        add("model.norm.weight", "decoder.final_layernorm.weight", "replicated", None, (h,))
        if not s.tie_word_embeddings:
            add("lm_head.weight", "output_layer.weight", "vocab", None, (s.vocab_size, h))
        return cls(shape, tp, out)

    @property
    def local_shape(self) -> Qwen3Shape:
        """The shape one TP rank's attention sees: H/T heads, G/T query groups (for `pack_qkv` of a piece)."""
        return dataclasses.replace(
            self.shape,
            num_attention_heads=self.shape.num_attention_heads // self.tp,
            num_query_groups=self.shape.num_query_groups // self.tp,
        )

    def _entry(self, hf_name: str) -> TensorShard:
        if hf_name not in self.tensors:
            raise ConversionError(
                f"{hf_name!r} is not a tensor of this Qwen3 shape; expected an HF Qwen3 name"
            )
        return self.tensors[hf_name]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise ConversionError(f"rank={rank}: expected 0 <= rank < tensor_parallel={self.tp}")

    # ------------------------------------------------------------------------------- one HF tensor

    def split(self, hf_name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """TP rank `rank`'s piece of the HF tensor `hf_name` (a new contiguous tensor, same dtype).

        Raises:
            ConversionError: an unknown name, a misshapen tensor, or rank ∉ [0, tp).
        """
        e = self._entry(hf_name)
        self._check_rank(rank)
        if tuple(tensor.shape) != e.hf_shape:
            raise ConversionError(f"{hf_name} has shape {list(tensor.shape)}; expected {list(e.hf_shape)}")
        if e.kind == "replicated":
            return tensor.clone()
        if e.kind == "vocab":
            rows = e.piece_shape[0]
            piece = tensor.new_zeros(e.piece_shape)
            lo, hi = rank * rows, min((rank + 1) * rows, self.shape.vocab_size)
            if hi > lo:
                piece[: hi - lo] = tensor[lo:hi]
            return piece
        return tensor.chunk(self.tp, dim=e.dim)[rank].contiguous().clone()

    def gather(self, hf_name: str, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The HF tensor from every rank's piece (rank order); inverse of `split`. Replicated tensors must agree.

        Raises:
            ConversionError: not tp pieces, a misshapen piece, or a replicated tensor that differs between ranks.
        """
        e = self._entry(hf_name)
        if len(pieces) != self.tp:
            raise ConversionError(f"{hf_name}: {len(pieces)} pieces for tensor_parallel={self.tp}")
        for r, p in enumerate(pieces):
            if tuple(p.shape) != e.piece_shape:
                raise ConversionError(
                    f"{hf_name}: TP rank {r}'s piece has shape {list(p.shape)}; expected {list(e.piece_shape)}"
                )
        if e.kind == "replicated":
            for r, p in enumerate(pieces[1:], start=1):
                if not torch.equal(p, pieces[0]):
                    raise ConversionError(f"replicated {hf_name} differs between TP rank 0 and rank {r}")
            return pieces[0].clone()
        full = torch.cat(list(pieces), dim=e.dim)
        return full[: self.shape.vocab_size].clone() if e.kind == "vocab" else full

    # --------------------------------------------------------------------------------- a whole rank

    def pieces(self, hf: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s piece of every HF tensor of the plan (HF order). A tied checkpoint's `lm_head.weight`
        is ignored. Raises ConversionError: a missing, extra or misshapen tensor."""
        extra = sorted(
            set(hf) - set(self.tensors) - ({"lm_head.weight"} if self.shape.tie_word_embeddings else set())
        )
        if extra:
            raise ConversionError(f"HF state dict has {len(extra)} unexpected key(s), first {extra[0]!r}")
        missing = [n for n in self.tensors if n not in hf]
        if missing:
            raise ConversionError(f"HF state dict has no {missing[0]!r} ({len(missing)} missing)")
        return {n: self.split(n, hf[n], rank) for n in self.tensors}

    def gather_all(self, pieces_by_rank: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The HF state dict from every rank's `pieces` (rank order)."""
        return {n: self.gather(n, [p[n] for p in pieces_by_rank]) for n in self.tensors}

    def mcore_shard(self, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One rank's megatron state dict (what its GPTModel holds at TP = tp) from its HF pieces: q/k/v packed
        per query group, [gate; up] concatenated, the rest renamed."""
        out: dict[str, torch.Tensor] = {}
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for name, e in self.tensors.items():
            if e.part is None:
                out[e.mcore_name] = pieces[name].clone()
            else:
                fused.setdefault(e.mcore_name, {})[e.part] = pieces[name]
                out.setdefault(e.mcore_name, torch.empty(0))  # keep the megatron order
        local = self.local_shape
        for mc_name, parts in fused.items():
            if "q" in parts:
                out[mc_name] = pack_qkv(parts["q"], parts["k"], parts["v"], local)
            else:
                out[mc_name] = torch.cat([parts["gate"], parts["up"]], dim=0)
        return out

    def hf_piece(self, hf_name: str, mcore: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One HF tensor's piece, read from a rank's megatron state dict `mcore` (its GPTModel's tensors).

        Raises:
            ConversionError: `mcore` lacks the megatron tensor, or its shape is not this rank's.
        """
        e = self._entry(hf_name)
        if e.mcore_name not in mcore:
            raise ConversionError(f"megatron state dict has no {e.mcore_name!r} (for {hf_name})")
        t = mcore[e.mcore_name]
        if e.part is None:
            got = t
        elif e.part in ("q", "k", "v"):
            got = unpack_qkv(t, self.local_shape)["qkv".index(e.part)]
        else:
            rows = self.shape.ffn_hidden_size // self.tp
            if t.shape[0] != 2 * rows:
                raise ConversionError(
                    f"{e.mcore_name} has {t.shape[0]} rows; expected 2·{rows} at TP {self.tp}"
                )
            got = t[:rows] if e.part == "gate" else t[rows:]
        if tuple(got.shape) != e.piece_shape:
            raise ConversionError(
                f"{e.mcore_name} gives {hf_name} a piece of shape {list(got.shape)}; expected "
                f"{list(e.piece_shape)} at tensor_parallel={self.tp}"
            )
        return got.contiguous()

    def hf_pieces(self, mcore: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every HF tensor's piece from a rank's megatron state dict (inverse of `mcore_shard`)."""
        return {n: self.hf_piece(n, mcore).clone() for n in self.tensors}
