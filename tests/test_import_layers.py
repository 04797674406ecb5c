"""The package's imports run one way: no file-level circle, no circle between the subfolders of a package
(`engines/rollout` → `engines/weight_sync` → `engines/rollout` is one, whichever files it runs through), and no
import from a lower layer to a higher one.

Imports are read with `ast` from every file of `mopd_hpc/` (nothing is imported): `import a.b` and `from a
import b` (resolved to the submodule `a.b` when it is one, else to the package `a`), lazy imports inside
functions included, imports under `if TYPE_CHECKING:` excluded (they never run). The layers, top to bottom, are
`LAYERS` below; the README's architecture paragraph states the same order:

    cli → launch → logs (the summarizer) → roles → plan → trainer → engines → mopd, data → runtime → records → config, atomic

"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mopd_hpc"

#: Top to bottom. A file may import files of its own layer's package and of any lower layer; packages that share
#: a layer are independent of each other. `logs` is the summarizer (it reads what the layers below write).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),  # mopd-submit, mopd-logs, mopd-debug, mopd-guard
    ("launch",),  # render, submit, local backend, local-run preparation
    ("logs",),  # the summarizer: reads the run directory, sacct, the job index
    ("roles",),  # one entry point per child role
    ("plan",),  # decided before anything starts: placement, transfer ranks, the memory and residency plans
    ("trainer",),  # the controller loop, checkpoints, evaluation
    ("engines",),  # train/scoring engines, rollout servers, weight sync
    ("mopd", "data"),  # the algorithm; datasets and rewards
    ("runtime",),  # topology, ports, the guard; the child-env table and the job plan record
    ("records",),  # the run directory's layout and what is written there (metrics, end-of-job marker)
    ("config", "atomic"),  # run.yaml's models; atomic writes
)


def module_files() -> dict[str, Path]:
    """Dotted module name → file, for every file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The project modules `module` imports (module docstring's rules)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mopd_hpc":
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "mopd_hpc":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in modules else base


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: {t for t in imports_of(m, p, modules) if t != m} for m, p in modules.items()}


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of a module: its first name below `mopd_hpc` (`mopd_hpc.atomic` → atomic)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index, top
    raise AssertionError(f"{module}: package {top!r} is in no layer of LAYERS; add it where it belongs")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def packages() -> list[str]:
    """Dotted names of the package and of every folder of it (each has an `__init__.py`)."""
    return sorted(name for name, path in module_files().items() if path.name == "__init__.py")


def folder_graph(graph: dict[str, set[str]], package: str, subfolders: set[str]) -> dict[str, set[str]]:
    """The file graph seen from `package`: each file of a subfolder (at any depth) counts as that subfolder;
    an arrow from one subfolder to another when any file of the first imports any file of the second.
    Files directly in `package` are left out (the file-level check covers them)."""

    def folder(module: str) -> str | None:
        if not module.startswith(package + "."):
            return None
        head = f"{package}.{module[len(package) + 1 :].split('.')[0]}"
        return head if head in subfolders else None

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = folder(module)
        if source is None:
            continue
        out.setdefault(source, set()).update(t for t in map(folder, targets) if t is not None and t != source)
    return out


def test_the_reader_resolves_submodules_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    modules = {
        "mopd_hpc.a": tmp_path,
        "mopd_hpc.a.b": tmp_path,
        "mopd_hpc.c": tmp_path,
        "mopd_hpc.d": tmp_path,
    }
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from mopd_hpc.a import b, Thing\n"
        "if TYPE_CHECKING:\n    from mopd_hpc.d import Hint\n"
        "def f():\n    import mopd_hpc.c\n",
        encoding="utf-8",
    )
    assert sorted(set(imports_of("mopd_hpc.x", source, modules))) == [
        "mopd_hpc.a",
        "mopd_hpc.a.b",
        "mopd_hpc.c",
    ]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_level_circle() -> None:
    found = circles(import_graph())
    assert found == [], "import circles (each: files that import each other in a loop): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_a_circle_between_subfolders_is_found_through_any_files() -> None:
    graph = {
        "p.rollout.server": {"p.weight_sync.ipc", "p.batch"},
        "p.weight_sync.torch": {"p.rollout.control.fields"},
        "p.batch": {"p.frames.codec"},
        "p.frames.codec": set(),
    }
    folders = folder_graph(graph, "p", {"p.rollout", "p.weight_sync", "p.frames"})
    assert folders == {"p.rollout": {"p.weight_sync"}, "p.weight_sync": {"p.rollout"}, "p.frames": set()}
    assert circles(folders) == [["p.rollout", "p.weight_sync"]]


def test_no_circle_between_the_subfolders_of_a_package() -> None:
    graph = import_graph()
    names = packages()
    found = []
    for package in names:
        subfolders = {n for n in names if n.rpartition(".")[0] == package}
        if len(subfolders) > 1:
            found += circles(folder_graph(graph, package, subfolders))
    assert found == [], (
        "circles between subfolders (each: folders whose files import each other in a loop): "
        + ("; ".join(" <-> ".join(c) for c in found))
    )


def test_no_import_runs_up_the_layers() -> None:
    graph = import_graph()
    upward = []
    for module, targets in sorted(graph.items()):
        if module == "mopd_hpc":
            continue
        low, package = layer_of(module)
        for target in sorted(targets):
            if target == "mopd_hpc":
                continue
            layer, other = layer_of(target)
            if layer < low or (layer == low and other != package):
                upward.append(f"{module} -> {target} ({package} is layer {low}, {other} layer {layer})")
    assert upward == [], "imports against the layer order:\n" + "\n".join(upward)


@pytest.mark.parametrize("package", sorted({p.relative_to(PACKAGE).parts[0] for p in PACKAGE.iterdir()}))
def test_every_package_has_a_layer(package: str) -> None:
    if package.startswith("__"):
        pytest.skip("not a package")
    layer_of(f"mopd_hpc.{package.removesuffix('.py')}")


def test_no_cli_verb_imports_another() -> None:
    """A CLI verb (`mopd_hpc/cli/<verb>.py`) parses its arguments and calls the layers below (the submit pipeline
    is launch/'s, shared by `mopd-submit` and `mopd-debug run`); the verbs share cli/base.py only."""
    graph = import_graph()
    verbs = {m for m in graph if m.startswith("mopd_hpc.cli.") and m != "mopd_hpc.cli.base"}
    assert {"mopd_hpc.cli.submit", "mopd_hpc.cli.debug_run"} <= verbs
    crossing = {m: sorted(graph[m] & verbs - {m}) for m in sorted(verbs) if graph[m] & verbs - {m}}
    assert crossing == {}
