#!/usr/bin/env bash
# Say whether the local Slurm cluster of setup.sh is up: each recorded daemon with its PID, the mode
# (netns or loopback), and sinfo. Exit 0 when every recorded daemon runs and slurmctld answers, 1 otherwise.
# Usage: status.sh [-q]   (-q: print nothing, only the exit status). Also: setup.sh --status.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

QUIET=0
[ "${1:-}" = -q ] && QUIET=1
say() { [ $QUIET -eq 1 ] || echo "$@"; }

up=1
if [ ! -s "$SL_PIDS" ]; then
  say "slurm-local: DOWN (not started: no daemon recorded in $SL_PIDS)"
  exit 1
fi
if [ -f "$SL_RUN/fingerprint" ]; then
  say "slurm-local: mode $(cat "$SL_RUN/mode" 2>/dev/null || echo unknown), config $(cat "$SL_RUN/fingerprint")"
else
  say "slurm-local: setup.sh did not finish (no $SL_RUN/fingerprint)"
  up=0
fi
while read -r name pid comm owner; do
  if pid_is "$pid" "$comm"; then
    say "  $name pid $pid running${owner:+ ($owner)}"
  elif [ "$owner" = adopted ]; then
    say "  $name pid $pid (adopted, not checked)"
  else
    say "  $name pid $pid NOT RUNNING"
    up=0
  fi
done <"$SL_PIDS"
if ! scontrol ping 2>/dev/null | grep -q UP; then
  say "  slurmctld does not answer"
  up=0
fi
if [ $QUIET -eq 0 ] && [ $up -eq 1 ]; then sinfo -N -o '%N %T %c %m %G' | sed 's/^/  /'; fi
if [ $up -eq 1 ]; then
  say "slurm-local: UP"
  exit 0
fi
say "slurm-local: DOWN (partly running: setup.sh repairs it, teardown.sh stops it)"
exit 1
