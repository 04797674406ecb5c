"""`mopd-debug`: look inside a node or a job (topology, port leases, guards, srun debug sessions)."""

from __future__ import annotations

from collections.abc import Sequence

from mopd_hpc.cli.base import dispatch

#: verb → module (each module: HELP, add_arguments(parser), run(args) -> int).
VERBS: dict[str, str] = {
    "topology": "mopd_hpc.cli.debug_topology",
    "ports": "mopd_hpc.cli.debug_ports",
    "guard": "mopd_hpc.cli.debug_guard",
    "shell": "mopd_hpc.cli.debug_shell",
    "run": "mopd_hpc.cli.debug_run",
}


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch("mopd-debug", __doc__ or "", VERBS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
