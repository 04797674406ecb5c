"""The checkpoint half of the megatron actor: `MegatronCheckpointState`, the base class of
`engine.MegatronTrainEngine` that holds its save and load methods (`state_dict`, `load_state_dict`, the TP
shard pieces and the TP rank's optimizer parameter state of a sharded checkpoint, trainer/sharded_checkpoint.py)
and the residency guard every engine method starts with. It reads the attributes the engine's `__init__` sets
(`model`, `optimizer`, `scheduler`, `shard_plan`, `data_parallel`, `residency`, `device`, `dtype`, `tp_rank`,
`steps`); it builds nothing itself. The optimizer's parameter state (fp32 main params, Adam's moments) is
gathered and scattered by `optimizer_state.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.megatron import expert_checkpoint, optimizer_state, parallel
from mopd_hpc.engines.megatron.expert_parallel import gather_experts, shard_experts
from mopd_hpc.engines.megatron.model import DTYPES, load_mcore_state
from mopd_hpc.engines.megatron.residency import DDPResidency
from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.engines.memory.residency import RequiresResident
from mopd_hpc.engines.own_file import OwnFile, OwnFileError
from mopd_hpc.engines.own_file import resolve as resolve_own_file
from mopd_hpc.engines.protocol import EngineError


class MegatronCheckpointState(RequiresResident):
    """Save and load of the megatron actor's state (module docstring); `MegatronTrainEngine` is its subclass."""

    model: torch.nn.Module
    optimizer: Any  # megatron-core's (distributed) MegatronOptimizer
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    shard_plan: ShardPlan
    data_parallel: DataParallel
    residency: DDPResidency
    device: torch.device
    dtype: str
    tp_rank: int
    steps: int
    shape: Any  # convert.Qwen3Shape
    expert_parallel: tuple[int, int, Any]  # (size, rank, group) of megatron's EP group

    @property
    def sharded_checkpoint(self) -> bool:
        """True at tensor_parallel > 1: each TP rank's weights differ, so a checkpoint holds every rank's
        shards (trainer/sharded_checkpoint.py, from `shard_pieces`) and `state_dict` leaves the model out."""
        return self.shard_plan.tp > 1

    def _local_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}

    def shard_pieces(self) -> dict[str, torch.Tensor]:
        """This TP rank's piece of every HF tensor (`ShardPlan.hf_pieces` of its GPTModel), on its device."""
        self._require_resident("shard_pieces")
        return self.shard_plan.hf_pieces(self._local_state())

    def load_shard_pieces(self, pieces: Mapping[str, torch.Tensor]) -> None:
        """Load this TP rank's pieces (from a sharded checkpoint, any TP size it was saved at) into the model,
        and the optimizer's main (fp32) copies from them (`reload_model_params`), as Megatron-LM does after
        loading weights without their optimizer state."""
        self._require_resident("load_shard_pieces")
        dtype = DTYPES[self.dtype]
        state = {k: v.to(self.device, dtype) for k, v in self.shard_plan.mcore_shard(pieces).items()}
        load_mcore_state(self.model, state)
        reload = getattr(self.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()

    def tp_mesh(self) -> Any:
        """The 1-D device mesh of this rank's TP group (what torch.distributed.checkpoint shards over)."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(parallel.tp_info()[2], self.device.type)

    @property
    def collective_state_dict(self) -> bool:
        """True when `state_dict` is a collective the other DP ranks must join (`join_state_dict`): at
        tensor_parallel 1 and DP > 1, the optimizer's parameter state is gathered over the DP group."""
        return self.shard_plan.tp == 1 and self.data_parallel.size > 1

    def tp_param_state(self) -> list[dict[Any, Any]] | None:
        """At tensor_parallel > 1 (`sharded_checkpoint`), where `state_dict` leaves it out: this TP rank's
        optimizer parameter state (the fp32 main params, exp_avg and exp_avg_sq of its shard; each TP rank's
        differs) gathered over its DP group (`optimizer_state.gather`: a collective every DP rank of the group
        joins). Returns it on DP rank 0 (`gather`'s per-distributed-optimizer dicts), None elsewhere; the
        checkpoint keeps one file per TP rank (trainer/sharded_checkpoint.py `save_tp_param_state`)."""
        self._require_resident("tp_param_state")
        return optimizer_state.gather(self.optimizer)

    def load_tp_param_state(self, states: list[Mapping[Any, Any]] | None) -> None:
        """Inverse of `tp_param_state` (a collective over the DP group: DP rank 0 passes what it saved, the
        others None), after `load_state_dict` (which zeroed the moments) and `load_shard_pieces` (main params
        from the bf16 weights): the exact fp32 main params and Adam's moments of this TP rank's shard.

        Raises:
            EngineError: the saved state does not fit this rank's optimizer (another model or TP size), or
                DP rank 0 has none.
        """
        self._require_resident("load_tp_param_state")
        try:
            optimizer_state.scatter(self.optimizer, states)
        except optimizer_state.OptimizerStateError as err:
            raise EngineError(
                f"the checkpoint's optimizer state of TP rank {self.tp_rank}: {err}; resume at the saved "
                "tensor_parallel with the model the checkpoint was saved with"
            ) from None

    def _scatter_expert_parallel(self, param_state: Any, saved_ep: int) -> None:
        """`expert_checkpoint.scatter` over this EP group, its error as the engine's."""
        ep, _, group = self.expert_parallel
        try:
            expert_checkpoint.scatter(self.optimizer, param_state, saved_ep, ep, group)
        except optimizer_state.OptimizerStateError as err:
            raise EngineError(
                f"the checkpoint's optimizer state ({optimizer_state.PARAM_STATE_KEY}): {err}; resume with the "
                "model and expert_parallel the checkpoint was saved with"
            ) from None

    def join_state_dict(self) -> None:
        """A DP rank > 0's part in rank 0's `state_dict` (its optimizer shard); nothing to write."""
        if self.collective_state_dict:
            self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """model (None when `sharded_checkpoint`: the shards are saved apart), the optimizer's state_dict (the
        distributed optimizer's DP-independent part: step count, lr), `optimizer_state.PARAM_STATE_KEY`: the
        fp32 main params and Adam's exp_avg/exp_avg_sq gathered from every DP rank (`optimizer_state.gather`,
        a collective over the DP group: every DP rank calls it, `join_state_dict`), as an `OwnFile`
        (`optimizer_state.PARAM_STATE_FILE`: the checkpoint writes it apart from model.pt, engines/own_file.py),
        and `optimizer_state.PARAM_LAYOUT_KEY`: its sizes (both None on DP ranks > 0 and at tensor_parallel
        > 1, where each TP rank's shard differs: `tp_param_state` gives it to the sharded checkpoint), the lr
        scheduler's state (`scheduler`), steps. At expert_parallel > 1 (a collective over the EP group too):
        the model with every expert (global indices, `gather_experts`: loadable at any EP size) and the
        parameter state per EP rank (`expert_checkpoint.gather`, its layout the saved EP size)."""
        self._require_resident("state_dict")
        ep, _, ep_group = self.expert_parallel
        if ep > 1:  # every expert gathered over the EP group; the optimizers' states per EP rank
            param_state: Any = expert_checkpoint.gather(self.optimizer, ep_group)
            local = {k: v for k, v in self.model.state_dict().items() if not k.endswith("._extra_state")}
            model = gather_experts(local, self.shape.num_experts, ep, ep_group)
            param_layout: Any = expert_checkpoint.layout(ep)
        else:
            param_state = optimizer_state.gather(self.optimizer) if self.shard_plan.tp == 1 else None
            model = None if self.sharded_checkpoint else self.model.state_dict()
            param_layout = optimizer_state.layout(param_state)
        return {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            optimizer_state.PARAM_STATE_KEY: (
                None if param_state is None else OwnFile(optimizer_state.PARAM_STATE_FILE, param_state)
            ),
            optimizer_state.PARAM_LAYOUT_KEY: param_layout,
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of `state_dict`; a None model (a sharded checkpoint) leaves the weights to
        `load_shard_pieces`. With a saved parameter state (tensor_parallel 1) a collective over the DP
        group: every DP rank calls it with the same checkpoint. Order: optimizer state_dict (each parameter's
        step tensor then made its own, `optimizer_state.separate_steps`), weights and `reload_model_params`,
        then the exact fp32 main params and moments (optimizer_state.py); without a saved parameter state
        (an older checkpoint, tensor_parallel > 1) the moments are set to 0 (`optimizer_state.zero_moments`;
        at tensor_parallel > 1 `load_tp_param_state` then restores them from the sharded checkpoint).

        The parameter state's entry is a `FileRef` for a checkpoint that wrote it to its own file: only DP
        rank 0 reads it (`optimizer_state.reads_saved_state`, `own_file.resolve`: memory-mapped), the other
        DP ranks check its layout (`optimizer_state.PARAM_LAYOUT_KEY`) and join the scatter without opening
        it. An `OwnFile` (straight from `state_dict`) or the state itself (an older checkpoint's model.pt)
        is used on every rank, as it is.

        Raises:
            EngineError: a sharded checkpoint's state given to a TP 1 engine; the saved parameter state does
                not fit this optimizer (optimizer_state.OptimizerStateError's message) or its file does not
                load (own_file.OwnFileError's).
        """
        self._require_resident("load_state_dict")
        if state["model"] is None and not self.sharded_checkpoint:
            raise EngineError(
                "the checkpoint's model was saved as TP shards (a tensor_parallel > 1 run); this engine runs at "
                "tensor_parallel 1: load its shards with trainer/sharded_checkpoint.py, or resume at the saved TP"
            )
        entry = state.get(optimizer_state.PARAM_STATE_KEY)
        ep, ep_rank, ep_group = self.expert_parallel
        saved_ep = expert_checkpoint.saved_expert_parallel(state.get(optimizer_state.PARAM_LAYOUT_KEY))
        per_ep_rank = ep > 1 or saved_ep > 1  # the parameter state per EP rank (expert_checkpoint.py)
        if per_ep_rank:  # global rank 0 reads it
            read = entry is not None and (not dist.is_initialized() or dist.get_rank() == 0)
        else:
            read = entry is not None and optimizer_state.reads_saved_state(self.optimizer)
        try:  # a FileRef: read (mmap) on DP rank 0 alone
            param_state = resolve_own_file(entry, read=read)
        except OwnFileError as err:
            raise EngineError(
                f"the checkpoint's optimizer state: {err}; the file changed after the checkpoint was verified: "
                "remove that checkpoint directory to resume from the previous one"
            ) from None
        saved = param_state if param_state is not None else state.get(optimizer_state.PARAM_LAYOUT_KEY)
        try:  # before anything is loaded: a state that does not fit leaves the engine as it was
            if not per_ep_rank:
                optimizer_state.check(self.optimizer, saved)
        except optimizer_state.OptimizerStateError as err:
            raise EngineError(
                f"the checkpoint's optimizer state ({optimizer_state.PARAM_STATE_KEY}): {err}; resume with the "
                "model the checkpoint was saved with"
            ) from None
        if saved_ep == ep:  # at another EP size Adam starts again (expert_checkpoint.py): its own optimizers
            self.optimizer.load_state_dict(state["optimizer"])
            optimizer_state.separate_steps(self.optimizer)  # torch Adam's shared "step" after megatron's load
        if "scheduler" in state:  # the schedule goes on where it stopped (an older checkpoint: from step 0)
            self.scheduler.load_state_dict(dict(state["scheduler"]))
        if state["model"] is not None:  # every expert (EP 1, or gathered): this EP rank's
            model = dict(state["model"])
            load_mcore_state(
                self.model, shard_experts(model, self.shape.num_experts, ep, ep_rank) if ep > 1 else model
            )
            reload = getattr(self.optimizer, "reload_model_params", None)
            if reload is not None:  # the optimizer's fp32 main copies from the loaded weights, as Megatron-LM
                reload()
        if entry is not None and per_ep_rank:
            self._scatter_expert_parallel(param_state, saved_ep)
        elif entry is not None:  # every DP rank loads the same checkpoint: all join, DP rank 0 reads it
            optimizer_state.scatter(self.optimizer, param_state)
        else:  # none here (an older checkpoint; at TP > 1 load_tp_param_state follows): 0, not torch.empty's bytes
            optimizer_state.zero_moments(self.optimizer)
        self.steps = int(state.get("steps", 0))
