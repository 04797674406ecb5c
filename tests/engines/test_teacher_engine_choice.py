"""Which scoring engine the teacher role builds (issue 8): torch or megatron (tensor parallel 1), chosen from
`models.teachers[i]`; the errors that name the field (megatron without a GPU, tensor_parallel > 1); the
job's gaps for TP 1 vs TP 2; and `MegatronScoringEngine.score` (top-k of the vocab-parallel logits, padding
ids dropped) against `TorchScoringEngine` through a stand-in for GPTModel's call surface on the CPU, at TP 1
and at TP 2 in two gloo processes, each stand-in answering its own vocabulary shard (the real GPTModel needs
CUDA: tests/engines/test_megatron_teacher_gpu.py, tests/engines/test_megatron_teacher_tp_gpu.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import helpers_fork
import pytest
import torch
import yaml
from helpers_auth import TOKEN
from helpers_models import save_micro_qwen3

from mopd_hpc.config import RunConfig
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.teacher import process as teacher_main
from mopd_hpc.engines.teacher.process import TeacherArgs, build_engine, endpoint_path, pad_token_id, serve
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.roles.env import RoleEnv, RoleEnvError
from mopd_hpc.roles.teacher import args_from_argv, teacher_args

REPO = Path(__file__).resolve().parents[2]
#: The test folders on sys.path (pyproject's pythonpath), for children that import test modules.
TEST_DIRS = ":".join(p for p in sys.path if p.startswith(str(REPO / "tests")))
GPU_CONFIG = REPO / "configs" / "qwen3_8gpu_colocated.yaml"  # one megatron teacher, id "teacher", TP 8
VOCAB = 40
PAD_COLUMNS = 8  # megatron's padded vocabulary V' = V + 8 in the stand-in
ROWS = [[1, 2, 3, 11, 12, 13], [4, 5, 15], [6, 7, 8, 9, 16, 17, 18, 19]]
STARTS = [3, 2, 4]


def gpu_config(tensor_parallel: int, engine: str = "megatron") -> RunConfig:
    data = yaml.safe_load(GPU_CONFIG.read_text())
    data["models"]["teachers"][0].update(tensor_parallel=tensor_parallel, engine=engine)
    return RunConfig.from_dict(data)


def role(tmp_path: Path, environ: dict[str, str] | None = None) -> RoleEnv:
    """The teacher's RoleEnv; `environ` adds the child's device variables (CUDA_VISIBLE_DEVICES, ...)."""
    return RoleEnv.from_env(
        (environ or {})
        | {
            "MOPD_RUN_DIR": str(tmp_path),
            "MOPD_ROLE": "teacher",
            "MOPD_INDEX": "0",
            "MOPD_JOB_ID": "local-1",
            "MOPD_BACKEND": "local",
            "MOPD_PORT_HTTP": "45678",
        }
    )


# --- job_gaps -------------------------------------------------------------------------------------------


def teacher_gaps(cfg: RunConfig) -> list[str]:
    return [g.render() for g in job_gaps(cfg) if g.path.startswith("models.teachers")]


def test_megatron_teacher_at_tp1_is_no_gap() -> None:
    assert teacher_gaps(gpu_config(1)) == []
    assert teacher_gaps(gpu_config(1, engine="torch")) == []
    # the rest of the production config is still refused, field by field (the actor at TP 8, AWEX into SGLang)
    assert {g.path for g in job_gaps(gpu_config(1))} == {
        "models.actor.tensor_parallel",
        "weight_sync.backend",
    }


def test_teacher_at_tp2_is_a_gap_naming_the_field_value_and_1() -> None:
    gaps = [g for g in job_gaps(gpu_config(2)) if g.path.startswith("models.teachers")]
    assert len(gaps) == 1
    gap = gaps[0]
    way = "expected ≤ 1, or allow_unverified: true (--allow-unverified) to run it unverified"
    assert (gap.path, gap.got, gap.expected) == ("models.teachers[0].tensor_parallel", 2, way)
    assert gap.render() == (
        "models.teachers[0].tensor_parallel: the teacher role serves a megatron teacher at tensor_parallel ≤ 1: "
        "a replica of tensor_parallel 2 (a leader and 1 follower rank(s)) has not run with this engine yet: "
        f"tests/engines/test_megatron_teacher_tp_gpu.py (2 GPUs) has not run (got 2; {way})"
    )
    warnings = gpu_config(2).warnings()
    assert any(
        w.startswith("not run by the job's roles yet: models.teachers[0].tensor_parallel") for w in warnings
    )


# --- roles.teacher.teacher_args ----------------------------------------------------------------------------


def test_teacher_args_megatron_from_the_config(tmp_path: Path) -> None:
    cfg = gpu_config(1)
    environ = {
        "MOPD_TEACHER_ID": "teacher",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
        "MOPD_BASE_GPU_ID": "3",
    }
    args = teacher_args(role(tmp_path, environ), cfg, environ)
    teacher = cfg.models.teacher("teacher")
    assert (args.engine, args.tensor_parallel, args.device, args.dtype) == (
        "megatron",
        1,
        "cuda:3",
        teacher.dtype,
    )
    assert (args.model_path, args.port, args.source) == (teacher.path, 45678, "models.teachers[0]")
    assert args.field("engine") == "models.teachers[0].engine"
    assert args.num_threads is None  # a GPU child: torch's own thread count
    torch_cfg = gpu_config(1, engine="torch")
    assert teacher_args(role(tmp_path, environ), torch_cfg, environ).engine == "torch"


@pytest.mark.parametrize("visible", [None, ""])
def test_teacher_args_megatron_without_a_gpu_names_the_field(tmp_path: Path, visible: str | None) -> None:
    environ = {"MOPD_TEACHER_ID": "teacher"} | ({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})
    with pytest.raises(RoleEnvError) as err:
        teacher_args(role(tmp_path, environ), gpu_config(1), environ)
    text = str(err.value)
    assert text == (
        "models.teachers[0].engine: the megatron teacher engine scores on GPU only; the teacher's device is a "
        f"CPU (got 'megatron'; a GPU group, or engine: torch) (CUDA_VISIBLE_DEVICES {visible!r})"
    )


def test_teacher_args_tensor_parallel_2_names_the_field(tmp_path: Path) -> None:
    environ = {"MOPD_TEACHER_ID": "teacher", "CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(
        RoleEnvError,
        match=r"^models\.teachers\[0\]\.tensor_parallel: .*\(got 2; expected ≤ 1, or allow_unverified: true "
        r"\(--allow-unverified\) to run it unverified\) \(CUDA_VIS",
    ):
        teacher_args(role(tmp_path, environ), gpu_config(2), environ)


# --- engines.teacher.process: the engine choice -------------------------------------------------------


def cli_args(model: Path | str, **changes: object) -> TeacherArgs:
    base = TeacherArgs(
        teacher_id="t", model_path=str(model), host="127.0.0.1", port=0, advertise_host="127.0.0.1"
    )
    return dataclasses.replace(base, **changes)


def test_engine_flag_and_variable() -> None:
    argv = ["--teacher-id", "t", "--model", "/m", "--port", "0"]
    assert args_from_argv(argv, {}).engine == "torch"
    assert args_from_argv(argv, {"MOPD_TEACHER_ENGINE": "megatron"}).engine == "megatron"
    assert args_from_argv([*argv, "--engine", "torch"], {"MOPD_TEACHER_ENGINE": "megatron"}).engine == "torch"
    with pytest.raises(SystemExit) as exit_info:
        args_from_argv(argv, {"MOPD_TEACHER_ENGINE": "vllm"})
    assert exit_info.value.code == 2


def test_torch_engine_is_built_for_engine_torch(tmp_path: Path) -> None:
    model = save_micro_qwen3(tmp_path / "m", seed=0, vocab_size=VOCAB)
    engine = build_engine(cli_args(model, device="cpu", max_batch_rows=5))
    assert isinstance(engine, TorchScoringEngine)
    assert (engine.vocab_size, engine.max_batch_rows, engine.device.type) == (VOCAB, 5, "cpu")
    expected = json.loads((model / "config.json").read_text()).get("pad_token_id") or 0
    assert pad_token_id(engine) == expected


def test_megatron_without_cuda_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for source, field in (("models.teachers[1]", "models.teachers[1].engine"), ("", "--engine")):
        with pytest.raises(EngineError) as err:
            build_engine(cli_args(tmp_path, engine="megatron", device="auto", source=source))
        assert str(err.value).startswith(f"{field}='megatron' needs a CUDA device, but none is available")


def test_megatron_on_a_cpu_device_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing touches CUDA before the check
    args = cli_args(tmp_path, engine="megatron", device="cpu", source="models.teachers[0]")
    with pytest.raises(
        EngineError, match=r"^models\.teachers\[0\]\.engine='megatron' runs on CUDA only, but "
    ):
        build_engine(args)
    assert teacher_main.megatron_device(
        cli_args(tmp_path, engine="megatron", device="cuda:2")
    ) == torch.device("cuda", 2)
    assert teacher_main.megatron_device(cli_args(tmp_path, engine="megatron")) == torch.device("cuda", 0)


def test_tensor_parallel_and_unknown_engine_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"^models\.teachers\[0\]\.tensor_parallel=2: .*expected ≤ 1$"):
        build_engine(cli_args(tmp_path, tensor_parallel=2, source="models.teachers[0]"))
    with pytest.raises(EngineError, match=r"^--engine='vllm': expected one of torch, megatron$"):
        build_engine(cli_args(tmp_path, engine="vllm"))


def test_serve_refuses_megatron_without_cuda_before_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli_args(tmp_path, engine="megatron", run_dir=str(tmp_path / "run"), source="models.teachers[0]")
    with pytest.raises(EngineError, match=r"models\.teachers\[0\]\.engine='megatron' needs a CUDA device"):
        asyncio.run(serve(args, TOKEN, asyncio.Event()))
    assert not endpoint_path(tmp_path / "run", "t").exists()


def test_pad_token_id_prefers_the_engine() -> None:
    assert pad_token_id(SimpleNamespace(pad_token_id=7, model=None)) == 7
    hf_like = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(pad_token_id=5)))
    assert pad_token_id(hf_like) == 5
    # megatron's GPTModel.config is a TransformerConfig without pad_token_id: 0
    assert pad_token_id(SimpleNamespace(pad_token_id=None, model=SimpleNamespace(config=object()))) == 0


# --- MegatronScoringEngine.score on the CPU, through a stand-in for GPTModel -----------------------------


class StandInGPT(torch.nn.Module):
    """GPTModel's call surface over an HF causal LM: `model(ids, positions, None)` → [B, L, V'] logits whose
    V' − V padding columns are +50 (a padding id leaking into top-k would win every position);
    `model(ids, positions, None, labels=labels)` → [B, L] −log π(label) over the real vocabulary."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert attention_mask is None and positions.shape == ids.shape
        assert torch.equal(positions[0], torch.arange(ids.shape[1]))
        logits = self.hf(input_ids=ids).logits
        if labels is not None:
            return -torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
        padding = torch.full((*logits.shape[:2], PAD_COLUMNS), 50.0, dtype=logits.dtype)
        return torch.cat([logits, padding], dim=-1)


class ShardStandInGPT(StandInGPT):
    """`StandInGPT` at tensor parallel `tp`: without labels, rank `rank`'s columns [rank·V'/tp, (rank+1)·V'/tp)
    of the padded logits only (megatron's `parallel_output`); the labels path unchanged."""

    def __init__(self, hf: torch.nn.Module, rank: int, tp: int) -> None:
        super().__init__(hf)
        self.rank, self.tp = rank, tp

    def forward(self, ids, positions, attention_mask, labels=None):  # type: ignore[override]
        out = super().forward(ids, positions, attention_mask, labels)
        if labels is not None:
            return out
        width = out.shape[-1] // self.tp
        return out[..., self.rank * width : (self.rank + 1) * width]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.megatron import parallel as megatron_parallel
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine

    path = save_micro_qwen3(
        tmp_path_factory.mktemp("mt") / "m", seed=3, vocab_size=VOCAB, initializer_range=0.2
    )
    reference = TorchScoringEngine.from_pretrained(path, dtype="float32", device="cpu")
    config = json.loads((path / "config.json").read_text())
    engine = MegatronScoringEngine(
        StandInGPT(reference.model), torch.device("cpu"), config, path=path, max_batch_rows=2
    )
    return megatron_parallel, engine, reference


def test_megatron_score_matches_torch_and_drops_padding_ids(engines, monkeypatch: pytest.MonkeyPatch) -> None:
    megatron_parallel, engine, reference = engines
    monkeypatch.setattr(megatron_parallel, "tp_info", lambda: (1, 0, None))
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    mask = batch.response_mask
    assert (engine.vocab_size, engine.path) == (VOCAB, reference.path)
    lp, top = engine.score(batch, 4)
    ref_lp, ref_top = reference.score(batch, 4)
    assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape == mask.shape
    assert (lp - ref_lp)[mask].abs().max().item() < 1e-5
    assert top.indices.shape == (3, batch.response_width, 4)
    assert torch.equal(top.indices[mask], ref_top.indices[mask])
    assert (top.logprobs - ref_top.logprobs)[mask].abs().max().item() < 1e-5
    assert int(top.indices.max()) < VOCAB  # no padding id, though the padding columns hold the largest logits
    assert torch.all(lp[~mask] == 0)
    # without k: the labels path, the same log-probs
    lp_labels, none = engine.score(batch)
    assert none is None
    assert (lp_labels - ref_lp)[mask].abs().max().item() < 1e-5
    # k larger than V: the whole (real) vocabulary
    assert engine.topk(batch, 1000).indices.shape[-1] == VOCAB


def test_megatron_score_errors(engines, monkeypatch: pytest.MonkeyPatch) -> None:
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine

    megatron_parallel, engine, _ = engines
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    with pytest.raises(EngineError, match=r"^k=0: expected >= 1"):
        engine.score(batch, 0)
    with pytest.raises(EngineError, match=r"device='cpu': the megatron engine runs on CUDA only"):
        MegatronScoringEngine.from_pretrained(engine.path, dtype="float32", device="cpu")
    with pytest.raises(EngineError, match=r"dtype='int8'"):
        MegatronScoringEngine.from_pretrained(engine.path, dtype="int8", device="cuda:0")


def test_megatron_engine_behind_the_teacher_server(engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTP surface over the megatron engine: /score with top_k through the controller's client."""
    from mopd_hpc.engines.serving import start_app
    from mopd_hpc.engines.teacher.client import TeacherClient
    from mopd_hpc.engines.teacher.http_app import TeacherServer
    from mopd_hpc.engines.teacher.process import teacher_app

    megatron_parallel, engine, _ = engines
    monkeypatch.setattr(megatron_parallel, "tp_info", lambda: (1, 0, None))
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    lp, top = engine.score(batch, 3)

    async def go():
        server = TeacherServer(engine, "mt", engine.path, pad_id=pad_token_id(engine))
        runner, port, stop = await start_app(teacher_app(server, TOKEN), "127.0.0.1", 0, asyncio.Event())
        try:
            async with TeacherClient(f"http://127.0.0.1:{port}", timeout_s=60, token=TOKEN) as client:
                return await client.score(ROWS, STARTS, top_k=3)
        finally:
            stop.set()
            await runner.cleanup()

    got = asyncio.run(go())
    lengths = batch.response_lengths.tolist()
    assert got.logprobs == [lp[b, :n].tolist() for b, n in enumerate(lengths)]
    assert got.topk_ids == [top.indices[b, :n].tolist() for b, n in enumerate(lengths)]
    assert got.topk_logprobs == [top.logprobs[b, :n].tolist() for b, n in enumerate(lengths)]


def test_scoring_rows_keep_one_chunk_of_logits_within_the_budget(tmp_path: Path) -> None:
    """A step's rows in one forward for a tiny vocabulary; for a production vocabulary, as many rows as keep
    rows × tokens × vocab float32 logits within the budget (Qwen3's 151,936 × 1,280 tokens: 5 rows in 4 GiB)."""
    from mopd_hpc.config import load_run_config
    from mopd_hpc.roles.teacher import scoring_rows

    tiny = load_run_config(REPO / "configs" / "local_cpu.yaml")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({"vocab_size": 45}))
    assert scoring_rows(tiny, str(tmp_path / "tiny")) == 128  # batch_size 128 × 1 sample: the whole step
    big = load_run_config(REPO / "configs" / "qwen3_8gpu_colocated.yaml")  # 64 × 4 rows, 256 + 1024 tokens
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert scoring_rows(big, str(tmp_path / "big")) == (4 << 30) // (1280 * 151936 * 4) == 5
    assert scoring_rows(big, str(tmp_path / "big"), budget_bytes=1) == 1  # never 0
    assert scoring_rows(big, str(tmp_path / "missing")) == 256  # unreadable config: the step's rows


_TP2_SCORE = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    sys.path[:0] = sys.argv[4].split(':')
    from test_teacher_engine_choice import ROWS, STARTS, ShardStandInGPT
    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.megatron import parallel as megatron_parallel
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    rank, path = int(sys.argv[1]), sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    megatron_parallel.tp_info = lambda: (2, rank, None)  # the TP group: this gloo world
    hf = TorchScoringEngine.from_pretrained(path, dtype="float32", device="cpu").model
    config = json.load(open(path + "/config.json"))
    engine = MegatronScoringEngine(ShardStandInGPT(hf, rank, 2), torch.device("cpu"), config,
                                                   path=path, max_batch_rows=2)
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    lp, top = engine.score(batch, 4)
    whole = engine.topk(batch, 1000)
    torch.save({"lp": lp, "ids": top.indices, "values": top.logprobs, "whole_ids": whole.indices,
                "whole_values": whole.logprobs}, sys.argv[3])
    dist.destroy_process_group()
    """
)


def test_megatron_score_at_tp2_in_two_gloo_ranks(
    engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MegatronScoringEngine.score` at tensor_parallel 2: two gloo processes, each with a stand-in answering
    its half of the padded vocabulary V' = 48 (rank 1: ids 24..39 real, 8 padding columns holding the
    largest logits). Both ranks give the TP 1 engine's answer (float32: 1e-6 absolute + 2 ulps; ids
    identical) and the torch engine's (1e-5), no padding id; k > V gives the whole real vocabulary."""
    megatron_parallel, engine, reference = engines
    monkeypatch.setattr(megatron_parallel, "tp_info", lambda: (1, 0, None))
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    mask = batch.response_mask
    want_lp, want_top = engine.score(batch, 4)
    want_whole = engine.topk(batch, 1000)
    _, ref_top = reference.score(batch, 4)
    procs = [
        helpers_fork.popen(
            [
                "-c",
                _TP2_SCORE,
                str(r),
                str(tmp_path / "store"),
                str(tmp_path / f"r{r}.pt"),
                TEST_DIRS,
                str(engine.path),
            ],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    tol = {"atol": 1e-6, "rtol": 2 * torch.finfo(torch.float32).eps}
    for r in range(2):
        got = torch.load(tmp_path / f"r{r}.pt")
        torch.testing.assert_close(got["lp"], want_lp, **tol)
        assert torch.all(got["lp"][~mask] == 0)
        assert torch.equal(got["ids"][mask], want_top.indices[mask])
        assert torch.equal(got["ids"][mask], ref_top.indices[mask])
        torch.testing.assert_close(got["values"][mask], want_top.logprobs[mask], **tol)
        assert (got["values"] - ref_top.logprobs)[mask].abs().max().item() < 1e-5
        assert got["whole_ids"].shape[-1] == VOCAB and int(got["whole_ids"].max()) < VOCAB
        torch.testing.assert_close(got["whole_values"][mask], want_whole.logprobs[mask], **tol)
