"""`mopd-logs`: summarize and tail a run's logs (issue 7)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    print("mopd-logs: not implemented yet (issue 7)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
