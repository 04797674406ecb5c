"""A module whose import takes SLOW_IMPORT_S seconds (a fork server's preload that outlasts a spawn request's
wait: test_guard_fork.py)."""

import os
import time

time.sleep(float(os.environ["SLOW_IMPORT_S"]))
