"""What importing the trainer costs a process: torch.distributed.checkpoint (≈ 0.9 CPU-s where transformers has not
imported torch.distributed.tensor) is imported when a sharded checkpoint is written or read, not by importing the
controller or a follower (trainer/sharded_checkpoint.py `_dcp`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import mopd_hpc.trainer.controller, mopd_hpc.trainer.follower
from mopd_hpc.trainer import sharded_checkpoint
before = "torch.distributed.checkpoint" in sys.modules
dcp = sharded_checkpoint._dcp()
print(json.dumps({"before": before, "after": "torch.distributed.checkpoint" in sys.modules,
                  "module": dcp.__name__, "save": callable(dcp.save), "load": callable(dcp.load)}))
"""


def test_the_controller_and_a_follower_import_dcp_only_when_they_use_it():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "before": False, "after": True, "module": "torch.distributed.checkpoint", "save": True, "load": True,
    }  # fmt: skip
