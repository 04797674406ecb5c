"""The student's greedy evaluation on the rollout engines (trainer/evaluate.py `student_accuracy_on_engines`)
equals the in-process evaluation the actor ran before (`data.evaluation.greedy_complete` on the same
checkpoint, float32 CPU): the same completion for every held-out prompt, hence the same accuracy.

Real parts: hf rollout servers as subprocesses on 127.0.0.1 (two engines, the rows split between them as a
rollout step splits them), the micro models, the held-out prompts of configs/local_cpu.yaml plus a jsonl source
on its own route with a held-out fraction (scored by the run's reward, `RunData.score`). The sampled mean@k
(trainer/evaluate.py `student_mean_at_k`) at a temperature of 1e-4 (above the engines' greedy threshold of
1e-6: the sampling path) samples the argmax: its k completions of every prompt are the greedy one, and its
accuracy is pass@1.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers_auth import TOKEN
from helpers_configs import uniform_mixture
from helpers_models import save_micro_qwen3
from test_rollout_server import start_server, stop_server
from transformers import AutoTokenizer

from mopd_hpc.config import RunConfig, SamplingConfig
from mopd_hpc.data.evaluation import greedy_complete
from mopd_hpc.data.rewards import is_correct
from mopd_hpc.data.tokenizer import VOCAB_SIZE, build_char_tokenizer, save_char_tokenizer
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.torch.hf_model import load_causal_lm
from mopd_hpc.trainer.data_setup import build_run_data
from mopd_hpc.trainer.evaluate import engine_greedy, student_accuracy_on_engines, student_mean_at_k
from mopd_hpc.trainer.rollout_phase import engine_blocks

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 5
EVAL_SIZE = 40  # per source: 120 held-out prompts, 60 per engine
K = 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def micro_models(micro_models: Path, tmp_path_factory) -> Path:
    """The shared micro models copied (this module writes mine.jsonl and a random-weight model beside them)."""
    out = tmp_path_factory.mktemp("models") / "micro"
    shutil.copytree(micro_models, out)
    save_micro_qwen3(out / "random", seed=3, vocab_size=VOCAB_SIZE, initializer_range=0.2)
    save_char_tokenizer(build_char_tokenizer(), out / "random")
    return out


def run_config(models: Path) -> RunConfig:
    rows = [{"prompt": f"{i % 10}+{i // 10}=", "answer": str(i % 10 + i // 10)} for i in range(100)]
    (models / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = uniform_mixture(yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()))
    doc["data"]["sources"].append(
        {
            "name": "mine",
            "kind": "jsonl",
            "route": "mine",
            "path": str(models / "mine.jsonl"),
            "eval_fraction": 0.4,
        }
    )
    doc["routes"]["mine"] = {"chain": 1.0}
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(models / "student")
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(models / name)
    doc["data"]["eval"]["size"] = EVAL_SIZE
    return RunConfig.from_dict(doc)


def in_process(
    model_dir: Path, tokenizer, prompts, score
) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
    """The reference: the checkpoint loaded in this process, float32 CPU, as the actor evaluated before."""
    model = load_causal_lm(str(model_dir), "float32", "cpu").eval()
    texts = {
        route: tuple(greedy_complete(model, tokenizer, [p.text for p in items], max_new_tokens=MAX_NEW))
        for route, items in prompts.items()
    }
    accuracy = {
        route: sum(is_correct(score(p, t)) for p, t in zip(prompts[route], texts[route], strict=True))
        / len(t)
        for route, t in texts.items()
    }
    return texts, accuracy


@pytest.mark.parametrize("model_name", ["student", "random"])
def test_engines_answer_as_the_in_process_evaluation(
    micro_models: Path, tmp_path: Path, model_name: str
) -> None:
    cfg = run_config(micro_models)
    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    data = build_run_data(cfg)
    prompts = data.eval_prompts
    assert {r: len(p) for r, p in prompts.items()} == {
        "chain": EVAL_SIZE,
        "legs": EVAL_SIZE,
        "mine": EVAL_SIZE,
    }
    model_dir = micro_models / model_name
    want_texts, want_accuracy = in_process(model_dir, tokenizer, prompts, data.score)

    servers = []
    try:
        for e in range(2):
            (tmp_path / f"e{e}").mkdir()
            servers.append(start_server(model_dir, tmp_path / f"e{e}", "--dtype", "float32"))

        async def work():
            clients = [RolloutClient(url, token=TOKEN, retries=0) for _, url, _ in servers]
            try:
                both = await student_accuracy_on_engines(clients, tokenizer, prompts, MAX_NEW, data.score)
                one = await student_accuracy_on_engines(clients[:1], tokenizer, prompts, MAX_NEW, data.score)
                ids = [tokenizer(p.text)["input_ids"] for p in prompts["chain"]]
                samples = await engine_greedy(clients, ids, MAX_NEW, tokenizer.eos_token_id)
                cold = SamplingConfig(temperature=1e-4, max_new_tokens=MAX_NEW)
                sampled = await student_mean_at_k(clients, tokenizer, prompts, cold, K, 7, data.score)
                return both, one, ids, samples, sampled
            finally:
                for c in clients:
                    await c.close()

        both, one, ids, samples, sampled = asyncio.run(work())
    finally:
        for proc, _, _ in servers:
            stop_server(proc)

    assert [len(b) for b in engine_blocks(EVAL_SIZE, 2)] == [EVAL_SIZE // 2] * 2  # both engines answered
    assert both.completions == want_texts  # every row's answer, text for text
    assert both.accuracy == want_accuracy
    assert one.completions == want_texts and one.accuracy == want_accuracy  # one engine: the same
    assert both.weight_versions == ("default",)  # no weight sync yet: the checkpoint's weights
    # mean@k at a temperature of 1e-4: every one of the k samples is the greedy completion
    assert sampled.completions == {
        r: tuple(t for t in texts for _ in range(K)) for r, texts in want_texts.items()
    }
    assert sampled.accuracy == want_accuracy
    assert [tuple(s.prompt_ids) for s in samples] == [tuple(i) for i in ids]  # prompt order kept
    assert all(0 < len(s.output_ids) <= MAX_NEW and not s.behavior_logprobs for s in samples)
    if model_name == "random":  # the oracle tells rows apart: the answers vary from prompt to prompt
        assert all(len(set(texts)) > EVAL_SIZE // 4 for texts in want_texts.values()), want_texts
