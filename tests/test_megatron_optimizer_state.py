"""The megatron actor's checkpoint carries the distributed optimizer's parameter state (CPU part).

megatron's DistributedOptimizer needs CUDA, so the optimizer here is a stand-in with its API and its
semantics: a bf16 model, fp32 main params stepped by a real torch Adam (megatron's fallback without
Transformer Engine), `state_dict` = the DP-independent part (param groups with lr and step),
`load_state_dict` allocating the moments as megatron's does (empty tensors plus ONE tensor "step" shared
by every parameter, which torch Adam keeps shared: `optimizer_state.separate_steps`),
`get_parameter_state_dp_zero` / `load_parameter_state_from_dp_zero` with megatron's dict layout and its
copy of every tensor of a parameter's optimizer state (`_set_main_param_and_optimizer_states`: a KeyError
on "step" unless it is hidden). The engine is `MegatronTrainEngine` itself (its state_dict/load_state_dict),
built without its CUDA constructor; checkpoints go through `save_checkpoint` / `load_latest`.

Oracle: 3 steps straight equal 2 steps, save, a fresh engine (other initial weights) loads, 1 step: the
weights, exp_avg and exp_avg_sq bitwise, the step count and lr equal. Without the parameter state the
resumed weights differ (the check can fail). A byte flipped or cut in the saved parameter state is refused
by the checkpoint verification (it lives in model.pt, whose SHA-256 the manifest holds).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.megatron import engine as megatron_engine
from mopd_hpc.engines.megatron import optimizer_state
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.trainer.checkpoint import CheckpointError, load_latest, save_checkpoint

DTYPE_KEY = (torch.bfloat16, torch.float32)  # megatron's (param dtype, grad dtype) key


class StandInDistOpt:
    """megatron's DistributedOptimizer at DP 1 over one grad buffer (module docstring): one fp32 main param
    per model param, the dp_zero dict holds them (and their moments) concatenated."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2) -> None:
        self.model = model
        self.mains = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        self.optimizer = torch.optim.Adam(self.mains, lr=lr)
        self.buffers = [SimpleNamespace(numel_unpadded=sum(m.numel() for m in self.mains))]
        self.data_parallel_group = SimpleNamespace(rank=lambda: 0, size=lambda: 1)
        self.param_groups = self.optimizer.param_groups

    def step(self) -> None:
        for main, p in zip(self.mains, self.model.parameters(), strict=True):
            main.grad = p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for main, p in zip(self.mains, self.model.parameters(), strict=True):
                p.copy_(main)

    def state_dict(self) -> dict[str, Any]:
        inner = self.optimizer.state_dict()
        steps = {s["step"].item() for s in inner["state"].values()}
        assert len(steps) == 1
        step = steps.pop()
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"step": step} for g in inner["param_groups"]
        ]
        return {"optimizer": {"param_groups": groups}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """megatron's no-TE path: empty moments and ONE step tensor given to every param."""
        groups = [dict(g, params=list(range(len(self.mains)))) for g in state["optimizer"]["param_groups"]]
        step = torch.tensor(groups[0].pop("step"), dtype=torch.float)
        garbage = float("nan")  # megatron allocates with torch.empty: whatever the memory held
        inner = {i: {"exp_avg": torch.full_like(m, garbage), "exp_avg_sq": torch.full_like(m, garbage),
                     "step": step} for i, m in enumerate(self.mains)}  # fmt: skip
        self.optimizer.load_state_dict({"state": inner, "param_groups": groups})

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for main, p in zip(self.mains, self.model.parameters(), strict=True):
                main.copy_(p)

    def _flat(self, key: str) -> torch.Tensor:
        if key == "param":
            return torch.cat([m.detach().reshape(-1) for m in self.mains])
        return torch.cat([self.optimizer.state[m][key].reshape(-1) for m in self.mains])

    def get_parameter_state_dp_zero(self) -> dict[Any, Any]:
        part: dict[str, Any] = {k: self._flat(k).clone() for k in ("param", "exp_avg", "exp_avg_sq")}
        part["numel_unpadded"] = self.buffers[0].numel_unpadded
        return {"buckets_coalesced": True, 0: {DTYPE_KEY: part}}

    def load_parameter_state_from_dp_zero(self, state: dict[Any, Any]) -> None:
        offset = 0
        for main in self.mains:
            n = main.numel()
            tensors = {
                k: state[0][DTYPE_KEY][k][offset : offset + n].view_as(main)
                for k in ("param", "exp_avg", "exp_avg_sq")
            }
            dst = {"param": main, **self.optimizer.state[main]}  # megatron-core 0.16.1's copy
            with torch.no_grad():
                for key in dst:
                    dst[key].copy_(tensors[key])
            offset += n


def _engine(seed: int) -> megatron_engine.MegatronTrainEngine:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    engine = object.__new__(megatron_engine.MegatronTrainEngine)
    engine.model, engine.steps = model, 0
    engine.optimizer = StandInDistOpt(model)
    engine.shard_plan = SimpleNamespace(tp=1)
    engine.residency = SimpleNamespace(on_device=True)
    engine.data_parallel = DataParallel.single()
    return engine


def _step(engine: megatron_engine.MegatronTrainEngine, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(5, 6, generator=g).bfloat16(), torch.randn(5, 4, generator=g)
    engine.model.zero_grad()
    ((engine.model(x).float() - y) ** 2).mean().backward()  # the gradient depends on the weights
    engine.optimizer.step()
    engine.steps += 1


def _moments(engine: megatron_engine.MegatronTrainEngine) -> dict[str, torch.Tensor]:
    opt = engine.optimizer
    steps = torch.stack([opt.optimizer.state[m]["step"] for m in opt.mains])
    return {k: opt._flat(k) for k in ("param", "exp_avg", "exp_avg_sq")} | {"steps": steps}


def _resumed(root: Path, drop_param_state: bool = False) -> megatron_engine.MegatronTrainEngine:
    saved = _engine(0)
    for k in (1, 2):
        _step(saved, k)
    state = saved.state_dict()
    if drop_param_state:
        state[optimizer_state.PARAM_STATE_KEY] = None
    save_checkpoint(root, 2, state, rng_state={})
    fresh = _engine(7)  # other initial weights: everything must come from the checkpoint
    fresh.load_state_dict(load_latest(root).engine_state)
    return fresh


def test_resume_equals_straight_run_bitwise(tmp_path: Path) -> None:
    straight = _engine(0)
    for k in (1, 2):
        _step(straight, k)
    at_two = {k: v.clone() for k, v in _moments(straight).items()}
    resumed = _resumed(tmp_path / "ck")
    for k, v in _moments(resumed).items():
        assert torch.equal(v, at_two[k]), k  # exp_avg, exp_avg_sq, fp32 main params after step 2
    assert resumed.steps == 2
    assert resumed.optimizer.state_dict() == straight.optimizer.state_dict()  # step count and lr
    _step(straight, 3)
    _step(resumed, 3)
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(
        torch.equal(a, b)
        for a, b in zip(_moments(straight).values(), _moments(resumed).values(), strict=True)
    )


def test_without_the_parameter_state_the_resume_differs(tmp_path: Path) -> None:
    straight = _engine(0)
    for k in (1, 2, 3):
        _step(straight, k)
    resumed = _resumed(tmp_path / "ck", drop_param_state=True)
    moments = _moments(resumed)
    assert not moments["exp_avg"].any() and not moments["exp_avg_sq"].any()  # restarted at 0, not garbage
    _step(resumed, 3)
    assert torch.isfinite(resumed.model.weight).all()
    assert not torch.equal(straight.model.weight, resumed.model.weight)


def test_megatron_copy_needs_the_step_hidden() -> None:
    engine = _engine(0)
    _step(engine, 1)
    state = engine.optimizer.get_parameter_state_dp_zero()
    with pytest.raises(KeyError, match="step"):  # what megatron's own load does with torch Adam's state
        engine.optimizer.load_parameter_state_from_dp_zero(state)
    optimizer_state.scatter(engine.optimizer, [state])
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in engine.optimizer.optimizer.state.values())


def test_a_state_that_does_not_fit_is_refused_before_loading(tmp_path: Path) -> None:
    saved = _engine(0)
    _step(saved, 1)
    state = saved.state_dict()
    part = state[optimizer_state.PARAM_STATE_KEY][0][0][DTYPE_KEY]
    part["exp_avg"] = part["exp_avg"][:-1]
    fresh = _engine(1)
    before = fresh.optimizer._flat("param")
    with pytest.raises(EngineError, match="'exp_avg': 27 elements, this optimizer's buffer holds 28"):
        fresh.load_state_dict(state)
    assert torch.equal(fresh.optimizer._flat("param"), before)
    with pytest.raises(optimizer_state.OptimizerStateError, match="holds 2 distributed optimizers"):
        optimizer_state.scatter(fresh.optimizer, [state[optimizer_state.PARAM_STATE_KEY][0]] * 2)


def _damaged_checkpoint(root: Path, how: str) -> None:
    engine = _engine(0)
    _step(engine, 1)
    path = save_checkpoint(root, 1, engine.state_dict(), rng_state={}) / "model.pt"
    data = bytearray(path.read_bytes())
    exp_avg = engine.optimizer.get_parameter_state_dp_zero()[0][DTYPE_KEY]["exp_avg"]
    at = bytes(data).find(exp_avg.numpy().tobytes())  # the saved moments' bytes inside model.pt
    assert at > 0
    if how == "flip":
        data[at + 3] ^= 0x40
    else:
        data = data[: at + 8]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "cut"])
def test_a_damaged_parameter_state_is_refused(tmp_path: Path, how: str) -> None:
    _damaged_checkpoint(tmp_path / "ck", how)
    what = "SHA-256 differs" if how == "flip" else "truncated"
    with pytest.raises(CheckpointError, match=rf"model\.pt: .*{what}"):
        load_latest(tmp_path / "ck")


def test_chained_optimizers_are_walked_in_order() -> None:
    a, b, c = object(), object(), object()
    chain = SimpleNamespace(chained_optimizers=[a, SimpleNamespace(chained_optimizers=[b, c])])
    assert optimizer_state.distributed_optimizers(chain) == [a, b, c]
    assert optimizer_state.distributed_optimizers(a) == [a]


def test_the_step_tensor_megatron_shares_is_separated() -> None:
    saved = _engine(0)
    _step(saved, 1)
    fresh = _engine(1)
    fresh.optimizer.load_state_dict(saved.optimizer.state_dict())
    weight, bias = fresh.optimizer.optimizer.state.values()
    assert weight["step"] is bias["step"]  # one tensor: each Adam step would add 2 to it
    assert optimizer_state.separate_steps(fresh.optimizer) == 1
    assert weight["step"] is not bias["step"] and weight["step"].item() == bias["step"].item() == 1.0
    assert optimizer_state.separate_steps(fresh.optimizer) == 0
