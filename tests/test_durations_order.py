"""The parallel pass's order: tools/test_durations.py turns a `--durations` report into tests/durations.json, and
conftest's `longest_first` hands xdist the longest work units first, a group's tests together and in order."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DURATIONS_FILE, longest_first

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "test_durations.py"

#: A report as pytest prints it under `-n 4 --dist loadgroup` (a grouped test carries its `@group`).
REPORT = """\
============================= slowest durations ==============================
120.50s call     tests/e2e/test_resume.py::test_sigusr2
30.00s setup    tests/e2e/test_main_job.py::test_smoke@tests/e2e/test_main_job.py
2.25s call     tests/e2e/test_main_job.py::test_smoke@tests/e2e/test_main_job.py
1.50s teardown tests/e2e/test_resume.py::test_sigusr2
1.00s call     tests/config/test_x.py::test_p[a@b]
0.90s call     tests/config/test_x.py::test_fast
not a duration line: 3.0s call
"""


def load_tool():
    spec = importlib.util.spec_from_file_location("test_durations_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_sums_each_tests_phases_and_drops_the_group_suffix(tmp_path: Path) -> None:
    tool = load_tool()
    assert tool.sum_durations(REPORT.splitlines()) == {
        "tests/e2e/test_resume.py::test_sigusr2": 122.0,
        "tests/e2e/test_main_job.py::test_smoke": 32.25,
        "tests/config/test_x.py::test_p[a@b]": 1.0,  # an `@` inside the parameter id is kept
        "tests/config/test_x.py::test_fast": 0.9,
    }
    log, out = tmp_path / "test.log", tmp_path / "durations.json"
    log.write_text(REPORT)
    proc = subprocess.run([sys.executable, str(TOOL), str(log), "--out", str(out), "--min-s", "1"],
                          capture_output=True, text=True, check=False, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    written = json.loads(out.read_text())
    assert list(written.items()) == [  # longest first, under --min-s left out, 0.1 s
        ("tests/e2e/test_resume.py::test_sigusr2", 122.0),
        ("tests/e2e/test_main_job.py::test_smoke", 32.2),
        ("tests/config/test_x.py::test_p[a@b]", 1.0),
    ]
    empty = tmp_path / "empty.log"
    empty.write_text("no report here\n")
    proc = subprocess.run([sys.executable, str(TOOL), str(empty), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, check=False, cwd=REPO)  # fmt: skip
    assert proc.returncode == 2 and "no duration line" in proc.stderr
    assert not (tmp_path / "x.json").exists()


class _Item:
    """What `longest_first` reads of a pytest item: its nodeid and its xdist_group marks."""

    def __init__(self, nodeid: str, group: str | None = None) -> None:
        self.nodeid = nodeid
        self._marks = [pytest.mark.xdist_group(group).mark] if group else []

    def iter_markers(self, name: str):
        return iter(m for m in self._marks if m.name == name)

    def __repr__(self) -> str:
        return self.nodeid


def test_longest_work_units_go_first_with_groups_kept_whole_and_ties_in_collection_order() -> None:
    items = [
        _Item("a.py::short"),
        _Item("b.py::g1", "b.py"),
        _Item("c.py::long"),
        _Item("b.py::g2", "b.py"),
        _Item("d.py::unknown"),
        _Item("e.py::also_unknown"),
        _Item("f.py::mid"),
    ]
    seconds = {"a.py::short": 2.0, "b.py::g1": 30.0, "b.py::g2": 40.0, "c.py::long": 60.0, "f.py::mid": 10.0}
    order = [item.nodeid for item in longest_first(items, seconds)]
    # the group b.py (30 + 40 s) outweighs the single 60 s test; its tests stay together, in their order
    assert order == [
        "b.py::g1",
        "b.py::g2",
        "c.py::long",
        "f.py::mid",
        "a.py::short",
        "d.py::unknown",
        "e.py::also_unknown",
    ]
    no_table = [item.nodeid for item in longest_first(items, {})]  # units in collection order
    assert no_table == ["a.py::short", "b.py::g1", "b.py::g2", "c.py::long", "d.py::unknown",
                        "e.py::also_unknown", "f.py::mid"]  # fmt: skip


def test_the_durations_table_names_tests_that_exist() -> None:
    """tests/durations.json is read at every xdist collection: each key is a nodeid of a test file here."""
    table = json.loads(DURATIONS_FILE.read_text())
    assert table and all(isinstance(s, float | int) and s > 0 for s in table.values())
    files = {nodeid.split("::", 1)[0] for nodeid in table}
    assert all((REPO / name).is_file() for name in files), sorted(
        n for n in files if not (REPO / n).is_file()
    )
    assert list(table.values()) == sorted(table.values(), reverse=True)
