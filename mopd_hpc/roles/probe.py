"""The `probe` role: report this child's RankTopology and named ports to the run directory, then exit 0.

Started by a guard (`python -m mopd_hpc.roles.probe`) for tests and `mopd-debug`. It writes, atomically,

    <MOPD_RUN_DIR>/probe/<host>-<role>-<index>.json

with `role`, `index`, `generation`, `pid`, `host`, `topology` (`RankTopology.to_dict()`), `ports`
(name → port, from `MOPD_PORT_<NAME>`), `transfer_ranks` (from the plan, `MOPD_TRANSFER_RANKS`),
`plan_role`/`plan_index` (the role a probe-only plan's probe stands in for, or null), `restart_count`
(`SLURM_RESTART_COUNT`, 0 when unset), `resume_checkpoint` (what `<run_dir>/checkpoints/latest` points to:
a link's target or the file's text; null when absent), `weight_sync_backend` (the run config's
`weight_sync.backend`, from `<run_dir>/config.yaml`, null without it: it decides which weight-sync rank the
probe table shows, as the dry-run rank map does), and `env`: the values of `CUDA_VISIBLE_DEVICES`,
every `MOPD_*` variable, and the variables named in `MOPD_PROBE_ENV_KEYS` (comma-separated), verbatim.

Test knobs (environment): `MOPD_PROBE_HOLD_S=N` keeps the probe alive N seconds after writing (USR2 or
TERM end it with 0: it stands in for a child that checkpoints and exits); `MOPD_PROBE_EXIT_CODE=C` exits
with C after writing, only in het group `MOPD_PROBE_EXIT_HET_GROUP` when that is set.
Exit codes: 0 written; 2 (EXIT_USAGE) when the environment is not a guard child's or the topology is
invalid (the message, naming the variable, goes to stderr); C as asked.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import CONFIG_FILE, LATEST_CHECKPOINT, probe_report_file
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.signals import EXIT_OK, EXIT_USAGE


def resume_checkpoint(run_dir: Path) -> str | None:
    """What `run_dir/checkpoints/latest` points to (a symlink's target, else the file's stripped text);
    None when it does not exist."""
    latest = run_dir / LATEST_CHECKPOINT
    if latest.is_symlink():
        return os.readlink(latest)
    try:
        return latest.read_text(encoding="utf-8").strip() or None
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def weight_sync_backend(run_dir: Path) -> str | None:
    """`weight_sync.backend` of the run config `mopd-submit` wrote to `run_dir/config.yaml`; None when the
    file is missing or unreadable or names none."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    sync = data.get("weight_sync") if isinstance(data, dict) else None
    backend = sync.get("backend") if isinstance(sync, dict) else None
    return backend if isinstance(backend, str) else None


def probe_report(env: Mapping[str, str]) -> tuple[Path, dict[str, Any]]:
    """The report of the child whose environment is `env`, and where it goes.

    Raises:
        KeyError: a variable the guard sets (MOPD_RUN_DIR, MOPD_ROLE, MOPD_INDEX) is missing.
        TopologyError: the environment gives no valid topology.
    """
    from mopd_hpc.runtime.topology import RankTopology

    role, index = env[child_env.ROLE], int(env[child_env.INDEX])
    topology = RankTopology.from_env(env, role=role)
    host = env.get(child_env.HOST) or topology.hostname
    ports = {
        k[len(child_env.PORT_PREFIX) :].lower(): int(v)
        for k, v in env.items()
        if k.startswith(child_env.PORT_PREFIX)
    }
    extra = [k for k in env.get(child_env.PROBE_ENV_KEYS, "").split(",") if k]
    shown = {
        k: v
        for k, v in env.items()
        if k.startswith(child_env.PREFIX) or k == "CUDA_VISIBLE_DEVICES" or k in extra
    }
    transfer = [int(r) for r in env.get(child_env.TRANSFER_RANKS, "").split(",") if r.strip()]
    restart = env.get("SLURM_RESTART_COUNT", "0").strip()
    report = {
        "role": role,
        "index": index,
        "plan_role": env.get(child_env.PLAN_ROLE),
        "plan_index": int(env[child_env.PLAN_INDEX]) if env.get(child_env.PLAN_INDEX) else None,
        "transfer_ranks": transfer,
        "weight_sync_backend": weight_sync_backend(Path(env[child_env.RUN_DIR])),
        "restart_count": int(restart) if restart.isdigit() else 0,
        "resume_checkpoint": resume_checkpoint(Path(env[child_env.RUN_DIR])),
        "generation": int(env.get(child_env.GENERATION, "0")),
        "pid": os.getpid(),
        "host": host,
        "topology": topology.to_dict(),
        "ports": ports,
        "env": shown,
    }
    return probe_report_file(env[child_env.RUN_DIR], host, role, index), report


def main(env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    try:
        path, report = probe_report(env)
    except KeyError as exc:
        print(
            f"probe: {exc.args[0]} is not set: the probe runs as a guard child (mopd-guard)", file=sys.stderr
        )
        return EXIT_USAGE
    except ValueError as exc:  # TopologyError is a ValueError
        print(f"probe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, report)
    print(f"probe: wrote {path}", flush=True)
    code = env.get(child_env.PROBE_EXIT_CODE, "").strip()
    group = env.get(child_env.PROBE_EXIT_HET_GROUP, "").strip()
    if code and (not group or group == str(report["topology"]["het_group"])):
        print(f"probe: exiting with {code} as {child_env.PROBE_EXIT_CODE} asks", flush=True)
        return int(code)
    hold_s = float(env.get(child_env.PROBE_HOLD_S, "0") or 0)
    if hold_s > 0:
        _hold(hold_s)
    return EXIT_OK


def _hold(hold_s: float) -> None:
    """Stay alive `hold_s` seconds; USR2 (checkpoint) or TERM end the wait early."""
    stop: list[int] = []
    for signum in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(signum, lambda s, _f: stop.append(s))
    deadline = time.monotonic() + hold_s
    while not stop and time.monotonic() < deadline:
        time.sleep(0.05)
    if stop:
        print(f"probe: got {signal.Signals(stop[0]).name}: exiting", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
