"""README's "Fault injection" table is this declared list: every fault case of issue 41 item 4 (and the
hardening cases beside it) with the test files that pin what it keeps; each file named exists. README's
env allow-list names exactly `ALLOWED_KEYS` of runtime/guard/env_policy.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from mopd_hpc.runtime.guard.env_policy import ALLOWED_KEYS

ROOT = Path(__file__).resolve().parents[2]
#: The fault (README's first column) → the test files that pin it (its last column, under tests/).
FAULTS: dict[str, tuple[str, ...]] = {
    "a bad data jsonl: an invalid line, a missing field, an empty file, binary bytes": (
        "faults/test_fault_inputs.py",
    ),
    "a bad model dir: no or garbage `config.json`, truncated `tokenizer.json`, safetensors cut in half": (
        "launch/test_model_check.py",
        "faults/test_fault_inputs.py",
    ),
    "a wrong type in any field, an unknown key anywhere, a YAML alias bomb": (
        "faults/test_fault_inputs.py",
        "config/test_config_yaml_limits.py",
    ),
    "a truncated newest checkpoint, an empty `latest` or `state.json`": ("faults/test_checkpoint_damage.py",),
    "the disk fills up during a checkpoint write": ("faults/test_fault_disk_full.py",),
    "SIGKILL of the actor, of a teacher or of the rollout server mid-run, then the same command again": (
        "faults/test_fault_kill_resume.py",
        "e2e/test_resume.py",
    ),
    "SIGSTOP of a teacher server mid-run": ("faults/test_fault_teacher_stop.py",),
    "SIGSTOP of the rollout server mid-run": ("faults/test_fault_rollout_stop.py",),
    "two jobs on one run dir": ("logs/test_logs_local_faults.py", "runtime/test_run_lock.py"),
    "SIGTERM of a local run": ("logs/test_logs_local_faults.py",),
    "Ctrl-C on `mopd-submit --local ... \\| tee out`": ("faults/test_fault_ctrl_c_tee.py",),
    "SIGKILL of the guard": ("logs/test_logs_local_faults.py", "runtime/test_guard_proctree.py"),
    "garbage or half-written lines in `metrics.jsonl`, damaged event logs or state files": (
        "faults/test_fault_unreadable.py",
    ),
    "malformed or abusive requests to a server of the job": (
        "runtime/test_http_limits.py",
        "runtime/test_guard.py",
    ),
    "env keys off the allow-list": ("runtime/test_guard_env_policy.py",),
}


def section(heading: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end > 0 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = re.split(r"(?<!\\) \| ", line.strip()[2:-2])
            rows.append(cells)
    return rows[1:]  # the header


def test_readme_fault_table_is_the_declared_list() -> None:
    rows = table_rows(section("### Fault injection"))
    assert [r[0] for r in rows] == list(FAULTS), "README's fault column differs from tests/faults FAULTS"
    for fault, *_, tests in rows:
        named = tuple(re.findall(r"`([^`]+\.py)`", tests))
        assert named == FAULTS[fault], (fault, named)
        for name in named:
            assert (ROOT / "tests" / name).is_file(), f"{fault}: no tests/{name}"


def test_readme_env_allow_list_is_env_policy_allowed_keys() -> None:
    paragraph = section("**The env allow-list.**").split("Any other key")[0]
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", paragraph)) - {"ALLOWED_KEYS"}
    assert named == set(ALLOWED_KEYS)
