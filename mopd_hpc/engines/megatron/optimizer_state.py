"""The distributed optimizer's parameter state in a checkpoint: fp32 main params and Adam's moments.

megatron's `DistributedOptimizer.state_dict()` holds only the DP-independent part (param groups: lr, step
count); the per-parameter state (fp32 main params, exp_avg, exp_avg_sq) lives in DP-sharded flat buffers.
Megatron-LM saves it through `get_parameter_state_dp_zero()` (each DP rank's shard gathered to DP rank 0 over
the gloo DP group) and loads it through `load_parameter_state_from_dp_zero(state)` (DP rank 0 scatters each
rank's shard): both exist with these meanings in megatron-core 0.16.1 and 0.19.x
(megatron/core/optimizer/distrib_optimizer.py), both are collectives over the DP group.

The gathered state (on DP rank 0; None elsewhere) is, per grad buffer index and (param dtype, grad dtype):
`{"param" | "exp_avg" | "exp_avg_sq": float32 [numel_unpadded] CPU, "numel_unpadded": int}`, plus
`"buckets_coalesced": True`: 12 bytes per parameter (~96 GB for an 8B model). It goes into the engine's
`state_dict()` under `PARAM_STATE_KEY` as an `OwnFile` (engines/own_file.py): the checkpoint writes it to
its own file, `PARAM_STATE_FILE` in the step directory, whose size and SHA-256 the manifest holds
(trainer/checkpoint_verify.py: a truncated or damaged copy is refused, and the previous good checkpoint
used). At load only DP rank 0 reads it (`reads_saved_state`; `torch.load(weights_only=True, mmap=True)`,
dtype tuple keys included); the other DP ranks take part in the scatter without opening it, so their host
memory never holds it. Every rank still checks that the saved state fits its optimizer before any
collective (`check`), from `layout(state)`: the sizes alone, saved in model.pt under `PARAM_LAYOUT_KEY`.
An older checkpoint holds the state itself inside model.pt (every rank loads it, as before) or none.

Loading order matters: `optimizer.load_state_dict` first (allocates the moment tensors, restores step and
lr), the model weights and `reload_model_params` next (main params from bf16 weights: rounded), the
parameter state last (the exact fp32 main params and the moments overwrite them).

megatron's dp_zero load copies every tensor of a parameter's optimizer state from the loaded dict; torch
Adam (megatron's fallback without Transformer Engine or Apex) keeps a tensor "step" there too, which the
dp_zero dict does not hold (a KeyError in both versions). `scatter` hides those extra entries during the
load and puts them back (the step count is the param groups', restored by `load_state_dict`).

On that same path megatron's `load_state_dict` hands ONE step tensor to every parameter's state, and torch
Adam keeps it as given (`_process_value_according_to_param_policy`: a non-fused, non-capturable "step" is
not copied), so each optimizer step would add 1 to it once per parameter: the bias corrections of the
resumed run would be wrong from its first step. `separate_steps` gives each parameter its own copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

#: The engine state's key for the gathered parameter state (None: not in model.pt's state, e.g. at
#: tensor_parallel > 1, where each TP rank's goes to the sharded checkpoint: trainer/sharded_checkpoint.py).
PARAM_STATE_KEY = "optimizer_param_state"
#: The checkpoint file it is written to (an own file of the step directory, trainer/checkpoint.py).
PARAM_STATE_FILE = "optimizer_param_state.pt"
#: The engine state's key for its `layout` (in model.pt: what every DP rank checks; None with no state).
PARAM_LAYOUT_KEY = "optimizer_param_layout"
#: The per-parameter tensors the dp_zero dict carries for Adam.
TENSOR_KEYS = ("param", "exp_avg", "exp_avg_sq")


class OptimizerStateError(ValueError):
    """A saved parameter state does not fit this optimizer (missing parts, other sizes)."""


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers in a MegatronOptimizer (`get_megatron_optimizer` returns a ChainedOptimizer
    of one per parameter kind: dense, experts), in their order."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [inner for child in chained for inner in distributed_optimizers(child)]


def gather(optimizer: Any) -> list[dict[Any, Any]] | None:
    """Every DP rank's shard of the parameter state gathered on DP rank 0 (a collective over the DP group:
    call it on every DP rank). Returns, on DP rank 0, one dp_zero dict (module docstring) per
    `distributed_optimizers` entry; None elsewhere."""
    states = [opt.get_parameter_state_dp_zero() for opt in distributed_optimizers(optimizer)]
    return states if all(s is not None for s in states) else None


def reads_saved_state(optimizer: Any) -> bool:
    """True on the rank that holds `gather`'s result and reads a saved one for `scatter`: data-parallel rank 0
    of every distributed optimizer (DP size 1 included)."""
    return all(opt.data_parallel_group.rank() == 0 for opt in distributed_optimizers(optimizer))


def layout(states: list[Mapping[Any, Any]] | None) -> list[dict[int, dict[Any, dict[str, int]]]] | None:
    """The sizes of a gathered state (`gather`'s result), without its tensors: per distributed optimizer,
    `{buffer index: {(param dtype, grad dtype): {"param" | "exp_avg" | "exp_avg_sq": numel}}}`; None for
    None. `check` accepts it in place of the state."""
    if states is None:
        return None
    return [
        {
            i: {
                dtype: {k: part[k].numel() for k in TENSOR_KEYS if k in part}
                for dtype, part in state[i].items()
            }
            for i in state
            if isinstance(i, int)
        }
        for state in states
    ]


def _numel(entry: Any) -> int:
    """A tensor's element count, or a `layout`'s (already a count)."""
    return entry if isinstance(entry, int) else entry.numel()


def problems(state: Mapping[Any, Any], optimizer: Any) -> list[str]:
    """What in a gathered `state` (or its `layout`: element counts for tensors) does not fit `optimizer`
    (its `buffers[i].numel_unpadded`); [] when it fits."""
    found: list[str] = []
    buffers = list(getattr(optimizer, "buffers", []))
    indices = sorted(k for k in state if isinstance(k, int))
    if indices != list(range(len(buffers))):
        return [f"the saved parameter state has grad buffers {indices}; this optimizer has {len(buffers)}"]
    for i, buffer in enumerate(buffers):
        for dtype, part in state[i].items():
            for key in TENSOR_KEYS:
                if key not in part:
                    found.append(f"grad buffer {i} {dtype}: no {key!r}")
                elif (n := _numel(part[key])) != buffer.numel_unpadded:
                    found.append(
                        f"grad buffer {i} {dtype} {key!r}: {n} elements, this optimizer's "
                        f"buffer holds {buffer.numel_unpadded} (another model or layout)"
                    )
    return found


@contextlib.contextmanager
def _without_extra_state(states: Mapping[Any, dict[str, Any]]) -> Iterator[None]:
    """Hide each parameter's optimizer-state entries other than the moments (torch Adam's "step") and put
    them back afterwards, even on an error."""
    hidden = {p: {k: s.pop(k) for k in list(s) if k not in TENSOR_KEYS} for p, s in states.items()}
    try:
        yield
    finally:
        for p, extra in hidden.items():
            states[p].update(extra)


def separate_steps(optimizer: Any) -> int:
    """Give each parameter its own copy of a shared tensor "step" (module docstring); returns the copies
    made. Call right after `optimizer.load_state_dict`."""
    copies = 0
    for opt in distributed_optimizers(optimizer):
        seen: set[int] = set()
        for state in opt.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                    copies += 1
                seen.add(id(step))
    return copies


def zero_moments(optimizer: Any) -> int:
    """Set every Adam moment (exp_avg, exp_avg_sq) to 0: what a load WITHOUT a parameter state (a checkpoint
    written before it was saved; at tensor_parallel > 1 until the sharded checkpoint's file restores it) must do, since megatron's `load_state_dict`
    allocates them with `torch.empty` (uninitialized memory). Returns the tensors zeroed."""
    zeroed = 0
    for opt in distributed_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            for key in TENSOR_KEYS[1:]:
                if isinstance(state.get(key), torch.Tensor):
                    state[key].zero_()
                    zeroed += 1
    return zeroed


def check(optimizer: Any, states: list[Mapping[Any, Any]] | None) -> None:
    """Refuse a gathered state (`gather`'s result, or its `layout`; None: nothing to check) that does not fit
    `optimizer`.

    Raises:
        OptimizerStateError: another count of distributed optimizers, missing parts or other sizes
            (`problems`), one line each.
    """
    if states is None:
        return
    opts = distributed_optimizers(optimizer)
    if len(states) != len(opts):
        raise OptimizerStateError(
            f"the saved parameter state holds {len(states)} distributed optimizers; this one has {len(opts)}"
        )
    found = [line for opt, state in zip(opts, states, strict=True) for line in problems(state, opt)]
    if found:
        raise OptimizerStateError("; ".join(found))


def scatter(optimizer: Any, states: list[Mapping[Any, Any]] | None) -> None:
    """Load what `gather` returned (a collective over the DP group: call it on every DP rank; DP rank 0
    reads `states`, the others may pass it or None). Call after `optimizer.load_state_dict`.

    Raises:
        OptimizerStateError: `states` does not fit the optimizer (`check`, before any collective), or DP
            rank 0 has none.
    """
    check(optimizer, states)
    for i, opt in enumerate(distributed_optimizers(optimizer)):
        load_dp_zero(opt, None if states is None else states[i])


def load_dp_zero(opt: Any, state: Mapping[Any, Any] | None) -> None:
    """One distributed optimizer's `load_parameter_state_from_dp_zero(state)` (a collective over its DP group;
    its DP rank 0 passes the state, the others may pass None), torch Adam's extra entries hidden.

    Raises:
        OptimizerStateError: its DP rank 0 has no state.
    """
    if state is None and opt.data_parallel_group.rank() == 0:
        raise OptimizerStateError("no saved parameter state to load on data-parallel rank 0")
    # no_grad: with float32 parameters megatron's main params are views of the model's (a leaf that requires
    # grad), which its in-place copy refuses outside no_grad
    with _without_extra_state(opt.optimizer.state), torch.no_grad():
        opt.load_parameter_state_from_dp_zero(state)
