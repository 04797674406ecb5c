"""Every `MOPD_*` variable of the package is named in one module: `runtime/child_env.py`.

Every string literal of `mopd_hpc/` (f-string parts included; docstrings are prose and do not count, comments
are not in the syntax tree) is read with `ast`; a literal that holds `MOPD_` anywhere but in
`runtime/child_env.py` is a second source of the contract: a child variable (`child_env.CHILD_ENV_NAMES`), a
knob (`child_env.KNOB_NAMES`) or a variable the table lacks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mopd_hpc.runtime import child_env

PACKAGE = Path(__file__).resolve().parents[2] / "mopd_hpc"
HOME = PACKAGE / "runtime" / "child_env.py"
#: Any variable of the family, in the table or not.
NAMES = re.compile(rf"\b{re.escape(child_env.PREFIX)}")


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
    names = (*child_env.CHILD_ENV_NAMES, *child_env.KNOB_NAMES)
    assert all(name in child_env.__doc__ and name.startswith(child_env.PREFIX) for name in names)
    assert len(set(names)) == len(names)
    assert child_env.SECRET_FILE == "MOPD_SECRET_FILE" and child_env.SUBMIT_DIR == "MOPD_SUBMIT_DIR"
    assert child_env.port_env_name("dist_init") == "MOPD_PORT_DIST_INIT"
    assert (child_env.port_name("MOPD_PORT_HTTP"), child_env.port_name("MOPD_RANK")) == ("http", None)


def test_the_reader_sees_f_string_parts_and_skips_docstrings(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        '"""MOPD_RANK in prose."""\n'
        "def f(x):\n"
        '    """MOPD_HOST too."""\n'
        '    return f"MOPD_RANK={x}", "MOPD_PORT_HTTP", "MOPD_RANKS", "MOPD_HOSTNAME", "XMOPD_A"\n',
        encoding="utf-8",
    )
    assert sorted(literals_naming_child_variables(source)) == [
        "4: 'MOPD_HOSTNAME'",
        "4: 'MOPD_PORT_HTTP'",
        "4: 'MOPD_RANK='",
        "4: 'MOPD_RANKS'",
    ]


def test_child_variables_are_named_only_in_child_env() -> None:
    assert literals_naming_child_variables(HOME), "the table itself names them"
    elsewhere = {
        str(path.relative_to(PACKAGE.parent)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME and (hits := literals_naming_child_variables(path))
    }
    assert elsewhere == {}, f"use the constants of mopd_hpc/runtime/child_env.py instead: {elsewhere}"
