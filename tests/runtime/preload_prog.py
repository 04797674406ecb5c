"""A fork server's preload for test_guard_fork.py: its import sleeps PRELOAD_SLEEP_S seconds (imports that outlast
a spawn request's wait), or ends the process with PRELOAD_EXIT (a fork server that dies while importing)."""

import os
import time

time.sleep(float(os.environ.get("PRELOAD_SLEEP_S", "0")))
if "PRELOAD_EXIT" in os.environ:
    os._exit(int(os.environ["PRELOAD_EXIT"]))
