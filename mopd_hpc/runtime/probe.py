"""The `probe` role: report this child's RankTopology and named ports to the run directory, then exit 0.

Started by a guard (`python -m mopd_hpc.runtime.probe`) for tests and `mopd-debug`. It writes, atomically,

    <MOPD_RUN_DIR>/probe/<host>-<role>-<index>.json

with `role`, `index`, `generation`, `pid`, `host`, `topology` (`RankTopology.to_dict()`), `ports`
(name → port, from `MOPD_PORT_<NAME>`), and `env`: the values of `CUDA_VISIBLE_DEVICES`, every `MOPD_*`
variable, and the variables named in `MOPD_PROBE_ENV_KEYS` (comma-separated names), verbatim.
Exit codes: 0 written; 2 (EXIT_USAGE) when the environment is not a guard child's or the topology is
invalid (the message, naming the variable, goes to stderr).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.runtime.ports import PORT_ENV_PREFIX
from mopd_hpc.runtime.signals import EXIT_OK, EXIT_USAGE

#: Comma-separated names of extra variables the probe reports verbatim.
PROBE_ENV_KEYS = "MOPD_PROBE_ENV_KEYS"


def probe_report(env: Mapping[str, str]) -> tuple[Path, dict[str, Any]]:
    """The report of the child whose environment is `env`, and where it goes.

    Raises:
        KeyError: a variable the guard sets (MOPD_RUN_DIR, MOPD_ROLE, MOPD_INDEX) is missing.
        TopologyError: the environment gives no valid topology.
    """
    from mopd_hpc.runtime.topology import RankTopology

    role, index = env["MOPD_ROLE"], int(env["MOPD_INDEX"])
    topology = RankTopology.from_env(env, role=role)
    host = env.get("MOPD_HOST") or topology.hostname
    ports = {
        k[len(PORT_ENV_PREFIX) :].lower(): int(v) for k, v in env.items() if k.startswith(PORT_ENV_PREFIX)
    }
    extra = [k for k in env.get(PROBE_ENV_KEYS, "").split(",") if k]
    shown = {
        k: v for k, v in env.items() if k.startswith("MOPD_") or k == "CUDA_VISIBLE_DEVICES" or k in extra
    }
    report = {
        "role": role,
        "index": index,
        "generation": int(env.get("MOPD_GENERATION", "0")),
        "pid": os.getpid(),
        "host": host,
        "topology": topology.to_dict(),
        "ports": ports,
        "env": shown,
    }
    return Path(env["MOPD_RUN_DIR"]) / "probe" / f"{host}-{role}-{index}.json", report


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
    print(f"probe: wrote {path}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
