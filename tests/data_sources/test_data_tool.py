"""`mopd-data convert` / `check` in real child processes: the GSM8K recipe of the README on a GSM8K-format
sample written for these tests (tests/data/gsm8k/sample.jsonl), then the GSM8K example's source built from its
output and scored by its math reward; parquet and `save_to_disk` inputs; the report of duplicates and empty
answers; the errors, each naming the row or the field."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mopd_hpc.config import load_run_config
from mopd_hpc.data import make_source, score_completion
from mopd_hpc.data.scoring import Scoring

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "gsm8k" / "sample.jsonl"
GSM8K_CONFIG = REPO / "configs" / "gsm8k_qwen3_14b_to_0_6b.yaml"
FINALS = ["26", "110", "1,200", "13", "51", "150"]


def mopd_data(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.data", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_gsm8k_recipe_runs_on_the_sample_and_feeds_the_example_config(tmp_path: Path) -> None:
    out = tmp_path / "gsm8k" / "train.jsonl"
    proc = mopd_data("convert", SAMPLE, out, "--source", "gsm8k", "--final-answer")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "rows read: 6 (prompt from 'question', answer from 'answer')",
        "rows written: 6",
        "duplicate prompts: 0",
        "empty answers: 0",
        f"wrote {out}",
    ]
    sample = read_jsonl(SAMPLE)
    assert read_jsonl(out) == [
        {"prompt": row["question"], "answer": final, "source": "gsm8k"}
        for row, final in zip(sample, FINALS, strict=True)
    ]
    checked = mopd_data("check", out, "--reward", "math")
    assert checked.returncode == 0 and "rows read: 6" in checked.stdout, checked.stderr
    assert "answers the math reward cannot read: 0" in checked.stdout

    # the example config on the converted file: its source, its chat template fields and its math reward
    cfg = load_run_config(GSM8K_CONFIG, overrides=[f"data.sources[0].path={out}"])
    spec = cfg.data.sources[0]
    assert (spec.reward, spec.template, spec.chat_template_kwargs) == (
        "math",
        "chat",
        {"enable_thinking": False},
    )
    source = make_source("jsonl", spec.name, path=spec.path, scoring=Scoring.from_source_config(spec))
    assert len(source) == 6 and source[0].chat["system"] == spec.system_prompt
    for prompt, row in zip(source, sample, strict=True):
        assert score_completion(prompt, row["answer"]) == 1.0  # GSM8K's own worked solution is right
        assert score_completion(prompt, "so the answer is #### 7") == 0.0
    assert score_completion(source[2], "\\boxed{1200}") == 1.0  # `1,200` == 1200


def test_the_report_counts_duplicates_and_empty_answers_and_drops_them_when_asked(tmp_path: Path) -> None:
    rows = [
        {"problem": "1+1", "solution": 2},
        {"problem": "2+2", "solution": ""},
        {"problem": "1+1", "solution": 2},
        {"problem": "3+3", "solution": " "},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = mopd_data("convert", src, tmp_path / "all.jsonl", "--source", "s")
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.splitlines()[:4] == [
        "rows read: 4 (prompt from 'problem', answer from 'solution')",
        "rows written: 4",
        "duplicate prompts: 1 (rows 2)",
        "empty answers: 2 (rows 1, 3)",
    ]
    assert read_jsonl(tmp_path / "all.jsonl")[0] == {"prompt": "1+1", "answer": "2", "source": "s"}
    dropped = mopd_data(
        "convert", src, tmp_path / "some.jsonl", "--source", "s", "--drop-duplicates", "--drop-empty"
    )
    assert dropped.returncode == 0 and "rows written: 1" in dropped.stdout, dropped.stderr
    checked = mopd_data("check", tmp_path / "all.jsonl")
    assert (
        "duplicate prompts: 1 (rows 2)" in checked.stdout and "empty answers: 2 (rows 1, 3)" in checked.stdout
    )


def test_parquet_and_save_to_disk_inputs(tmp_path: Path) -> None:
    table = pa.table(
        {"question": ["q1", "q2", "q3"], "answer": ["#### 1", "#### 2", "#### 3"], "id": [7, 8, 9]}
    )
    pq.write_table(table, tmp_path / "train.parquet")
    proc = mopd_data(
        "convert", tmp_path / "train.parquet", tmp_path / "p.jsonl", "--source", "p", "--final-answer"
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["answer"] for r in read_jsonl(tmp_path / "p.jsonl")] == ["1", "2", "3"]
    # a DatasetDict as datasets' save_to_disk lays it out: dataset_dict.json, one directory per split with
    # state.json naming its Arrow stream shards
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    shards = [table.slice(0, 2), table.slice(2, 1)]
    for i, shard in enumerate(shards):
        with pa.OSFile(str(saved / "train" / f"data-0000{i}-of-00002.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, shard.schema) as writer:
                writer.write_table(shard)
    state = {
        "_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)],
        "_split": "train",
    }
    (saved / "train" / "state.json").write_text(json.dumps(state))
    proc = mopd_data("convert", saved, tmp_path / "d.jsonl", "--source", "d", "--split", "train")
    assert proc.returncode == 0, proc.stderr
    assert [r["prompt"] for r in read_jsonl(tmp_path / "d.jsonl")] == ["q1", "q2", "q3"]
    no_split = mopd_data("convert", saved, tmp_path / "e.jsonl", "--source", "d")
    assert (
        no_split.returncode == 2
        and "a DatasetDict; --split must name one of ['train'] (got None)" in no_split.stderr
    )


@pytest.mark.parametrize(
    ("lines", "args", "message"),
    [
        (['{"question": "q", "answer": "1"}', "[1]"], (), "in.jsonl:2: expected a JSON object (got list)"),
        (
            ['{"question": "q", "answer": "1"}', '{"question": 3, "answer": "1"}'],
            (),
            "row 1: field 'question' must be a non-empty string (got 3)",
        ),
        (
            ['{"question": "q", "answer": null}'],
            (),
            "row 0: field 'answer' must be a string or a number (got None)",
        ),
        (['{"text": "q", "label": "1"}'], (), "no prompt field: the rows have ['label', 'text']"),
        (
            ['{"text": "q", "label": "1"}'],
            ("--prompt-key", "txt"),
            "--prompt-key 'txt': not a field of the rows",
        ),
    ],
)
def test_a_row_off_the_schema_is_refused_naming_it(tmp_path: Path, lines, args, message) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = mopd_data("convert", src, tmp_path / "out.jsonl", "--source", "s", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_an_existing_output_needs_force_and_check_names_a_bad_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"prompt": "p", "answer": "a"}\n{"prompt": "", "answer": "a"}\n')
    proc = mopd_data("convert", SAMPLE, out, "--source", "g")
    assert proc.returncode == 2 and "exists; --force to overwrite it" in proc.stderr
    checked = mopd_data("check", out)
    assert checked.returncode == 2 and f"{out}:2: 'prompt' must be a non-empty string" in checked.stderr


def test_check_of_a_raw_file_names_the_convert_way_out_and_check_says_rows_checked(tmp_path: Path) -> None:
    raw = mopd_data("check", "tests/data/gsm8k/sample.jsonl")  # GSM8K's own rows: question/answer
    assert raw.returncode == 2 and raw.stdout == ""
    assert raw.stderr.splitlines() == [
        "mopd-data check: tests/data/gsm8k/sample.jsonl:1: 'prompt' must be a non-empty string (got None) "
        '(expected one JSON object per line: {"prompt": "<text>", "answer": "<text>"})',
        "  its fields are 'question', 'answer': a raw dataset is made a project jsonl with "
        "`mopd-data convert tests/data/gsm8k/sample.jsonl OUT.jsonl --source NAME` (--prompt-key/--answer-key "
        "name its fields when they are not found; --final-answer keeps what follows GSM8K's '####'), then "
        "`mopd-data check OUT.jsonl`",
    ]
    out = tmp_path / "train.jsonl"
    assert mopd_data("convert", SAMPLE, out, "--source", "gsm8k", "--final-answer").returncode == 0
    checked = mopd_data("check", out)  # the way out works; check writes nothing and says so
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines() == [
        "rows read: 6 (prompt from 'prompt', answer from 'answer')",
        "rows checked: 6",
        "duplicate prompts: 0",
        "empty answers: 0",
    ]
    empty = tmp_path / "empty_prompt.jsonl"  # a project row with a bad value is no raw row: no convert hint
    empty.write_text('{"prompt": "", "answer": "a"}\n')
    bad = mopd_data("check", empty)
    assert bad.returncode == 2 and "'prompt' must be a non-empty string (got '')" in bad.stderr
    assert "mopd-data convert" not in bad.stderr


def test_mopd_data_is_a_console_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mopd-data"] == "mopd_hpc.cli.data:main"
    proc = mopd_data("--help")
    assert proc.returncode == 0 and "convert" in proc.stdout and "check" in proc.stdout
