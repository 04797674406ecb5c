"""The variables the guard and the job plan set for a child are named in one module: `runtime/child_env.py`.

Every string literal of `mopd_hpc/` (f-string parts included; docstrings are prose and do not count, comments
are not in the syntax tree) is read with `ast`; a literal that holds one of the names of
`child_env.CHILD_ENV_NAMES` (`MOPD_PORT_` as a prefix) anywhere but in `runtime/child_env.py` is a second
source of the contract.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mopd_hpc.runtime import child_env

PACKAGE = Path(__file__).resolve().parents[2] / "mopd_hpc"
HOME = PACKAGE / "runtime" / "child_env.py"
#: A name as a whole word (`MOPD_HOST` is not in `MOPD_HOSTNAME`); the port family by its prefix.
NAMES = re.compile(
    "|".join(
        rf"\b{re.escape(n)}" + ("" if n == child_env.PORT_PREFIX else r"\b")
        for n in child_env.CHILD_ENV_NAMES
    )
)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def literals_naming_child_variables(path: Path) -> list[str]:
    """`line: literal` for every non-docstring string literal of `path` that holds a child variable's name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if NAMES.search(node.value):
                found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_the_names_are_the_table_of_the_module_docstring() -> None:
    assert child_env.IDENTITY_KEYS == (
        "MOPD_ROLE",
        "MOPD_INDEX",
        "MOPD_GENERATION",
        "MOPD_JOB_ID",
        "MOPD_RUN_DIR",
        "MOPD_HOST",
    )
    assert all(name in child_env.__doc__ for name in child_env.CHILD_ENV_NAMES)
    assert len(set(child_env.CHILD_ENV_NAMES)) == len(child_env.CHILD_ENV_NAMES)
    assert child_env.port_env_name("dist_init") == "MOPD_PORT_DIST_INIT"
    assert (child_env.port_name("MOPD_PORT_HTTP"), child_env.port_name("MOPD_RANK")) == ("http", None)


def test_the_reader_sees_f_string_parts_and_skips_docstrings(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        '"""MOPD_RANK in prose."""\n'
        "def f(x):\n"
        '    """MOPD_HOST too."""\n'
        '    return f"MOPD_RANK={x}", "MOPD_PORT_HTTP", "MOPD_RANKS", "MOPD_HOSTNAME"\n',
        encoding="utf-8",
    )
    assert sorted(literals_naming_child_variables(source)) == ["4: 'MOPD_PORT_HTTP'", "4: 'MOPD_RANK='"]


def test_child_variables_are_named_only_in_child_env() -> None:
    assert literals_naming_child_variables(HOME), "the table itself names them"
    elsewhere = {
        str(path.relative_to(PACKAGE.parent)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME and (hits := literals_naming_child_variables(path))
    }
    assert elsewhere == {}, f"use the constants of mopd_hpc/runtime/child_env.py instead: {elsewhere}"
