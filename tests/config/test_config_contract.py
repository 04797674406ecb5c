"""The config contract (issue 19): if `mopd-submit --check` passes, the job's roles can run the config.

Over the axes that interact, every point is either refused by `--check` (exit 2, every refusal naming a field
the point sets) or runs:

- loss axes, estimator × correction × RL term (none, loss-level c_rl, advantage-level α) × composition (with
  or without distillation) × KL × actor engine: `--check` in-process (`cli.submit.check`), then one train step
  the way the actor role takes it (`check_actor_engine`, `build_train_engine`, the trainer's `ShardStep` with
  in-process teacher clients over `TorchScoringEngine`s) on micro Qwen3 models; the step's loss, gradient norm
  and parameter change must be finite and real. Megatron points that pass need CUDA: skipped here (marked gpu);
  the one-GPU megatron path runs through the roles in tests/e2e/test_gpu_job.py on the H200.
- shape axes, trainer slots × TP × colocated/separated × rollout backend × weight sync: the refusals through
  `--check` (GPU shapes too: `--check` needs no GPU), and two full local runs (`mopd-submit --local`, 2 steps
  on the micro models) for the CPU shapes that pass. sglang is refused by `--check` (no role runs it), so it
  needs no stand-in engine here.

Time on 2 CPU cores: the whole file 83 s (the two local runs 39 s and 31 s, the 144 loss points and the shape
refusals the rest); up to ~4 min while other jobs share the cores.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from helpers_configs import NO_SFT_WARMUP, set_dotted, uniform_mixture, without_sft_warmup
from helpers_jobs import submit_local
from helpers_models import save_micro_qwen3

from mopd_hpc.cli import submit
from mopd_hpc.config import load_run_config
from mopd_hpc.config.refusals import embedded_table, refusals_table
from mopd_hpc.data.tokenizer import VOCAB_SIZE, build_char_tokenizer, save_char_tokenizer
from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.frames import codec as wire
from mopd_hpc.engines.teacher.client import ScoreResponse
from mopd_hpc.engines.teacher.score_frames import ScoreTensors, score_answer
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.roles.actor import build_reference, build_train_engine, check_actor_engine
from mopd_hpc.roles.env import RoleEnv
from mopd_hpc.runtime.child_device import ChildDevice
from mopd_hpc.trainer.group import SoloGroup
from mopd_hpc.trainer.rank_step import ShardStep
from mopd_hpc.trainer.step import orm_advantages
from mopd_hpc.trainer.step_record import ControlRecord

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local_cpu.yaml"
VOCAB = VOCAB_SIZE  # the tiny models' character tokenizer's (config.json must hold its ids)
#: Every loss point: two samples per prompt (GRPO's group needs them), k below the micro vocabulary, no warmup
#: (the first step's lr is not 0), no SFT warm-up (the point's loss from step 1; refused without distillation).
BASE = ["data.samples_per_prompt=2", "loss.topk=8", "models.actor.optimizer.warmup_ratio=0", NO_SFT_WARMUP]
#: A one-GPU trainer group for the megatron actor (its constant lr; the ipc weight sync: the rollout shares
#: its GPU, where the torch broadcast cannot join both).
MEGATRON = [
    "cluster.group.gpus_per_node=1", "models.actor.engine=megatron", "weight_sync.backend=ipc",
    "models.actor.optimizer.schedule=constant", "models.actor.optimizer.warmup_ratio=0",
]  # fmt: skip


def run_check(overrides: list[str], config: Path = LOCAL) -> tuple[int, list[str]]:
    """`mopd-submit --check` in-process: its exit status and the fields its refusals name (stderr's
    `  - <field>: ...` lines, for a config error and for what the roles do not run alike)."""
    out, err = io.StringIO(), io.StringIO()
    rc = submit.check(str(config), overrides, False, out, err)
    fields = [line[4:].split(":")[0] for line in err.getvalue().splitlines() if line.startswith("  - ")]
    assert (rc == 0) == (not fields), err.getvalue()
    return rc, fields


# --------------------------------------------------------------------------------------------- loss axes


@dataclass(frozen=True)
class LossPoint:
    estimator: str  # sampled | topk
    correction: str  # truncate | mask | none
    rl: str  # none | loss (c_rl > 0) | advantage (orm_alpha > 0)
    distill: bool  # c_d > 0
    kl: bool  # kl_coefficient > 0
    engine: str  # torch | megatron

    def settings(self) -> dict[str, object]:
        return {
            "loss.estimator": self.estimator,
            "loss.correction": self.correction,
            "loss.distillation_coefficient": 1.0 if self.distill else 0.0,
            "loss.rl_coefficient": 0.5 if self.rl == "loss" else 0.0,
            "loss.orm_alpha": 0.5 if self.rl == "advantage" else 0.0,
            "loss.kl_coefficient": 0.1 if self.kl else 0.0,
        }

    def overrides(self) -> list[str]:
        shape = MEGATRON if self.engine == "megatron" else []
        return [*BASE, *shape, *(f"{k}={v}" for k, v in self.settings().items())]

    def fields(self) -> set[str]:
        """The fields a refusal of this point may name: the loss fields it sets, and the actor engine."""
        return {*self.settings(), "models.actor.engine"}

    @property
    def id(self) -> str:
        rl = {"none": "no-rl", "loss": "c_rl", "advantage": "alpha"}[self.rl]
        distill = "distill" if self.distill else "no-distill"
        return f"{self.engine}-{self.estimator}-{self.correction}-{rl}-{distill}{'-kl' if self.kl else ''}"


LOSS_POINTS = [
    LossPoint(*p)
    for p in itertools.product(
        ("sampled", "topk"),
        ("truncate", "mask", "none"),
        ("none", "loss", "advantage"),
        (True, False),
        (False, True),
        ("torch", "megatron"),
    )
]


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("contract")
    out = {}
    for name, seed in (("student", 0), ("chain", 1), ("legs", 2)):
        out[name] = save_micro_qwen3(root / name, seed, vocab_size=VOCAB, initializer_range=0.2)
        save_char_tokenizer(build_char_tokenizer(), out[name])  # --check opens the tokenizer a child reads
    return out


@pytest.fixture(scope="module")
def scorers(micro: dict[str, Path]) -> dict[str, TorchScoringEngine]:
    return {t: TorchScoringEngine.from_pretrained(micro[t], dtype="float32") for t in ("chain", "legs")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class InProcessTeacher:
    """A teacher client (`TeacherClient.score`'s answer) over a `TorchScoringEngine`, without the server."""

    def __init__(self, engine: TorchScoringEngine) -> None:
        self.engine = engine

    async def score(self, input_ids, response_start, top_k=None) -> ScoreResponse:
        batch = TokenBatch.from_rows(input_ids, response_start, pad_id=0)
        logprobs, top = self.engine.score(batch, top_k)
        lengths = batch.response_lengths.tolist()
        lps = [logprobs[b, :n].tolist() for b, n in enumerate(lengths)]
        ids = None if top is None else [top.indices[b, :n].tolist() for b, n in enumerate(lengths)]
        vals = None if top is None else [top.logprobs[b, :n].float().tolist() for b, n in enumerate(lengths)]
        return ScoreResponse(lps, ids, vals, "0", "in-process")

    async def score_tensors(self, input_ids, response_start, top_k=None) -> ScoreTensors:
        """The binary transport's answer, through the server's own frame layout and decoder."""
        batch = TokenBatch.from_rows(input_ids, response_start, pad_id=0)
        logprobs, top = self.engine.score(batch, top_k)
        ids, vals = (None, None) if top is None else (top.indices, top.logprobs)
        identity = {"teacher_id": "t", "weight_version": "0", "fingerprint": "in-process"}
        frame = score_answer(batch.response_lengths, logprobs, ids, vals, identity, self.engine.vocab_size)
        return ScoreTensors.from_frame(wire.decode(frame.encode()))


def step_record(engine, samples_per_prompt: int, plan: ExecutionPlan) -> ControlRecord:
    """A rollout of the student itself (seeded): 4 prompts × samples_per_prompt rows, routes chain/legs, μ =
    π_θ perturbed (so the ratio corrections act), rewards 0/1, A_ORM when the plan reads rewards."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    rows, starts, routes = [], [], []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            for _ in range(samples_per_prompt):
                ids = list(prompt)
                for _ in range(3 + i % 2):
                    probs = torch.softmax(engine.model(torch.tensor([ids])).logits[0, -1].float(), -1)
                    ids.append(int(torch.multinomial(probs, 1, generator=gen)))
                rows.append(ids)
                starts.append(len(prompt))
                routes.append(("chain", "legs")[i % 2])
    tokens = TokenBatch.from_rows(rows, starts, pad_id=0)
    mu = engine.logprobs(tokens) + 0.3 * torch.randn(tokens.response_ids.shape, generator=gen)
    mu = torch.where(tokens.response_mask, mu.clamp(max=0.0), 0.0)
    rewards = torch.tensor([float((b * 7) % 3 == 0) for b in range(len(rows))])
    return ControlRecord.from_rows(
        1, rows, starts, routes, mu, orm_advantages(rewards, plan, samples_per_prompt), pad_id=0
    )


def actor_role(tmp_path: Path) -> RoleEnv:
    return RoleEnv.from_env(
        {
            "MOPD_RUN_DIR": str(tmp_path), "MOPD_ROLE": "actor", "MOPD_INDEX": "0", "MOPD_JOB_ID": "local-1",
            "MOPD_BACKEND": "local", "MOPD_HOST": "localhost", "MOPD_WORLD_SIZE": "1", "MOPD_PORT_MASTER": "1",
        }
    )  # fmt: skip


@pytest.mark.parametrize(
    "point",
    [
        pytest.param(p, marks=[pytest.mark.gpu] if p.engine == "megatron" else [], id=p.id)
        for p in LOSS_POINTS
    ],
)
def test_loss_point_is_refused_naming_its_field_or_trains(
    point: LossPoint, micro: dict[str, Path], scorers: dict[str, TorchScoringEngine], tmp_path: Path
) -> None:
    paths = [f"models.actor.path={micro['student']}", f"models.tokenizer.path={micro['student']}"]
    rc, fields = run_check([*point.overrides(), *paths])
    if rc:
        assert set(fields) <= point.fields(), (point, fields)
        return
    if point.engine == "megatron":
        pytest.skip(
            "gpu: the megatron engine needs CUDA; its one-GPU path runs in tests/e2e/test_gpu_job.py (H200)"
        )
    cfg = load_run_config(LOCAL, [*point.overrides(), *paths])
    role = actor_role(tmp_path)
    kind = check_actor_engine(cfg, role, {})
    engine = build_train_engine(cfg, kind, ChildDevice())
    plan = ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids)
    teachers = {t: InProcessTeacher(scorers[t]) for t in plan.teachers}
    weights = {r: dict(w) for r, w in cfg.routes.items()}
    reference = build_reference(cfg, kind, engine) if plan.requires_reference else None
    step = ShardStep(engine, teachers, plan, cfg.loss, weights, SoloGroup(), reference)
    before = [p.detach().clone() for p in engine.model.parameters()]
    outcome = asyncio.run(step.run(step_record(engine, cfg.data.samples_per_prompt, plan)))
    stats = outcome.stats
    assert math.isfinite(stats["loss"]) and stats["step_skipped"] == 0.0, stats
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0, stats
    moved = max(
        float((p.detach() - b).abs().max()) for p, b in zip(engine.model.parameters(), before, strict=True)
    )
    assert 0 < moved < 1, moved


# -------------------------------------------------------------------------------------------- shape axes

#: (id, config, overrides, the field --check must name). GPU shapes are refused without a GPU: --check reads
#: the declarations, not the machine.
SHAPE_REFUSALS = [
    ("cpu-tp2", LOCAL, ["models.actor.tensor_parallel=2"], "models.actor.tensor_parallel"),
    ("cpu-sglang", LOCAL, ["rollout.backend=sglang"], "rollout.backend"),
    ("cpu-awex", LOCAL, ["weight_sync.backend=awex"], "weight_sync.backend"),
    ("cpu-hf-tp2", LOCAL, ["rollout.engines.tensor_parallel=2"], "rollout.engines.tensor_parallel"),
    ("gpu-torch-dp2", LOCAL, ["cluster.group.gpus_per_node=2"], "models.actor.engine"),
    ("gpu-torch-tp2", LOCAL, ["cluster.group.gpus_per_node=2", "models.actor.tensor_parallel=2"],
     "models.actor.tensor_parallel"),
    ("gpu-hf-tp2-separated", LOCAL, ["cluster.group.gpus_per_node=3", "rollout.mode=separated",
     "rollout.engines.tensor_parallel=2"], "rollout.engines.tensor_parallel"),
    ("gpu-megatron-tp2", LOCAL, [*MEGATRON, "loss.estimator=sampled", "cluster.group.gpus_per_node=2",
     "models.actor.tensor_parallel=2"], "models.actor.tensor_parallel"),
    ("gpu-megatron-dp2", LOCAL, [*MEGATRON, "loss.estimator=sampled", "cluster.group.gpus_per_node=2"],
     "models.actor.engine"),
    ("gpu-teacher-tp2", LOCAL, ["cluster.group.gpus_per_node=2", "models.teachers.0.tensor_parallel=2"],
     "models.teachers[0].tensor_parallel"),
    ("gpu-awex-sglang", REPO / "configs" / "local_gpu_colocated_awex.yaml", ["rollout.backend=sglang"],
     "weight_sync.backend"),
    # NCCL refuses two ranks of one communicator on one GPU: the colocated broadcast never joins
    ("gpu-torch-broadcast-colocated", LOCAL, ["cluster.group.gpus_per_node=1"], "weight_sync.backend"),
    ("ipc-separated", LOCAL, ["weight_sync.backend=ipc", "rollout.mode=separated"], "weight_sync.backend"),
    ("ipc-two-nodes", LOCAL, ["weight_sync.backend=ipc", "cluster.group.nodes=2"], "cluster.group.nodes"),
]  # fmt: skip

#: CPU-free shapes that pass --check: where they run (skipped here: no CUDA).
GPU_RUNS = [
    ("gpu-megatron-sglang-ipc", REPO / "configs" / "local_gpu_colocated.yaml", [],
     "runs in benchmarks/gpu_step_roles.py (5 steps, H100) and tests/e2e/test_gpu_job.py[local_gpu_colocated]"),
    ("gpu-megatron-awex-colocate", REPO / "configs" / "local_gpu_colocated_awex.yaml", [],
     "runs in tests/e2e/test_gpu_job.py[local_gpu_colocated_awex-1] on the H200"),
    ("gpu-megatron-awex-separate", REPO / "configs" / "local_gpu_separated.yaml", [],
     "runs in tests/e2e/test_gpu_job.py[local_gpu_separated-2] on two H200s"),
    ("gpu-torch-1", LOCAL, ["cluster.group.gpus_per_node=1", "weight_sync.backend=ipc"],
     "the torch train step ran on CUDA in tests/engines/test_microbatch_gpu.py (H200), the ipc sync through CUDA IPC in "
     "tests/engines/test_weight_sync_ipc.py[cuda]; no whole job on one GPU yet"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "overrides", "field"), [p[1:] for p in SHAPE_REFUSALS],
                         ids=[p[0] for p in SHAPE_REFUSALS])  # fmt: skip
def test_shape_is_refused_by_check_naming_the_field(config: Path, overrides: list[str], field: str) -> None:
    rc, fields = run_check(overrides, config)
    assert rc == 2 and field in fields, fields


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("config", "overrides", "where"), [p[1:] for p in GPU_RUNS], ids=[p[0] for p in GPU_RUNS]
)
def test_gpu_shape_passes_check_and_runs_on_gpus(config: Path, overrides: list[str], where: str) -> None:
    assert run_check(overrides, config) == (0, [])
    pytest.skip(f"gpu: {where}")


#: CPU shapes that pass --check, each with a different estimator / RL term than the other (the loss axes are
#: above): one trainer rank with the rollout colocated; two data-parallel CPU ranks with it separated.
LOCAL_RUNS = [
    ("colocated-1rank-sampled-c_rl", {"loss.estimator": "sampled", "loss.rl_coefficient": 0.5,
                                      "data.samples_per_prompt": 2}),
    ("separated-2ranks-topk", {"rollout.mode": "separated", "cluster.group.actor_ranks_per_node": 2,
                               "data.batch_size": 4}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("changes", [c for _, c in LOCAL_RUNS], ids=[i for i, _ in LOCAL_RUNS])
def test_cpu_shape_that_passes_check_runs_locally(micro_models: Path, tmp_path: Path, changes: dict) -> None:
    # both steps on-policy (loss/rl below), on the uniform batch these shapes were derived with
    doc = uniform_mixture(without_sft_warmup(yaml.safe_load(LOCAL.read_text())))
    doc["run_dir"] = str(tmp_path / "run")
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(micro_models / "student")
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(micro_models / name)
    doc.update(steps=2, checkpoint_interval=2)
    doc["data"].update(batch_size=4)
    doc["data"]["eval"]["size"] = 4
    set_dotted(doc, changes)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(doc))
    assert run_check([], config) == (0, [])
    proc = submit_local(config, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [yaml.safe_load(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["loss/total"]) and math.isfinite(line["loss/rl"]) for line in lines), lines
    if changes.get("loss.rl_coefficient"):
        assert any(line["loss/rl"] != 0 for line in lines), lines


# ------------------------------------------------------------------------------- what the loss axes meet


def test_the_loss_axes_meet_the_declared_refusals() -> None:
    """A few points by name: the refusal the declarations give each (config/capabilities.py), and points
    that must pass (the contract above would hold vacuously if --check refused everything)."""

    def fields(**kw: object) -> list[str]:
        point = LossPoint(**{"estimator": "sampled", "correction": "truncate", "rl": "none", "distill": True,
                             "kl": False, "engine": "torch"} | kw)  # fmt: skip
        return run_check(point.overrides())[1]

    topk = {"estimator": "topk", "correction": "none"}
    assert fields() == [] and fields(**topk, rl="loss") == [] and fields(rl="advantage") == []
    assert fields(rl="loss", kl=True) == []  # both engines score a reference model (engines/reference.py)
    assert fields(estimator="topk") == ["loss.correction"]  # a per-token ratio corrects nothing with topk
    assert fields(**topk, rl="advantage") == ["loss.orm_alpha"]
    assert fields(kl=True) == ["loss.kl_coefficient"]  # a config error: the KL penalty lives in L_RL
    assert fields(distill=False) == ["loss.distillation_coefficient"]  # nothing to train
    assert fields(engine="megatron") == [] and fields(engine="megatron", **topk) == []
    assert fields(engine="megatron", rl="loss") == [] and fields(engine="megatron", rl="loss", kl=True) == []
    ran = sum(1 for p in LOSS_POINTS if p.engine == "torch" and run_check(p.overrides())[0] == 0)
    assert ran >= 12, ran  # 21 today: 9 sampled with distillation, 6 topk, 6 c_rl alone


@pytest.mark.parametrize("doc", ["README.md", "docs/en/mopd.md", "docs/zh/mopd.md"])
def test_docs_hold_the_refusals_table_of_the_declarations(doc: str) -> None:
    assert embedded_table((REPO / doc).read_text(encoding="utf-8")) == refusals_table(), (
        f"{doc}: regenerate the table with `python -m mopd_hpc.config.refusals`"
    )


def test_the_roles_recheck_the_same_declarations_at_start(tmp_path: Path) -> None:
    """A config edited after submit (loaded, so valid, but refused by --check) stops the child before it
    waits for servers, with the refusal --check gives."""
    from mopd_hpc.config.job_gaps import job_gaps
    from mopd_hpc.roles.env import RoleEnvError
    from mopd_hpc.roles.rollout import server_args

    # a megatron actor on a GPU group passes --check; a child that sees no GPU refuses it by the same
    # declaration (the megatron engine trains on GPU only), before it waits for any server
    gpu = load_run_config(LOCAL, [*MEGATRON, "loss.estimator=sampled"])
    assert job_gaps(gpu) == []
    with pytest.raises(RoleEnvError, match=r"^models\.actor\.engine: the megatron engine trains on GPU only"):
        check_actor_engine(gpu, actor_role(tmp_path), {})
    wide = load_run_config(LOCAL, ["cluster.group.gpus_per_node=2", "rollout.engines.tensor_parallel=2"])
    assert [g.path for g in job_gaps(wide)] == [
        "models.actor.engine",
        "rollout.engines.tensor_parallel",
        "weight_sync.backend",  # the torch broadcast does not join two ranks on one GPU
    ]
    with pytest.raises(
        RoleEnvError, match=r"^rollout\.engines\.tensor_parallel: a hf rollout engine runs on one"
    ):
        server_args(actor_role(tmp_path), wide, {})
