"""`check_tasks=False`: a server child reads the config `mopd-submit` checked without importing reasoning-gym.

A teacher or rollout server generates no data, so re-checking the reasoning-gym tasks of its config only cost it
the import (≈ 1.3 CPU-s: sympy, matplotlib); `start_server_role` skips that check, the actor (which generates the
data) and `mopd-submit` keep it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mopd_hpc.config import ConfigError, RunConfig

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())

# A fresh interpreter: which modules a role's config load imports (pytest's own process has imported them all).
PROBE = """
import json, os, sys
from pathlib import Path
from mopd_hpc.roles.env import load_run, start_server_role
run_dir = Path(sys.argv[1])
if sys.argv[2] == "server":
    role, cfg = start_server_role(os.environ)
else:
    cfg = load_run(run_dir, os.environ)
print(json.dumps({"reasoning_gym": "reasoning_gym" in sys.modules, "config": cfg.model_dump(mode="json")}))
"""


def _run_dir(tmp_path: Path, task: str = "chain_sum") -> Path:
    doc = json.loads(json.dumps(BASE))
    doc["run_dir"] = str(tmp_path)
    doc["data"]["sources"][0]["task"] = task
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path


def _probe(run_dir: Path, how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        MOPD_RUN_DIR=str(run_dir), MOPD_ROLE="teacher", MOPD_INDEX="0", MOPD_JOB_ID="1",
        MOPD_HOST="localhost", MOPD_BACKEND="local", MOPD_PORT_HTTP="1",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(run_dir), how], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_server_role_loads_its_config_without_importing_reasoning_gym(tmp_path):
    run_dir = _run_dir(tmp_path)
    server, actor = _probe(run_dir, "server"), _probe(run_dir, "actor")
    assert server["reasoning_gym"] is False
    assert actor["reasoning_gym"] is True  # the actor checks the tasks (and generates their data)
    assert server["config"] == actor["config"]  # the same resolved config, absolute paths included
    assert server["config"]["data"]["sources"][0]["task_args"] == BASE["data"]["sources"][0]["task_args"]


def test_check_tasks_false_skips_only_the_reasoning_gym_check():
    doc = json.loads(json.dumps(BASE))
    doc["data"]["sources"][0]["task"] = "chain_summ"
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(doc)
    assert [(p.path, p.message, p.got) for p in err.value.problems] == [
        ("data.sources[0].task", "unknown reasoning-gym task", "chain_summ")
    ]
    cfg = RunConfig.from_dict(doc, check_tasks=False)
    assert cfg.data.sources[0].task == "chain_summ"
    assert RunConfig.from_yaml(cfg.to_yaml(), check_tasks=False) == cfg
    doc["steps"] = 0  # every other check still runs
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(doc, check_tasks=False)
    assert [p.path for p in err.value.problems] == ["steps"]
