"""`mopd-logs`: summarize and tail a run's logs."""

from __future__ import annotations

from collections.abc import Sequence

from mopd_hpc.cli.base import dispatch

#: verb → module (each module: HELP, add_arguments(parser), run(args) -> int).
VERBS: dict[str, str] = {
    "summarize": "mopd_hpc.cli.logs_summarize",
    "tail": "mopd_hpc.cli.logs_tail",
}


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch("mopd-logs", __doc__ or "", VERBS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
