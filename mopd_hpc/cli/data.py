"""`mopd-data`: turn a local dataset file into the project's jsonl, and check one."""

from __future__ import annotations

from collections.abc import Sequence

from mopd_hpc.cli.base import dispatch

#: verb → module (each module: HELP, add_arguments(parser), run(args) -> int).
VERBS: dict[str, str] = {
    "convert": "mopd_hpc.cli.data_convert",
    "check": "mopd_hpc.cli.data_check",
}


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch("mopd-data", __doc__ or "", VERBS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
