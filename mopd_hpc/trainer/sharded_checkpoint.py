"""A tensor-parallel actor's weights as a sharded checkpoint (torch.distributed.checkpoint), reshardable to
another TP size (DESIGN.md §7: "Resume at another world size: resharded, or refused naming both").

Layout: one DCP directory (`shards_dir(step_dir)` = `<step_dir>.shards`, next to rank 0's step directory):

    <root>/step_000050.shards/.metadata     DCP's global metadata (written by the coordinator, last)
    <root>/step_000050.shards/__<r>_0.distcp  rank r's pieces

Each HF tensor of the `ShardPlan` is one DCP entry named by its HF name, saved as a DTensor over the TP
group's 1-D device mesh: `Shard(dim)` for column/row/vocab tensors (the plan's even chunks are DTensor's
`Shard` chunks: dim 0 or 1, T equal pieces), `Replicate()` for the norms (DCP writes them once). The global
shape of every entry is the HF tensor's, except the vocabulary tensors, whose global shape is padded to
[V', h] (the plan's `padded_vocab_size`). Loading at TP = T' builds the same entries as DTensors of the
T'-rank plan (or plain whole tensors at T' = 1, no process group) and DCP reads each rank's slices from
whichever files hold them: a save at TP 2 loads at TP 1 or 4 (tested on CPU with gloo ranks).

Only the ranks of ONE TP group save (data-parallel rank 0's: the DP replicas hold the same weights); the
save is a collective over that group. A load at a padded vocabulary other than the saved one is refused,
naming both (megatron pads V to a multiple of 128·T: resharding across such paddings is not built; the
actor pads nothing today, `build_from_hf`: V' = V, V % T = 0).

The optimizer's parameter state (fp32 main params, Adam's exp_avg and exp_avg_sq: megatron's distributed
optimizer keeps it in DP-sharded flat buffers, different on each TP rank) is saved beside them, one file per
TP rank, `<root>/step_000050.shards/optimizer_param_state.tp<r>.pt` (`tp_param_state_file`): each TP rank's
state gathered over its DP group (`MegatronTrainEngine.tp_param_state`), written atomically by its DP rank 0,
and scattered back at load (`load_tp_param_state`), so a resume at the same tensor_parallel continues Adam's
moments bitwise. A checkpoint without those files (written before them) or saved at another tensor_parallel
(its state does not fit a reshard) restarts the moments at 0, with a warning in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.atomic import atomic_open
from mopd_hpc.engines.megatron.convert import ConversionError
from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.engines.own_file import FileRef

log = logging.getLogger("mopd_hpc.trainer")

SHARDS_SUFFIX = ".shards"
#: A TP rank's optimizer parameter state in the shards directory (`tp_param_state_file`).
TP_PARAM_STATE = "optimizer_param_state.tp{rank}.pt"


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use: importing it costs ≈ 0.9 CPU-s in a process that
    has not imported torch.distributed.tensor (through transformers), and the controller and every follower
    import this module whether or not they ever write a sharded checkpoint."""
    import torch.distributed.checkpoint as dcp

    return dcp


def shards_dir(step_dir: str | Path) -> Path:
    """`<root>/step_000050` → `<root>/step_000050.shards`."""
    p = Path(step_dir)
    return p.with_name(p.name + SHARDS_SUFFIX)


def _global_shape(plan: ShardPlan, name: str) -> tuple[int, ...]:
    e = plan.tensors[name]
    if e.kind == "vocab":
        return (plan.shape.padded_vocab_size, *e.hf_shape[1:])
    return e.hf_shape


def as_dtensors(plan: ShardPlan, pieces: Mapping[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    """This rank's `pieces` (HF name → piece, `ShardPlan.pieces` / `hf_pieces`) as DTensors over the 1-D TP
    `mesh` (`torch.distributed.device_mesh.DeviceMesh` of plan.tp ranks)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if mesh.size() != plan.tp:
        raise ConversionError(
            f"the device mesh has {mesh.size()} ranks; the plan is for tensor_parallel={plan.tp}"
        )
    out = {}
    for name, e in plan.tensors.items():
        placement = Replicate() if e.dim is None else Shard(e.dim)
        shape = _global_shape(plan, name)
        stride = torch.empty(shape, device="meta").stride()
        out[name] = DTensor.from_local(
            pieces[name].contiguous(), mesh, [placement], run_check=False, shape=shape, stride=stride
        )
    return out


def save_shards(
    directory: str | Path, plan: ShardPlan, pieces: Mapping[str, torch.Tensor], mesh: Any
) -> Path:
    """Every rank of the TP group writes its pieces to the DCP `directory` (a collective over the mesh's
    group; the coordinator writes `.metadata` after every rank's file). Returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _dcp().save(as_dtensors(plan, pieces, mesh), checkpoint_id=str(path), process_group=mesh.get_group())
    return path


def _metadata(directory: str | Path) -> Any:
    return _dcp().FileSystemReader(str(directory)).read_metadata()


def saved_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name → global shape of every entry of a sharded checkpoint (its `.metadata`)."""
    entries = _metadata(directory).state_dict_metadata
    return {k: tuple(v.size) for k, v in entries.items() if hasattr(v, "size")}


def load_shards(directory: str | Path, plan: ShardPlan, mesh: Any = None) -> dict[str, torch.Tensor]:
    """This rank's pieces at `plan.tp` from a sharded checkpoint saved at any TP size (module docstring).

    plan.tp = 1: whole tensors, read in this process alone (mesh None, no process group). plan.tp > 1: a
    collective over `mesh` (1-D, plan.tp ranks; this rank's coordinate in it is its TP rank).

    Raises:
        ConversionError: the checkpoint's tensors are not this plan's (a missing or extra name, another shape,
            another vocabulary padding: both named), or plan.tp > 1 without a mesh.
    """
    entries = _metadata(directory).state_dict_metadata
    saved = {k: tuple(v.size) for k, v in entries.items() if hasattr(v, "size")}
    want = {n: _global_shape(plan, n) for n in plan.tensors}
    if set(saved) != set(want):
        diff = sorted(set(saved) ^ set(want))
        raise ConversionError(
            f"{directory}: the sharded checkpoint's tensors differ from the model's, first {diff[0]!r}"
        )
    for name, shape in want.items():
        if saved[name] != shape:
            raise ConversionError(
                f"{directory}: {name} was saved with global shape {list(saved[name])}; this model at "
                f"tensor_parallel={plan.tp} expects {list(shape)} (padded_vocab_size "
                f"{plan.shape.padded_vocab_size})"
            )
    dtypes = {n: entries[n].properties.dtype for n in plan.tensors}
    if plan.tp == 1:
        state = {n: torch.empty(s, dtype=dtypes[n]) for n, s in want.items()}
        _dcp().load(state, checkpoint_id=str(directory), no_dist=True)
        return {n: plan.split(n, t[: plan.tensors[n].hf_shape[0]], 0) for n, t in state.items()}
    if mesh is None:
        raise ConversionError(f"tensor_parallel={plan.tp}: load_shards needs the TP group's device mesh")
    device = mesh.device_type  # "cpu" (gloo) or "cuda": the current device of each rank
    empty = {
        n: torch.empty(plan.tensors[n].piece_shape, dtype=dtypes[n], device=device) for n in plan.tensors
    }
    state = as_dtensors(plan, empty, mesh)
    _dcp().load(state, checkpoint_id=str(directory), process_group=mesh.get_group())
    return {n: t.to_local().clone() for n, t in state.items()}


def tp_param_state_file(step_dir: str | Path, tp_rank: int) -> Path:
    """`<root>/step_000050.shards/optimizer_param_state.tp<tp_rank>.pt`."""
    return shards_dir(step_dir) / TP_PARAM_STATE.format(rank=int(tp_rank))


def save_tp_param_state(engine: Any, step_dir: str | Path) -> Path | None:
    """Every rank of a TP engine: its TP rank's optimizer parameter state gathered over its DP group
    (`engine.tp_param_state()`, a collective), written by DP rank 0 to `tp_param_state_file` atomically
    (torch.save). Returns the file, None on the other DP ranks."""
    states = engine.tp_param_state()
    if engine.data_parallel.rank != 0:
        return None
    path = tp_param_state_file(step_dir, engine.tp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        torch.save(states, f)
    return path


def load_tp_param_state(engine: Any, step_dir: str | Path) -> bool:
    """Every rank of a TP engine, after `engine.load_state_dict` and its pieces: DP rank 0 reads its TP rank's
    file (memory-mapped) and scatters it over the DP group (`engine.load_tp_param_state`, a collective).
    Returns False, loading nothing, when the checkpoint holds no file per TP rank of this engine (an older
    checkpoint, or one saved at another tensor_parallel: every rank sees the same files, so all skip): the
    moments restart at 0 (`load_state_dict` zeroed them).

    Raises:
        OwnFileError: the file does not load; EngineError: it does not fit this rank's optimizer.
    """
    saved = sorted(shards_dir(step_dir).glob(TP_PARAM_STATE.format(rank="*")))
    tp = engine.shard_plan.tp
    if [p.name for p in saved] != sorted(TP_PARAM_STATE.format(rank=r) for r in range(tp)):
        log.warning(
            "%s holds the optimizer state of %d TP rank(s), this actor has %d: Adam's moments restart at 0",
            shards_dir(step_dir), len(saved), tp,
        )  # fmt: skip
        return False
    read = engine.data_parallel.rank == 0
    engine.load_tp_param_state(
        FileRef(tp_param_state_file(step_dir, engine.tp_rank)).load() if read else None
    )
    return True


def save_engine_shards(engine: Any, step_dir: str | Path) -> Path | None:
    """Rank side of a checkpoint of a TP engine (`engine.sharded_checkpoint`; every rank calls it): each TP
    rank's optimizer parameter state (`save_tp_param_state`, a collective over its DP group), then the ranks
    of data-parallel rank 0's TP group write their pieces to `shards_dir(step_dir)` (a collective over that
    group); other DP ranks write nothing more (their weights are the same). Returns the directory, None where
    nothing was written."""
    if not engine.sharded_checkpoint:
        return None
    save_tp_param_state(engine, step_dir)
    if engine.data_parallel.rank != 0:
        return None
    return save_shards(shards_dir(step_dir), engine.shard_plan, engine.shard_pieces(), engine.tp_mesh())


def load_engine_shards(engine: Any, step_dir: str | Path) -> None:
    """Every rank of a TP engine loads its pieces from `shards_dir(step_dir)` (a collective over its own TP
    group), then its TP rank's optimizer parameter state (`load_tp_param_state`); nothing unless
    `engine.sharded_checkpoint` (its state_dict holds the model then). Raises ConversionError: the
    checkpoint does not fit the model (`load_shards`); what `load_tp_param_state` raises."""
    if not engine.sharded_checkpoint:
        return
    plan = engine.shard_plan
    pieces = load_shards(shards_dir(step_dir), plan, engine.tp_mesh() if plan.tp > 1 else None)
    engine.load_shard_pieces(pieces)
    load_tp_param_state(engine, step_dir)
