"""The student's greedy evaluation on the rollout engines (trainer/evaluate.py `student_accuracy_on_engines`)
equals the in-process evaluation the actor ran before (`data.evaluation.greedy_complete` on the same
checkpoint, float32 CPU): the same completion for every held-out prompt, hence the same accuracy.

Real parts: hf rollout servers as subprocesses on 127.0.0.1 (two engines, the rows split between them as a
rollout step splits them), the micro models, the held-out prompts of configs/local_cpu.yaml. The served
model is the micro student (it answers "=====" to everything: accuracy 0), then a micro Qwen3 with far from
uniform random weights and the same tokenizer, whose answers vary from prompt to prompt, so that the oracle
(the completion of every row) tells rows apart; each compared with the same checkpoint loaded here. The
end-to-end accuracy with the trained tiny models is `make run`'s table.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from helpers_auth import TOKEN
from helpers_models import build_micro_models, save_micro_qwen3
from test_rollout_server import start_server, stop_server
from transformers import AutoTokenizer

from mopd_hpc.config import RunConfig
from mopd_hpc.data.evaluation import greedy_complete
from mopd_hpc.data.tokenizer import VOCAB_SIZE, build_char_tokenizer, save_char_tokenizer
from mopd_hpc.engines.hf_model import load_causal_lm
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.trainer.data_setup import build_run_data
from mopd_hpc.trainer.evaluate import engine_greedy, student_accuracy, student_accuracy_on_engines
from mopd_hpc.trainer.rollout_phase import engine_blocks

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 5
EVAL_SIZE = 40  # per source: 80 held-out prompts, 40 per engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def micro_models(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models")
    assert build_micro_models(out) == 0
    save_micro_qwen3(out / "random", seed=3, vocab_size=VOCAB_SIZE, initializer_range=0.2)
    save_char_tokenizer(build_char_tokenizer(), out / "random")
    return out


def run_config(models: Path) -> RunConfig:
    doc = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(models / "student")
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(models / name)
    doc["data"]["eval"]["size"] = EVAL_SIZE
    return RunConfig.from_dict(doc)


def in_process(model_dir: Path, tokenizer, prompts) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
    """The reference: the checkpoint loaded in this process, float32 CPU, as the actor evaluated before."""
    model = load_causal_lm(str(model_dir), "float32", "cpu").eval()
    texts = {
        route: tuple(greedy_complete(model, tokenizer, [p.text for p in items], max_new_tokens=MAX_NEW))
        for route, items in prompts.items()
    }
    return texts, student_accuracy(model, tokenizer, prompts, MAX_NEW)


@pytest.mark.parametrize("model_name", ["student", "random"])
def test_engines_answer_as_the_in_process_evaluation(
    micro_models: Path, tmp_path: Path, model_name: str
) -> None:
    cfg = run_config(micro_models)
    tokenizer = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    prompts = build_run_data(cfg).eval_prompts
    assert {r: len(p) for r, p in prompts.items()} == {"chain": EVAL_SIZE, "legs": EVAL_SIZE}
    model_dir = micro_models / model_name
    want_texts, want_accuracy = in_process(model_dir, tokenizer, prompts)

    servers = []
    try:
        for e in range(2):
            (tmp_path / f"e{e}").mkdir()
            servers.append(start_server(model_dir, tmp_path / f"e{e}", "--dtype", "float32"))

        async def work():
            clients = [RolloutClient(url, token=TOKEN, retries=0) for _, url, _ in servers]
            try:
                both = await student_accuracy_on_engines(clients, tokenizer, prompts, MAX_NEW)
                one = await student_accuracy_on_engines(clients[:1], tokenizer, prompts, MAX_NEW)
                ids = [tokenizer(p.text)["input_ids"] for p in prompts["chain"]]
                samples = await engine_greedy(clients, ids, MAX_NEW, tokenizer.eos_token_id)
                return both, one, ids, samples
            finally:
                for c in clients:
                    await c.close()

        both, one, ids, samples = asyncio.run(work())
    finally:
        for proc, _, _ in servers:
            stop_server(proc)

    assert [len(b) for b in engine_blocks(EVAL_SIZE, 2)] == [EVAL_SIZE // 2] * 2  # both engines answered
    assert both.completions == want_texts  # every row's answer, text for text
    assert both.accuracy == want_accuracy
    assert one.completions == want_texts and one.accuracy == want_accuracy  # one engine: the same
    assert both.weight_versions == ("default",)  # no weight sync yet: the checkpoint's weights
    assert [tuple(s.prompt_ids) for s in samples] == [tuple(i) for i in ids]  # prompt order kept
    assert all(0 < len(s.output_ids) <= MAX_NEW and not s.behavior_logprobs for s in samples)
    if model_name == "random":  # the oracle tells rows apart: the answers vary from prompt to prompt
        assert all(len(set(texts)) > EVAL_SIZE // 4 for texts in want_texts.values()), want_texts
