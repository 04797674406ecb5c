"""Teacher accuracy measured on the teacher servers (engines/teacher/greedy_generate.py, trainer/evaluate.py): the
server's greedy route over a real TeacherServer on 127.0.0.1 gives the same completions — and so the same
accuracy — as the in-process greedy evaluation the actor ran before (the same micro models, float32 CPU);
the top-1 loop a megatron teacher uses gives the same tokens as HF generate; bad bodies are 400s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from helpers_auth import TOKEN
from transformers import AutoTokenizer

from mopd_hpc.config import RunConfig
from mopd_hpc.data.evaluation import evaluate_prompts, greedy_complete
from mopd_hpc.engines.serving import start_app
from mopd_hpc.engines.teacher.client import TeacherClient, TeacherClientError
from mopd_hpc.engines.teacher.greedy_generate import GreedyRequest, greedy_ids
from mopd_hpc.engines.teacher.http_app import TeacherServer
from mopd_hpc.engines.teacher.process import teacher_app
from mopd_hpc.engines.torch.hf_model import load_causal_lm
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.trainer.data_setup import build_run_data
from mopd_hpc.trainer.evaluate import teacher_accuracy

REPO = Path(__file__).resolve().parents[2]
TEACHER_DIRS = ("teacher_chain_sum", "teacher_leg_counting")  # the micro builder's, in config order
MAX_NEW = 5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_config(models: Path) -> RunConfig:
    doc = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(models / "student")
    for teacher, name in zip(doc["models"]["teachers"], TEACHER_DIRS, strict=True):
        teacher["path"] = str(models / name)
    doc["data"]["eval"]["size"] = 24
    return RunConfig.from_dict(doc)


async def serve_and(engines: dict[str, TorchScoringEngine], work):
    """Serve each engine as a teacher on 127.0.0.1 and run `work(clients)`."""
    started, clients = [], {}
    try:
        for tid, engine in engines.items():
            server = TeacherServer(engine, tid, engine.path, pad_id=0)
            runner, port, stop = await start_app(teacher_app(server, TOKEN), "127.0.0.1", 0, asyncio.Event())
            started.append(runner)
            clients[tid] = await TeacherClient(f"http://127.0.0.1:{port}", token=TOKEN).__aenter__()
        return await work(clients)
    finally:
        for client in clients.values():
            await client.close()
        for runner in started:
            await runner.cleanup()


def test_teacher_accuracy_on_the_servers_equals_the_in_process_evaluation(micro_models: Path) -> None:
    cfg = run_config(micro_models)
    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    prompts = build_run_data(cfg).eval_prompts
    weights = {r: dict(w) for r, w in cfg.routes.items()}
    engines = {t.id: TorchScoringEngine.from_pretrained(t.path) for t in cfg.models.teachers}

    # the reference: what the actor computed in its own process before (each teacher loaded float32 on CPU)
    expected: dict[str, dict[str, float]] = {route: {} for route in prompts}
    texts: dict[tuple[str, str], list[str]] = {}
    for teacher in cfg.models.teachers:
        model = load_causal_lm(teacher.path, "float32", engines[teacher.id].device).eval()
        for route, items in prompts.items():
            if weights[route].get(teacher.id, 0) > 0:
                result = evaluate_prompts(model, tokenizer, list(items), source=route, max_new_tokens=MAX_NEW)
                expected[route][teacher.id] = result.accuracy
                texts[route, teacher.id] = greedy_complete(
                    model, tokenizer, [p.text for p in items], max_new_tokens=MAX_NEW
                )

    async def work(clients):
        generators = {tid: c.generate_greedy for tid, c in clients.items()}
        got = await teacher_accuracy(generators, weights, tokenizer, prompts, MAX_NEW)
        served = {}
        for (route, tid), _ in texts.items():
            ids = [tokenizer(p.text)["input_ids"] for p in prompts[route]]
            rows = await clients[tid].generate_greedy(
                ids, MAX_NEW, tokenizer.eos_token_id, tokenizer.pad_token_id
            )
            served[route, tid] = tokenizer.batch_decode(rows, skip_special_tokens=True)
        with pytest.raises(TeacherClientError, match="max_new_tokens=0"):
            await next(iter(clients.values()))._call(
                "POST",
                "/generate_greedy",
                {"input_ids": [[1]], "max_new_tokens": 0, "eos_token_id": 1, "pad_token_id": 0},
            )
        return got, served

    got, served = asyncio.run(serve_and(engines, work))
    assert served == texts  # the same completions, text for text
    assert got == expected and {r: set(t) for r, t in got.items()} == {r: set(t) for r, t in expected.items()}
    assert all(per for per in got.values())  # every route's teacher was measured


class TopKOnly:
    """A scoring engine without an HF model (as the megatron teacher): only `topk`, `vocab_size`, `device`."""

    def __init__(self, engine: TorchScoringEngine) -> None:
        self.topk, self.vocab_size, self.device = engine.topk, engine.vocab_size, engine.device


def test_top1_loop_gives_the_tokens_of_hf_generate(micro_models: Path) -> None:
    cfg = run_config(micro_models)
    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    engine = TorchScoringEngine.from_pretrained(cfg.models.teachers[0].path)
    prompts = next(iter(build_run_data(cfg).eval_prompts.values()))
    ids = tuple(tuple(tokenizer(p.text)["input_ids"]) for p in prompts)
    req = GreedyRequest(ids, MAX_NEW, tokenizer.eos_token_id, tokenizer.pad_token_id)
    hf = greedy_ids(engine, req)
    assert greedy_ids(TopKOnly(engine), req) == hf
    assert len({len(r) for r in hf}) == 1 and 0 < len(hf[0]) <= MAX_NEW
