"""The SGLang versions the rollout role has run with (config/capabilities.py ROLLOUT_BACKENDS["sglang"].versions):
the same range as pyproject's `sglang` extra, refused outside it at --check (cluster.backend local, where this
machine runs the job) and at the role's start, each refusal naming the installed version and the range. The
installed version is faked through `importlib.metadata.version` (sglang itself is not installed here)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import pytest
from helpers_auth import write_run_dir_token
from helpers_ports import free_ports
from test_rollout_role_sglang import role_env, sglang_config

from mopd_hpc.config.capabilities import ROLLOUT_BACKENDS
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.engines.rollout.sglang_backend import SGLangBackendError
from mopd_hpc.roles.rollout_sglang import run_sglang

REPO = Path(__file__).resolve().parents[2]
RANGE = ">=0.5.17,<0.5.18"


@pytest.fixture
def installed(monkeypatch):
    """Set the sglang version this machine appears to have (importable, with that distribution version)."""
    real_version, real_find = importlib.metadata.version, importlib.util.find_spec

    def install(version: str) -> None:
        def fake_version(name: str) -> str:
            return version if name == "sglang" else real_version(name)

        def fake_find(name: str, *args):
            return (
                importlib.machinery.ModuleSpec("sglang", None) if name == "sglang" else real_find(name, *args)
            )

        monkeypatch.setattr(importlib.metadata, "version", fake_version)
        monkeypatch.setattr(importlib.util, "find_spec", fake_find)

    return install


def test_the_range_is_pyprojects_extra() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert ROLLOUT_BACKENDS["sglang"].version_range == RANGE
    assert extra == ["sglang" + RANGE]


@pytest.mark.parametrize(("version", "refused"), [("0.5.17", False), ("0.5.17.post2", False),
                                                  ("0.5.16", True), ("0.5.23", True)])  # fmt: skip
def test_check_names_the_installed_version_and_the_range(installed, version: str, refused: bool) -> None:
    installed(version)
    cfg = sglang_config()  # cluster.backend local: the job runs on this machine
    problems = [p.render() for p in job_gaps(cfg) if p.path == "rollout.backend"]
    if not refused:
        assert problems == []
        return
    (problem,) = problems
    assert f"sglang {version} is installed on this machine" in problem
    assert f"has run with sglang{RANGE} only" in problem and f"pip install 'sglang{RANGE}'" in problem


def test_check_passes_where_sglang_does_not_import_and_says_the_role_checks_it() -> None:
    """This machine has no sglang: --check of the shipped one-GPU config (sglang + ipc) passes, with one
    warning naming the range and that the role checks the installed version at rollout start."""
    from mopd_hpc.config import load_run_config
    from mopd_hpc.config.rules import config_warnings

    assert importlib.util.find_spec("sglang") is None
    cfg = load_run_config(str(REPO / "configs" / "local_gpu_colocated.yaml"), [], False)
    assert (cfg.rollout.backend, cfg.weight_sync.backend, cfg.cluster.backend) == ("sglang", "ipc", "local")
    assert job_gaps(cfg) == []
    (line,) = [w for w in config_warnings(cfg) if "does not import" in w]
    assert line.startswith(
        "rollout.backend: the sglang backend's package 'sglang' does not import on this machine"
    )
    assert f"checks the installed version (sglang{RANGE}) at rollout start" in line
    assert "pip install -e '.[sglang]'" in line


def test_the_role_refuses_another_version_before_the_engine_starts(installed, tmp_path: Path) -> None:
    installed("0.5.11")
    write_run_dir_token(tmp_path)
    role = role_env(tmp_path, free_ports(3))
    started: list[object] = []
    with pytest.raises(SGLangBackendError, match=rf"sglang 0\.5\.11 is installed on node localhost.*{RANGE}"):
        asyncio.run(run_sglang(role, sglang_config(), {}, started.append))
    assert started == []
