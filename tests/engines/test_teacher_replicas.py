"""Teacher replicas (issue 17): the rows of a step split across a teacher's scoring servers and reassembled in
row order, each replica's endpoint record naming its job, and the plan / rank map of replicas.

Oracle for the scores: one server scoring every row (the same checkpoint, float32 on CPU); the pool of two
replicas must agree within 1e-6 absolute. Real parts: aiohttp servers on loopback (`TeacherServer`, the job's
token), the binary transport, the run directory's endpoint files.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from helpers_auth import TOKEN
from helpers_models import save_micro_qwen3
from rich.console import Console

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.engines.serving import start_app
from mopd_hpc.engines.teacher.client import TeacherClient
from mopd_hpc.engines.teacher.http_app import TeacherServer
from mopd_hpc.engines.teacher.process import teacher_app
from mopd_hpc.engines.teacher.replica_pool import TeacherPool, TeacherPoolError, merge_answers, split_rows
from mopd_hpc.engines.teacher.score_frames import ScoreTensors
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.launch.rankmap import print_rank_map, rank_map_rows, teacher_lines
from mopd_hpc.plan.placement import place_children
from mopd_hpc.records.endpoint import EndpointRecord
from mopd_hpc.records.run_dir import rollout_ready_file
from mopd_hpc.roles.endpoints import EndpointTimeoutError, wait_for_endpoints
from mopd_hpc.runtime.http_auth import protect

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
VOCAB = 32


def test_split_rows_balances_tokens_and_keeps_row_order() -> None:
    # longest first to the lightest replica: 10→r0, 9→r1, 7→r1, 7→r0, 3→r1, 2→r0 (19 tokens each)
    assert split_rows([10, 3, 7, 7, 2, 9], 2) == [[0, 3, 4], [1, 2, 5]]
    assert split_rows([5, 5], 3) == [[0], [1], []]  # more replicas than rows: one is not called
    assert split_rows([], 2) == [[], []]
    costs = [int(c) for c in torch.randint(1, 300, (257,), generator=torch.Generator().manual_seed(0))]
    parts = split_rows(costs, 4)
    assert sorted(b for p in parts for b in p) == list(range(257)) and all(p == sorted(p) for p in parts)
    loads = [sum(costs[b] for b in p) for p in parts]
    assert max(loads) - min(loads) <= max(costs)  # LPT: within one row of each other
    with pytest.raises(ValueError, match="replicas=0"):
        split_rows([1], 0)


def _answer(lengths: list[int], fingerprint: str = "f") -> ScoreTensors:
    n = sum(lengths)
    return ScoreTensors(
        torch.tensor(lengths), torch.arange(n, dtype=torch.float32), None, None, "t", "1", fingerprint
    )


def test_merge_refuses_replicas_on_other_weights() -> None:
    merged = merge_answers([([1], _answer([2])), ([0, 2], _answer([1, 3]))], 3)
    assert merged.lengths.tolist() == [1, 2, 3]
    assert merged.logprobs.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 3.0]  # row 0 of part 1, row 1 of part 0, ...
    with pytest.raises(
        TeacherPoolError, match=r"part 0 answered .*'fingerprint': 'f'.*part 1 .*'fingerprint': 'g'"
    ):
        merge_answers([([0], _answer([2])), ([1], _answer([1], fingerprint="g"))], 2)
    with pytest.raises(ValueError, match="do not cover rows 0..2"):
        merge_answers([([0], _answer([2])), ([1], _answer([1]))], 3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # transformers' default initializer (0.02): log-probs near −log V. The rows of a replica form other
    # batch shapes than one server's, and fp32 rounding follows the shapes: measured 2.4e-7 at most over 20
    # seeds with this model (1.2e-6 with initializer_range 0.2, whose logits are 10x larger)
    return save_micro_qwen3(tmp_path_factory.mktemp("teacher") / "t", seed=3, vocab_size=VOCAB)


def _rows(seed: int, count: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    rows, starts = [], []
    for _ in range(count):
        prompt = int(torch.randint(1, 9, (1,), generator=gen))
        response = int(torch.randint(0, 13, (1,), generator=gen))
        rows.append(torch.randint(0, VOCAB, (prompt + response,), generator=gen).tolist())
        starts.append(prompt)
    return rows, starts


async def _servers(checkpoint: Path, count: int, calls: list[list[int]]):
    """`count` teacher servers of the same checkpoint on loopback; each engine call's row count → calls[i]."""
    started = []
    for i in range(count):
        engine = TorchScoringEngine.from_pretrained(checkpoint, dtype="float32", device="cpu")
        score = engine.score

        def counted(batch, k=None, host=True, _score=score, _i=i):
            calls[_i].append(batch.batch_size)
            return _score(batch, k, host=host)

        engine.score = counted  # type: ignore[method-assign]
        server = TeacherServer(engine, "t", str(checkpoint))
        runner, port, stop = await start_app(teacher_app(server, TOKEN), "127.0.0.1", 0, asyncio.Event())
        started.append((runner, f"http://127.0.0.1:{port}"))
    return started


def test_two_replicas_score_as_one(checkpoint: Path) -> None:
    rows, starts = _rows(seed=1, count=11)

    async def go():
        calls: list[list[int]] = [[], [], []]
        servers = await _servers(checkpoint, 3, calls)
        try:
            async with TeacherClient(servers[0][1], token=TOKEN) as one:
                single = await one.score_tensors(rows, starts, top_k=5)
            async with TeacherPool([servers[1][1], servers[2][1]], token=TOKEN) as pool:
                pooled = await pool.score_tensors(rows, starts, top_k=5)
                listed = await pool.score(rows, starts, top_k=None)
                assert len(await pool.health()) == 2
        finally:
            for runner, _ in servers:
                await runner.cleanup()
        return single, pooled, listed, calls

    single, pooled, listed, calls = asyncio.run(go())
    assert calls[0] == [11] and calls[1][0] + calls[2][0] == 11 and min(calls[1][0], calls[2][0]) > 0
    assert torch.equal(pooled.lengths, single.lengths)
    assert (pooled.logprobs - single.logprobs).abs().max().item() <= 1e-6
    assert (pooled.topk_logprobs - single.topk_logprobs).abs().max().item() <= 1e-6
    assert torch.equal(pooled.topk_ids, single.topk_ids)
    assert pooled.topk_ids.dtype == torch.int32
    assert [len(r) for r in listed.logprobs] == single.lengths.tolist()
    flat = torch.tensor([v for r in listed.logprobs for v in r])
    assert (flat - single.logprobs).abs().max().item() <= 1e-6


async def _health_server():
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/health", lambda request: web.json_response({"status": "ok"}))
    return await start_app(protect(app, TOKEN), "127.0.0.1", 0, asyncio.Event())


def _teacher(run_dir: Path, port: int, replica: int, job_id: str | None) -> None:
    EndpointRecord.teacher(
        "math", replica, host="127.0.0.1", port=port, pid=1, job_id=job_id, model_path="m", fingerprint="f"
    ).write(run_dir)


def _rollout(run_dir: Path, port: int, job_id: str | None) -> None:
    EndpointRecord.rollout(
        0, host="127.0.0.1", port=port, pid=1, job_id=job_id, model_path="m", backend="hf"
    ).write(run_dir)


def test_endpoint_records_of_another_job_or_none_are_refused(tmp_path: Path) -> None:
    """A record left by another job (or one without a job id: a standalone server's) is never accepted, even
    when something answers at its address; the error names both job ids."""

    async def go():
        runner, port, _ = await _health_server()
        try:
            _teacher(tmp_path, port, 0, "job-old")
            _teacher(tmp_path, port, 1, "job-new")
            _rollout(tmp_path, port, None)  # no job id
            with pytest.raises(EndpointTimeoutError) as err:
                await wait_for_endpoints(tmp_path, {"math": 2}, 1, "job-new", timeout_s=0.3)
            message = str(err.value)
            assert "teacher-math.r0.json belongs to job 'job-old', not to this job 'job-new'" in message
            assert "rollout-0.json has no job_id" in message and "math.r1" not in message
            _teacher(tmp_path, port, 0, "job-new")
            _rollout(tmp_path, port, "job-new")
            return await wait_for_endpoints(tmp_path, {"math": 2}, 1, "job-new", timeout_s=5)
        finally:
            await runner.cleanup()

    found = asyncio.run(go())
    url = found.rollout[0]
    assert found.teachers == {"math": (url, url)}  # every replica's URL, in replica order
    assert not rollout_ready_file(tmp_path, 0).exists()


def test_cpu_replicas_are_children_of_their_own() -> None:
    cfg = load_run_config(CONFIGS / "local_cpu.yaml", ["models.teachers.1.replicas=2"])
    teachers = place_children(cfg).by_role("teacher")
    got = [
        (
            t.index,
            t.env_dict["MOPD_TEACHER_ID"],
            t.env_dict["MOPD_TEACHER_REPLICA"],
            t.port_names,
            t.node_index,
        )
        for t in teachers
    ]
    assert got == [
        (0, "chain", "0", ("http",), 0),
        (1, "legs", "0", ("http",), 0),
        (2, "legs", "1", ("http",), 0),
    ]
    assert [r["model"] for r in rank_map_rows(place_children(cfg), "torch") if r["role"] == "teacher"] == [
        "chain r0", "legs r0", "legs r1",
    ]  # fmt: skip


def test_gpu_replicas_in_the_dry_run_rank_map() -> None:
    """configs/qwen3_8gpu_colocated.yaml: one TP-8 replica on the 8 GPUs; at TP 2, four replicas of two GPUs
    (derived), or the number asked; more than fit is refused naming the field."""
    cfg = load_run_config(CONFIGS / "qwen3_8gpu_colocated.yaml")
    plan = place_children(cfg)
    assert teacher_lines(plan) == [
        "teacher teacher: 1 replica(s) × tp 8 — replica 0 on node 0 GPUs 0,1,2,3,4,5,6,7"
    ]
    console = Console(width=250, record=True, color_system=None)
    print_rank_map(plan, console, cfg.weight_sync.backend, cfg.weight_sync.awex_mode)
    text = console.export_text()
    assert "teacher r0, tp 3/8" in text and text.rstrip().endswith("GPUs 0,1,2,3,4,5,6,7")
    tp2 = place_children(
        load_run_config(CONFIGS / "qwen3_8gpu_colocated.yaml", ["models.teachers.0.tensor_parallel=2"])
    )
    assert teacher_lines(tp2) == [
        "teacher teacher: 4 replica(s) × tp 2 — replica 0 on node 0 GPUs 0,1; replica 1 on node 0 GPUs 2,3; "
        "replica 2 on node 0 GPUs 4,5; replica 3 on node 0 GPUs 6,7"
    ]
    leaders = [t for t in tp2.by_role("teacher") if t.port_names]
    assert [t.port_names for t in leaders] == [("http", "master")] * 4
    sets = ["models.teachers.0.tensor_parallel=1", "models.teachers.0.replicas=2"]
    two = place_children(load_run_config(CONFIGS / "qwen3_8gpu_colocated.yaml", sets))
    assert teacher_lines(two) == [
        "teacher teacher: 2 replica(s) × tp 1 — replica 0 on node 0 GPU 0; replica 1 on node 0 GPU 1"
    ]
    with pytest.raises(ConfigError, match=r"models\.teachers\[0\]\.replicas.*3·4 exceeds the actor's 8 GPUs"):
        load_run_config(
            CONFIGS / "qwen3_8gpu_colocated.yaml",
            ["models.teachers.0.tensor_parallel=4", "models.teachers.0.replicas=3"],
        )


def test_teacher_child_serves_its_replica_and_names_its_job(tmp_path: Path) -> None:
    """A teacher child's server takes its replica from MOPD_TEACHER_REPLICA and its job id from the guard:
    both go into its endpoint record (`TeacherArgs.replica`, `.job_id`); a replica outside the config's is
    refused naming the variable and the range."""
    from test_teacher_engine_choice import gpu_config, role

    from mopd_hpc.roles.env import RoleEnvError
    from mopd_hpc.roles.teacher import teacher_args

    cfg = gpu_config(1)  # TP 1 on the actor's 8 GPUs: 8 replicas (derived)
    environ = {"MOPD_TEACHER_ID": "teacher", "MOPD_TEACHER_REPLICA": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    args = teacher_args(role(tmp_path, environ), cfg, environ)
    assert (args.replica, args.job_id) == (3, "local-1")
    environ["MOPD_TEACHER_REPLICA"] = "8"
    with pytest.raises(
        RoleEnvError,
        match=r"MOPD_TEACHER_REPLICA='8': models\.teachers\[0\] has 8 replica\(s\); expected 0\.\.7",
    ):
        teacher_args(role(tmp_path, environ), cfg, environ)
