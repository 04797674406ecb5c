"""What the fork server imports must not read what differs between its children: a forked child keeps the value
its zygote's import saw (runtime/guard/fork_server.py). The zygote's environment equals a child's on every other
key, so the preloaded modules may read anything but `MOPD_*` and PER_CHILD_KEYS at import."""

from __future__ import annotations

import json
import subprocess
import sys

from mopd_hpc.runtime.guard.fork_server import PER_CHILD_KEYS, PRELOAD_MODULES

#: Imports every preloaded module with `os.environ` recording the keys read; prints those read.
PROGRAM = """
import json, os, sys
class Recording(os._Environ):
    read = set()
    def __getitem__(self, key):
        Recording.read.add(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        Recording.read.add(key)
        return super().__contains__(key)
env = os.environ
os.environ = Recording(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(Recording.read)))
"""


def test_the_preloaded_modules_read_no_per_child_key_at_import() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, *PRELOAD_MODULES], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout.strip().splitlines()[-1])
    assert read, "the recorder saw no read at all: it is not in the path of os.environ"
    assert [k for k in read if k.startswith("MOPD_") or k in PER_CHILD_KEYS] == []
