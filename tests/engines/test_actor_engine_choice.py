"""Which train engine the actor role builds (issue 8): torch, or megatron at tensor_parallel 1 on one process
(`actor_main.check_actor_engine`), with the errors that name the field; the AWEX variables `main` sets at the
edge; the job's gaps for the megatron actor and AWEX; `evaluation_model()` of both engines (the megatron one
builds a transformers model from the HF weights); and `MegatronTrainEngine.train_step(batch, observe)`
through a stand-in for GPTModel's call surface and megatron's DDP/optimizer (the real ones need CUDA:
tests/engines/test_megatron_convert.py, tests/engines/test_awex_hf_gpu.py on the H200).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from helpers_configs import set_dotted
from helpers_models import save_micro_qwen3

from mopd_hpc.config import LossConfig, RunConfig
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.micro_batch import MicroBatching
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.roles import actor as actor_main
from mopd_hpc.roles.actor import awex_environment, check_actor_engine
from mopd_hpc.roles.env import RoleEnv, RoleEnvError

REPO = Path(__file__).resolve().parents[2]
VOCAB = 40
ROWS = [[1, 2, 3, 11, 12, 13], [4, 5, 15], [6, 7, 8, 9, 16, 17, 18, 19]]
STARTS = [3, 2, 4]


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_micro_qwen3(tmp_path_factory.mktemp("actor") / "student", seed=5, vocab_size=VOCAB)


def config_dict(student: Path, **changes: Any) -> dict[str, Any]:
    """configs/qwen3_8gpu_colocated.yaml cut to one GPU: megatron actor TP 1 on `student`, one HF rollout
    engine, AWEX colocate; `changes` are dotted keys."""
    data = yaml.safe_load((REPO / "configs" / "qwen3_8gpu_colocated.yaml").read_text())
    data["models"]["actor"].update(tensor_parallel=1, path=str(student))
    data["models"]["tokenizer"]["path"] = str(student)
    data["models"]["teachers"][0].update(tensor_parallel=1, path=str(student))
    data["rollout"].update(backend="hf", engines={"count": 1, "tensor_parallel": 1})
    data["cluster"]["group"]["gpus_per_node"] = 1
    set_dotted(data, changes)
    return data


def config(student: Path, **changes: Any) -> RunConfig:
    return RunConfig.from_dict(config_dict(student, **changes))


def role(
    tmp_path: Path,
    world_size: int = 1,
    backend: str = "local",
    host: str = "localhost",
    environ: dict[str, str] | None = None,
) -> RoleEnv:
    """The actor's RoleEnv; `environ` adds the child's device variables (CUDA_VISIBLE_DEVICES, ...)."""
    return RoleEnv.from_env(
        (environ or {})
        | {
            "MOPD_RUN_DIR": str(tmp_path),
            "MOPD_ROLE": "actor",
            "MOPD_INDEX": "0",
            "MOPD_JOB_ID": "local-1",
            "MOPD_BACKEND": backend,
            "MOPD_HOST": host,
            "MOPD_WORLD_SIZE": str(world_size),
            "MOPD_PORT_MASTER": "45679",
        }
    )


# --- check_actor_engine -----------------------------------------------------------------------------------


def test_megatron_actor_on_one_gpu_is_chosen(student: Path, tmp_path: Path) -> None:
    gpu = {"CUDA_VISIBLE_DEVICES": "0"}
    assert check_actor_engine(config(student), role(tmp_path, environ=gpu), gpu) == "megatron"
    torch_cfg = RunConfig.from_dict(yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()))
    assert check_actor_engine(torch_cfg, role(tmp_path), {}) == "torch"


def test_megatron_actor_without_a_gpu_names_the_engine_field(student: Path, tmp_path: Path) -> None:
    for environ in ({}, {"CUDA_VISIBLE_DEVICES": ""}):
        with pytest.raises(RoleEnvError) as info:
            check_actor_engine(config(student), role(tmp_path, environ=environ), environ)
        assert str(info.value) == (
            "models.actor.engine: the megatron engine trains on GPU only; the actor's device is a CPU (got "
            "'megatron'; a GPU group (cluster.<group>.gpus_per_node), or engine: torch) (this child: "
            f"MOPD_WORLD_SIZE 1, CUDA_VISIBLE_DEVICES {environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )


def test_megatron_actor_beyond_one_process_names_tensor_parallel(student: Path, tmp_path: Path) -> None:
    gpu = {"CUDA_VISIBLE_DEVICES": "0,1"}
    two = config(
        student,
        **{"models.actor.tensor_parallel": 2, "cluster.group.gpus_per_node": 2},
        **{"weight_sync.backend": "torch", "weight_sync.awex_mode": None},
    )
    with pytest.raises(
        RoleEnvError,
        match=r"^models.actor.tensor_parallel: .*megatron engine at tensor_parallel ≤ 1 .*expected ≤ 1",
    ):
        check_actor_engine(two, role(tmp_path, environ=gpu), gpu)
    with pytest.raises(
        RoleEnvError,
        match=r"^models.actor.engine: .*megatron engine at data-parallel size ≤ 1 on GPUs: .* 2 tr",
    ):
        check_actor_engine(config(student), role(tmp_path, world_size=2, environ=gpu), gpu)
    torch_cfg = RunConfig.from_dict(yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()))
    # torch DP > 1 runs on CPU (the actor group, issue 16); on GPUs it stays refused until it has run there
    assert check_actor_engine(torch_cfg, role(tmp_path, world_size=2), {}) == "torch"
    with pytest.raises(
        RoleEnvError, match=r"^models.actor.engine: .*torch engine at data-parallel size ≤ 1 on GPUs"
    ):
        check_actor_engine(torch_cfg, role(tmp_path, world_size=2), gpu)


# --- the AWEX environment (set by main, at the edge) ------------------------------------------------------


def test_awex_environment_from_the_master_address(student: Path, tmp_path: Path) -> None:
    assert awex_environment(role(tmp_path), config(student)) == {
        "AWEX_MASTER_ADDR": "127.0.0.1",
        "DEVICE": "0",
    }
    on_cluster = role(tmp_path, backend="slurm", host="localhost")  # the node's address: gethostbyname(host)
    assert awex_environment(on_cluster, config(student))["AWEX_MASTER_ADDR"] == "127.0.0.1"
    assert awex_environment(role(tmp_path), config(student, **{"weight_sync.backend": "torch",
                                                                  "weight_sync.awex_mode": None})) == {}  # fmt: skip


def run_main(
    tmp_path: Path, data: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, dict[str, str]]:
    """actor_main.main with a guard's environment; run_actor replaced by a probe of os.environ."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    for key, value in {
        "MOPD_RUN_DIR": str(tmp_path), "MOPD_ROLE": "actor", "MOPD_INDEX": "0", "MOPD_JOB_ID": "local-1",
        "MOPD_BACKEND": "local", "MOPD_HOST": "localhost", "MOPD_PORT_MASTER": "45679",
        "MOPD_ACTOR_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0",
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    for key in ("AWEX_MASTER_ADDR", "DEVICE"):  # recorded, so that what main sets is undone after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    seen: dict[str, str] = {}

    async def probe(role: RoleEnv, cfg: RunConfig, environ: dict[str, str], out: Any) -> int:
        seen.update({k: os.environ[k] for k in ("AWEX_MASTER_ADDR", "DEVICE") if k in os.environ})
        assert {k: environ.get(k) for k in seen} == seen  # the edge's copy agrees
        return 0

    monkeypatch.setattr(actor_main, "run_actor", probe)
    before = torch.get_num_threads()
    try:
        return actor_main.main([]), seen
    finally:
        torch.set_num_threads(before)


def test_main_sets_the_awex_variables_before_the_actor_runs(
    student: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rc, seen = run_main(tmp_path, config_dict(student), monkeypatch)
    assert (rc, seen) == (0, {"AWEX_MASTER_ADDR": "127.0.0.1", "DEVICE": "0"})


def test_main_refuses_an_architecture_awex_does_not_register(
    student: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    rc, seen = run_main(tmp_path, config_dict(student, **{"models.actor.path": str(other)}), monkeypatch)
    assert (rc, seen) == (actor_main.EXIT_CONFIG, {})
    err = capsys.readouterr().err
    assert "actor: weight_sync.backend 'awex': models.actor.path architecture 'LlamaForCausalLM' is not " \
        "registered in awex 0.9.0" in err  # fmt: skip
    assert "AWEX_MASTER_ADDR" not in os.environ


# --- job_gaps ---------------------------------------------------------------------------------------------


def gaps(cfg: Any) -> list[str]:
    return [g.render() for g in job_gaps(cfg)]


def test_one_gpu_megatron_awex_colocate_job_has_no_gap(student: Path) -> None:
    assert gaps(config(student)) == []
    assert gaps(config(student, **{"weight_sync.backend": "ipc", "weight_sync.awex_mode": None})) == []
    # the torch broadcast cannot join the actor and the rollout engine on one GPU (NCCL)
    (gap,) = job_gaps(config(student, **{"weight_sync.backend": "torch", "weight_sync.awex_mode": None}))
    assert gap.path == "weight_sync.backend" and "weight_sync.backend: ipc / awex" in gap.render()


def test_megatron_actor_at_tp2_is_a_gap(student: Path) -> None:
    cfg = config(
        student,
        **{"models.actor.tensor_parallel": 2, "cluster.group.gpus_per_node": 2},
        **{"weight_sync.backend": "ipc", "weight_sync.awex_mode": None},
    )
    (gap,) = job_gaps(cfg)
    way = "expected ≤ 1, or allow_unverified: true (--allow-unverified) to run it unverified"
    assert (gap.path, gap.got, gap.expected) == ("models.actor.tensor_parallel", 2, way)


def test_awex_separate_mode_has_no_gap_torch_actor_and_sglang_are_gaps(student: Path) -> None:
    separate = config(
        student,
        **{"rollout.mode": "separated", "weight_sync.awex_mode": None, "cluster.group.gpus_per_node": 2},
    )
    assert gaps(separate) == []  # ran on two H200s: tests/e2e/test_gpu_job.py[local_gpu_separated-2]
    base = config(student)
    # the config rules refuse a torch actor with awex already; model_copy reaches job_gaps' own check
    torch_actor = base.model_copy(
        update={
            "models": base.models.model_copy(
                update={"actor": base.models.actor.model_copy(update={"engine": "torch"})}
            )
        }
    )
    assert gaps(torch_actor) == [
        "weight_sync.backend: the awex writer needs the megatron actor; models.actor.engine is 'torch' (got "
        "'awex'; models.actor.engine: megatron, or weight_sync.backend: ipc)"  # torch: not on one GPU
    ]
    sglang = base.model_copy(update={"rollout": base.rollout.model_copy(update={"backend": "sglang"})})
    # the rollout role runs sglang (roles/rollout_sglang.py), but the job's AWEX reader is the hf server's
    assert {g.path for g in job_gaps(sglang)} == {"weight_sync.backend"}
    assert (
        "the job's awex reader runs in the hf rollout server only; rollout.backend is 'sglang'"
        in " ".join(gaps(sglang))
    )


# --- evaluation_model ---------------------------------------------------------------------------------------


def test_torch_engine_evaluates_its_own_model(student: Path) -> None:
    engine = TorchTrainEngine.from_pretrained(
        student, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-3), loss=LossConfig()
    )
    assert engine.evaluation_model() is engine.model


@pytest.fixture(scope="module")
def megatron_engine():
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.megatron import engine

    return engine


def test_megatron_evaluation_model_is_built_from_the_hf_weights(megatron_engine, student: Path) -> None:
    reference = TorchScoringEngine.from_pretrained(student, dtype="float32", device="cpu").model
    hf_config = json.loads((student / "config.json").read_text())
    weights = {k: v.clone() for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied
    actor = object.__new__(megatron_engine.MegatronTrainEngine)  # no DDP/optimizer: those need CUDA
    actor.hf_config, actor.device, actor.dtype = hf_config, torch.device("cpu"), "float32"
    actor.named_weights = lambda: iter(weights.items())
    first, second = actor.evaluation_model(), actor.evaluation_model()
    assert first is not second and not first.training  # a fresh model per call
    ids = torch.tensor([ROWS[2]])
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        for model in (first, second):
            assert torch.equal(model(input_ids=ids).logits, want)
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
            assert all(not p.requires_grad for p in model.parameters())
    from mopd_hpc.engines.megatron.hf_model import hf_model_from_weights

    missing = dict(weights)
    missing.pop("model.norm.weight")
    with pytest.raises(EngineError, match=r"missing \['model.norm.weight'\], unexpected \[\]"):
        hf_model_from_weights(hf_config, iter(missing.items()), torch.device("cpu"), torch.float32)


# --- MegatronTrainEngine.train_step(batch, observe) ---------------------------------------------------------


class StandInGPT(torch.nn.Module):
    """GPTModel's labels path over an HF causal LM: `model(ids, positions, None, labels=...)` → [B, L]
    −log π(label)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: None, labels: torch.Tensor
    ) -> torch.Tensor:
        logp = torch.log_softmax(self.hf(input_ids=ids).logits.float(), -1)
        return -logp.gather(-1, labels[..., None]).squeeze(-1)


def stand_in_actor(megatron_engine: Any, student: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A MegatronTrainEngine whose DDP wrapper, optimizer and grad sync are stand-ins (CPU)."""
    import megatron.core.distributed as mcore_distributed

    monkeypatch.setattr(mcore_distributed, "finalize_model_grads", lambda models: None)
    hf = TorchScoringEngine.from_pretrained(student, dtype="float32", device="cpu").model.requires_grad_(True)
    actor = object.__new__(megatron_engine.MegatronTrainEngine)
    actor.device, actor.loss_config, actor.steps = torch.device("cpu"), LossConfig(), 0
    actor.ddp = SimpleNamespace(
        train=lambda: None, zero_grad_buffer=lambda: None, no_sync=contextlib.nullcontext
    )
    actor.micro_batching = MicroBatching()
    actor.optimizer = SimpleNamespace(
        zero_grad=lambda: None, step=lambda: (True, 0.5, None), param_groups=[{"lr": 1e-5}]
    )
    actor.scheduler = SimpleNamespace(step=lambda increment: None)  # megatron's lr scheduler: nothing to set
    actor.forward = megatron_engine.MegatronForward(StandInGPT(hf), actor.device)
    actor.residency = SimpleNamespace(on_device=True)
    actor.data_parallel = DataParallel.single()
    return actor


def batch() -> TrainBatch:
    tokens = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    shape = (tokens.batch_size, tokens.response_width)
    targets = TeacherTargets(torch.full(shape, -2.0), torch.ones(shape))
    return TrainBatch.create(tokens, torch.full(shape, -3.0), targets=targets)


def test_megatron_train_step_observes_its_own_logprobs(
    megatron_engine, student: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = stand_in_actor(megatron_engine, student, monkeypatch)
    seen: list[torch.Tensor] = []

    def observe(logprobs: torch.Tensor) -> dict[str, float]:
        seen.append(logprobs)
        return {"observed/mean": float(logprobs[b.tokens.response_mask].mean())}

    b = batch()
    stats = actor.train_step(b, observe=observe)
    (got,) = seen
    want = TorchScoringEngine.from_pretrained(student, dtype="float32", device="cpu").logprobs(b.tokens)
    assert got.dtype == torch.float32 and got.shape == want.shape and not got.requires_grad
    assert (got - want).abs().max().item() < 1e-5
    assert stats["observed/mean"] == pytest.approx(float(want[b.tokens.response_mask].mean()), abs=1e-5)
    assert (stats["grad_norm"], stats["step_skipped"], stats["lr"], actor.steps) == (0.5, 0.0, 1e-5, 1)
    plain = actor.train_step(b)
    assert "observed/mean" not in plain and set(stats) - set(plain) == {"observed/mean"}


# --- the controller makes the actor resident (AWEX colocate leaves it offloaded after each publish) -------


class OffloadedActor:
    """An engine whose residency starts offloaded; each use records whether it was resident (no
    `evaluation_model`: the controller must not ask for one)."""

    def __init__(self) -> None:
        self.residency = SimpleNamespace(on_device=False)
        self.uses: list[tuple[str, bool]] = []

    def onload(self) -> Any:
        self.uses.append(("onload", self.residency.on_device))
        self.residency.on_device = True
        return SimpleNamespace(message="moved 8 bytes")

    def state_dict(self) -> dict[str, Any]:
        self.uses.append(("state_dict", self.residency.on_device))
        return {"model": {"w": torch.zeros(2)}, "optimizer": {}, "steps": 2}

    def save_pretrained(self, directory: Path) -> None:
        self.uses.append(("save_pretrained", self.residency.on_device))

    def offload(self) -> None:  # what AWEX's publish does
        self.residency.on_device = False


def test_controller_onloads_before_checkpoint_and_save_and_evaluates_on_the_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluation uses no actor model (it generates on the rollout engines): it neither onloads the actor
    nor asks it for a model; checkpoint and save onload it first."""
    import io

    from mopd_hpc.trainer import controller as controller_module
    from mopd_hpc.trainer import evaluator as evaluator_module
    from mopd_hpc.trainer.evaluate import EngineEval
    from mopd_hpc.trainer.group import SoloGroup

    asked: list[Any] = []

    async def on_engines(clients, tokenizer, prompts, max_new_tokens, score):
        asked.append((clients, max_new_tokens))
        return EngineEval({"r": 0.5}, {"r": ("a",)}, ("2",))

    monkeypatch.setattr(evaluator_module.evaluate, "student_accuracy_on_engines", on_engines)
    ctrl = object.__new__(controller_module.Controller)  # only what these three phases read
    ctrl.engine, ctrl.run_dir, ctrl.job_id, ctrl.step = OffloadedActor(), tmp_path, "local-1", 2
    ctrl.out, ctrl.tokenizer, ctrl.group, ctrl.rollout = io.StringIO(), None, SoloGroup(), ["engine-0"]
    sampling = SimpleNamespace(max_new_tokens=4)
    ctrl.cfg = SimpleNamespace(
        name="one-gpu",
        rollout=SimpleNamespace(sampling=sampling),
        data=SimpleNamespace(eval=SimpleNamespace(samples=0, seed=0)),
    )
    ctrl.data = SimpleNamespace(dataset=SimpleNamespace(state_dict=lambda: {"position": 3}), eval_prompts={})
    evaluator = object.__new__(evaluator_module.RunEvaluator)  # the student's point: the engines, no actor
    evaluator.cfg, evaluator.data, evaluator.tokenizer = ctrl.cfg, SimpleNamespace(score=None), None
    evaluator.rollout, evaluator.prompts, evaluator.out = ctrl.rollout, {"r": []}, ctrl.out
    asyncio.run(ctrl._checkpoint(2))
    ctrl.engine.offload()
    point = asyncio.run(evaluator._student_point(2))
    assert (point["pass@1"], point["weight_version"]) == ({"r": 0.5}, "2")
    assert asked == [(["engine-0"], 4)] and ctrl.out.getvalue() == ""  # version "2" is step 2's: no remark
    assert asyncio.run(evaluator._student_point(3))["weight_version"] == "2"
    assert "weight_version '2', expected '3'" in ctrl.out.getvalue()
    asyncio.run(ctrl._finish())
    assert ctrl.engine.uses == [
        ("onload", False), ("state_dict", True),
        ("onload", False), ("save_pretrained", True),
    ]  # fmt: skip
    assert (tmp_path / "checkpoints" / "latest").exists()
    asyncio.run(ctrl._checkpoint(2))  # resident already: no onload
    assert ctrl.engine.uses[-1] == ("state_dict", True) and len(ctrl.engine.uses) == 5
