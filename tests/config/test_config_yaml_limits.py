"""The YAML loader is bounded (config/yaml_limits.py): a bomb, a recursive alias, a deep or huge text is one
ConfigError naming the file and the limit, fast; ordinary anchors still load. `mopd-submit --check` runs as
a real subprocess."""

from __future__ import annotations

import time
from pathlib import Path

import helpers_fork
import pytest

from mopd_hpc.config import RunConfig
from mopd_hpc.config.loader import load_run_config
from mopd_hpc.config.problems import ConfigError
from mopd_hpc.config.yaml_io import load_yaml_text
from mopd_hpc.config.yaml_limits import MAX_BYTES, MAX_DEPTH, MAX_NODES
from mopd_hpc.runtime.signals import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
LOCAL_CPU = REPO / "configs" / "local_cpu.yaml"


def bomb(levels: int) -> str:
    """The billion-laughs shape: level i is nine aliases of level i-1 (9^levels leaves, ~60 lines)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_yaml_bomb_through_check_exits_2_fast_naming_file_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    base = LOCAL_CPU.read_text()
    path.write_text(base + bomb(10))  # 8 levels used to take 35 s, 10 never ended
    over_at = base.count("\n") + 6  # a5 = 9^5 leaves + their lists: the first to pass 100000 nodes
    start = time.monotonic()
    proc = helpers_fork.run(
        ["-m", "mopd_hpc.cli.submit", "--check", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == EXIT_USAGE == 2
    assert elapsed < 2.0, elapsed
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{path}: 1 problem",
        f"  - YAML aliases expand to more than {MAX_NODES} nodes (the limit is {MAX_NODES}), counted up to "
        f"the collection at line {over_at}; a config needs far less: write the values out instead of nesting aliases",
    ]
    assert "Traceback" not in proc.stderr


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rec.yaml"
    path.write_text("name: x\nloop: &a [1, *a]\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert str(info.value).splitlines() == [
        f"{path}: 1 problem",
        "  - YAML recursive alias at line 2: a collection contains itself",
    ]


def test_deep_nesting_is_refused_in_text_and_through_aliases() -> None:
    depth = MAX_DEPTH + 1
    _, problems = load_yaml_text("a: " + "[" * depth + "]" * depth + "\n")
    assert [p.render() for p in problems] == [
        f"YAML nested too deep at line 1: more than {MAX_DEPTH} levels (the limit is {MAX_DEPTH})"
    ]
    # Each level textually shallow (depth 2), 70 levels once the aliases are followed.
    chain = ["l0: &l0 [x]", *(f"l{i}: &l{i} [*l{i - 1}]" for i in range(1, 70))]
    doc, problems = load_yaml_text("\n".join(chain) + "\n")
    assert doc is None
    (problem,) = problems
    # l62 is 64 levels deep, the document around it 65: the root (line 1) passes the limit.
    assert problem.render().startswith(
        f"YAML nested too deep at line 1 once aliases are followed: more than {MAX_DEPTH}"
    )


def test_huge_text_and_huge_file_are_refused(tmp_path: Path) -> None:
    text = "a: '" + "x" * MAX_BYTES + "'\n"
    _, problems = load_yaml_text(text)
    assert [p.render() for p in problems] == [
        f"YAML text too large: {MAX_BYTES + 6} bytes (the limit is {MAX_BYTES} bytes)"
    ]
    path = tmp_path / "huge.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"config file too large: over {MAX_BYTES} bytes") as info:
        load_run_config(path)
    assert str(info.value).startswith(f"{path}: 1 problem")


def test_a_bomb_in_a_set_value_is_a_set_problem() -> None:
    value = (
        "[&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]"
    )
    value += ", &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]]"
    with pytest.raises(ConfigError) as info:
        load_run_config(LOCAL_CPU, [f"steps={value}"])
    (problem,) = info.value.problems
    assert problem.path == "--set steps"
    assert problem.message.startswith(f"YAML aliases expand to more than {MAX_NODES} nodes")


def test_ordinary_anchors_still_load_the_same_config(tmp_path: Path) -> None:
    text = LOCAL_CPU.read_text()
    anchored = text.replace(
        "    - id: chain\n      path: .cache/models/teacher_chain_sum\n      engine: torch\n      dtype: float32\n",
        "    - &chain_teacher\n      id: chain\n      path: .cache/models/teacher_chain_sum\n"
        "      engine: torch\n      dtype: float32\n",
    ).replace(
        "    - id: legs\n      path: .cache/models/teacher_leg_counting\n      engine: torch\n      dtype: float32\n",
        "    - <<: *chain_teacher\n      id: legs\n      path: .cache/models/teacher_leg_counting\n",
    )
    assert anchored.count("*chain_teacher") == 1
    path = tmp_path / "anchored.yaml"
    path.write_text(anchored)
    assert RunConfig.from_yaml(path) == RunConfig.from_yaml(LOCAL_CPU)
