"""Faults in what a user hands the job — data files, model directories, the config — are refused by
`mopd-submit --check` (so before any process starts) with the YAML field, the file (`file:line` for data) and
the reason, exit 2, no traceback (issue 41). In this process: `submit.check` is what `--check` runs.

Pinned elsewhere, not repeated here: a damaged model file (truncated tokenizer.json, garbage or binary
config.json, safetensors cut in half or to its header, no weights, no tokenizer) in
tests/launch/test_model_check.py::test_a_damaged_file_is_refused_naming_field_and_file; a YAML alias bomb, recursive
alias, deep or huge text in tests/config/test_config_yaml_limits.py.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_model_check import check, copy_model, model  # noqa: F401 (model: the fixture check's callers use)

from mopd_hpc.cli import submit
from mopd_hpc.runtime.signals import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
LOCAL_CPU = REPO / "configs" / "local_cpu.yaml"
#: A value of the wrong type for every scalar field: a mapping.
WRONG = {"bad": [1]}


def _check_doc(doc: dict[str, Any], tmp: Path) -> tuple[int, str, str]:
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out, err = io.StringIO(), io.StringIO()
    rc = submit.check(str(path), [], False, out, err)
    return rc, out.getvalue(), err.getvalue()


def _with_jsonl(tmp: Path, body: bytes) -> dict[str, Any]:
    data = tmp / "mine.jsonl"
    data.write_bytes(body)
    doc = yaml.safe_load(LOCAL_CPU.read_text())
    doc["data"]["sources"][1] = {
        "name": "mine",
        "kind": "jsonl",
        "path": str(data),
        "route": "legs",
        "weight": 0.7,
    }
    return doc


GOOD = b'{"prompt": "1+1=", "answer": "2"}\n'


@pytest.mark.parametrize(
    ("body", "where", "says"),
    [
        (GOOD + b'{"prompt": "2+2=", "answer": "4\n' + GOOD, ":2: ", "not valid JSON"),
        (GOOD + GOOD + b'{"prompt": "3+3="}\n', ":3: ", "'answer' must be a string"),
        (GOOD + b'{"answer": "4"}\n', ":2: ", "'prompt' must be a non-empty string"),
        (b"", "", "holds no prompt (it is empty)"),
        (b"\n  \n", "", "holds no prompt (it is empty)"),
        (GOOD + b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\n", ":2: ", "binary bytes, not UTF-8 text"),
        (GOOD + b'{"prompt": "a\x00b", "answer": "c"}\n', ":2: ", "not valid JSON"),
        (GOOD + b"[" * 100_000 + b"\n", ":2: ", "not valid JSON"),
    ],
    ids=["invalid-line", "missing-answer", "missing-prompt", "empty", "blank", "binary", "nul", "deep"],
)
def test_a_bad_data_jsonl_is_refused_naming_file_and_line(
    tmp_path: Path, body: bytes, where: str, says: str
) -> None:
    rc, out, err = _check_doc(_with_jsonl(tmp_path, body), tmp_path)
    assert (rc, out) == (EXIT_USAGE, ""), err
    assert (
        "  - data.sources[1].path: " in err and f"{tmp_path / 'mine.jsonl'}{where}" in err and says in err
    ), err
    assert "Traceback" not in err


def test_a_sound_data_jsonl_passes(tmp_path: Path) -> None:
    rc, out, err = _check_doc(_with_jsonl(tmp_path, GOOD * 3), tmp_path)
    assert rc == 0 and out.startswith("# "), err


def test_a_model_dir_without_config_json_is_refused(model: Path, tmp_path: Path) -> None:  # noqa: F811
    broken = copy_model(model, tmp_path)
    (broken / "config.json").unlink()
    rc, out, err = check(model, (model, broken))
    assert (rc, out) == (EXIT_USAGE, "")
    assert "  - models.teachers[1].path: " in err and "config.json" in err and "Traceback" not in err


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, i))
    else:
        yield path, node


def _mappings(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        yield path
        for key, value in node.items():
            yield from _mappings(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _mappings(value, (*path, i))


def _dotted(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _at(doc: dict[str, Any], path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def test_a_wrong_type_in_every_field_is_refused_naming_its_path_and_value(tmp_path: Path) -> None:
    """Every scalar of configs/local_cpu.yaml (the fields of the capability table among them: engines,
    estimator, coefficients, parallel sizes, backends) set to a mapping: rc 2, its YAML path and the value on
    one line of the refusal. reasoning-gym's task arguments are checked by reasoning-gym as a whole: the
    refusal names `task_args` and shows the value in it."""
    base = yaml.safe_load(LOCAL_CPU.read_text())
    leaves = list(_leaves(base))
    assert len(leaves) > 60
    unnamed = []
    for path, _ in leaves:
        doc = copy.deepcopy(base)
        _at(doc, path[:-1])[path[-1]] = WRONG
        rc, out, err = _check_doc(doc, tmp_path)
        field = _dotted(path[:-1] if "task_args" in path[:-1] else path)
        line = next((x for x in err.splitlines() if x.startswith(f"  - {field}: ")), "")
        if rc != EXIT_USAGE or out or "{'bad': [1]}" not in line or "Traceback" in err:
            unnamed.append((field, rc, err))
    assert unnamed == []


def test_an_unknown_key_anywhere_is_refused_naming_it(tmp_path: Path) -> None:
    base = yaml.safe_load(LOCAL_CPU.read_text())
    unnamed = []
    for path in _mappings(base):
        if "task_args" in path:  # reasoning-gym's own arguments: test_config_errors covers an unknown one
            continue
        doc = copy.deepcopy(base)
        _at(doc, path)["bogus_key"] = 1
        rc, out, err = _check_doc(doc, tmp_path)
        field, parent = _dotted((*path, "bogus_key")), _dotted(path)
        # a mapping whose keys are names (routes.<route>: teacher id → weight) names the key in its message
        named = f"  - {field}: " in err or any(
            x.startswith(f"  - {parent}: ") and "'bogus_key'" in x for x in err.splitlines()
        )
        if rc != EXIT_USAGE or out or not named or "Traceback" in err:
            unnamed.append((field, rc, err))
    assert unnamed == []
