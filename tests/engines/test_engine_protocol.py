"""Both train engines conform to `engines.protocol.TrainEngine`, the type the controller and the actor group's
ranks are written against: the torch engine as a real instance on a micro model (`isinstance` of the runtime
protocol, and a real call of every method the controller makes); the megatron engine, which needs CUDA to be
built, by its class: every protocol method with a signature that accepts the protocol's parameters, and the
`residency` attribute its constructor sets."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.protocol import TrainEngine
from mopd_hpc.mopd.targets import TeacherTargets

#: Protocol members that are data, not methods.
DATA_MEMBERS = {"residency"}


def protocol_methods() -> dict[str, inspect.Signature]:
    names = {
        n
        for klass in TrainEngine.__mro__
        if klass.__module__ == "mopd_hpc.engines.protocol"
        for n, v in vars(klass).items()
        if callable(v) and not n.startswith("_")
    }
    return {n: inspect.signature(getattr(TrainEngine, n)) for n in sorted(names)}


def assert_accepts(impl: type, name: str, want: inspect.Signature) -> None:
    got = inspect.signature(getattr(impl, name))
    params = got.parameters
    for p in want.parameters.values():
        assert p.name in params, f"{impl.__name__}.{name}{got} lacks parameter {p.name!r} of {want}"
        if p.default is not inspect.Parameter.empty:
            assert params[p.name].default is not inspect.Parameter.empty, f"{impl.__name__}.{name}: {p.name}"
    required = [p for p in params.values() if p.default is inspect.Parameter.empty and p.name != "self"]
    assert {p.name for p in required} <= set(want.parameters), f"{impl.__name__}.{name}{got} needs more"


def test_the_protocol_names_what_the_controller_calls():
    assert {"train_step", "evaluation_model", "onload", "offload", "state_dict", "load_state_dict"} <= set(
        protocol_methods()
    )
    assert "observe" in inspect.signature(TrainEngine.train_step).parameters
    assert "residency" in TrainEngine.__annotations__


def test_torch_engine_conforms_and_answers_every_call(tmp_path: Path):
    from mopd_hpc.engines.torch.engine import TorchTrainEngine

    path = save_micro_qwen3(tmp_path / "m", seed=1)
    engine = TorchTrainEngine.from_pretrained(
        path, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-3), loss=LossConfig()
    )
    assert isinstance(engine, TrainEngine)
    for name, want in protocol_methods().items():
        assert_accepts(TorchTrainEngine, name, want)
    assert engine.residency.on_device is True
    tokens = TokenBatch.from_rows([[1, 2, 3, 4]], [2], pad_id=0)
    seen = []
    batch = TrainBatch.create(
        tokens,
        torch.full((1, 2), -1.0),
        targets=TeacherTargets(torch.full((1, 2), -0.5), torch.ones((1, 2))),
    )
    stats = engine.train_step(batch, observe=lambda lp: seen.append(tuple(lp.shape)) or {"x": 1.0})
    assert seen == [(1, 2)] and stats["x"] == 1.0 and stats["tokens"] == 2.0
    assert engine.evaluation_model() is engine.model
    assert engine.onload().action == "onload"


def test_megatron_engine_conforms_by_its_class():
    pytest.importorskip("megatron.core")
    from mopd_hpc.engines.megatron.engine import MegatronTrainEngine

    for name, want in protocol_methods().items():
        assert callable(getattr(MegatronTrainEngine, name, None)), name
        assert_accepts(MegatronTrainEngine, name, want)
    init = inspect.getsource(MegatronTrainEngine.__init__)
    for member in DATA_MEMBERS:
        assert f"self.{member} = " in init, member
