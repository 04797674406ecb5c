"""The guard's event log: `run_dir/events/<host>.guard.jsonl`, one JSON object per line.

Every line has `ts` (Unix seconds, float), `host`, `event`, and for child events `role`, `index`,
`generation`, `pid`. Events:

- `guard_start` / `guard_ready` (`url`, `port`, `pid`) / `guard_signal` (`signal`) / `guard_stop`;
- `guard_exit` (`pid`, `exit_code` or `signal`): written by the guard's keeper once the guard process has
  ended, whatever ended it (runtime/guard/keeper.py `record_exit`; after `guard_stop` on a clean stop, alone
  when the guard was SIGKILLed);
- `spawn` (`module`, `stdout`, `stderr`, `ports`: name → port, `gpus`, `env`: the overrides, secret-looking
  values redacted, `forked`: from the fork server or exec'ed) / `spawn_refused` (`role`, `index`, `reason`,
  `keys`: an env override refused);
- `fork_server_ready` (`pid`, `seconds` its imports took, `threads`, `preloaded`) / `fork_server_off` (`reason`:
  every spawn execs) / `fork_server_failed` (`error`, and `role` when a spawn's fork failed and it was exec'ed):
  runtime/guard/fork_server.py;
- `exit` (`exit_code`: int or null, `signal`: name or null; one of the two is set) / `kill` (`signal`).

Lines are appended with one `write` on an O_APPEND file (atomic for lines under PIPE_BUF on Linux);
events are ephemeral observability, not state, so no fsync.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mopd_hpc.records.run_dir import guard_events_file


def events_path(run_dir: str | os.PathLike[str], host: str) -> Path:
    return guard_events_file(run_dir, host)


class EventLog:
    """Appends guard events for `host` to `path`."""

    def __init__(self, path: str | os.PathLike[str], host: str) -> None:
        self.path = Path(path)
        self.host = host
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "host": self.host, "event": event, **fields}
        os.write(self._fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a guard event log, in order (a torn last line is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
