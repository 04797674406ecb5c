#!/usr/bin/env bash
# Stop the local Slurm cluster that setup.sh started: cancel every job, stop the daemons by their recorded
# PIDs (SIGTERM, then SIGKILL after SLURM_LOCAL_STOP_TIMEOUT_S=15 s; zombies count as stopped), stop what is
# left inside the nodes (processes in the node network namespaces or in the slurm_<node> cgroups, by PID),
# and remove the namespaces and the bridge. Daemons that setup.sh adopted (already running) are left alone.
#
# Usage: teardown.sh [--purge]
#   --purge  also wipe the state (/var/spool/slurm*), logs (/var/log/slurm), /run/slurm-local, the generated
#            /etc/slurm/*.conf, the accounting database and the "# slurm-local" lines of /etc/hosts.
# Safe to call when nothing runs. Root only.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

PURGE=0
for arg in "$@"; do
  case $arg in
    --purge) PURGE=1 ;;
    *) die "unknown argument '$arg' (expected --purge)" ;;
  esac
done
require_root
take_lock
T0=$(date +%s.%N)

cancel_jobs() {
  recorded_alive slurmctld || return 0
  local jobs deadline
  jobs=$(squeue -h -o '%A' 2>/dev/null | sort -u | paste -sd' ' -) || return 0
  [ -n "$jobs" ] || return 0
  log "cancelling jobs: $jobs"
  # shellcheck disable=SC2086
  scancel $jobs 2>/dev/null || true
  # KillWait=5: steps get SIGTERM, then SIGKILL 5 s later; wait for the nodes to finish their epilogues.
  deadline=$((SECONDS + 20))
  while [ -n "$(squeue -h -o '%A' 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
}

# PIDs of the processes still living in a node: its network namespace, and the slurm_<node> cgroups.
node_leftovers() {
  local ns f
  for ns in $(existing_netns); do ip netns pids "$ns" 2>/dev/null || true; done
  for f in /sys/fs/cgroup/freezer/slurm_*/ /sys/fs/cgroup/freezer/slurm/; do
    [ -d "$f" ] && find "$f" -name tasks -exec cat {} + 2>/dev/null
  done
  return 0
}

stop_leftovers() {
  local pids
  pids=$(node_leftovers | sort -un | paste -sd' ' -)
  [ -n "$pids" ] || return 0
  log "stopping processes left on the nodes: $pids"
  # shellcheck disable=SC2086
  stop_pids 5 $pids
}

drop_database() {
  recorded_alive mariadbd || [ "$(pids_line mariadbd | awk '{print $4}')" = adopted ] || return 0
  mariadb -u root -e "DROP DATABASE IF EXISTS $SL_DB;" 2>/dev/null || log "could not drop database $SL_DB"
}

purge_files() {
  local f
  for f in "$SL_ETC"/slurm.conf "$SL_ETC"/gres.conf "$SL_ETC"/cgroup.conf "$SL_ETC"/slurmdbd.conf; do
    [ -f "$f" ] && head -n 1 "$f" | grep -q -F "$SL_CONF_HEADER" && rm -f "$f"
  done
  rm -rf "$SL_SPOOL_CTLD" "$SL_SPOOL_D" "$SL_LOGDIR" "$SL_RUN"
  hosts_set
}

cancel_jobs
slurmds=$(awk '$1 ~ /^slurmd-/ {print $1}' "$SL_PIDS" 2>/dev/null || true)
# shellcheck disable=SC2086
stop_recorded $slurmds
stop_recorded slurmctld slurmdbd
stop_leftovers
[ $PURGE -eq 1 ] && drop_database
stop_recorded mariadbd munged
for ns in $(existing_netns); do ip netns delete "$ns" || log "could not delete netns $ns"; done
if ip link show "$SL_BRIDGE" >/dev/null 2>&1; then ip link delete "$SL_BRIDGE" || log "could not delete $SL_BRIDGE"; fi
rm -f "$SL_RUN/fingerprint" "$SL_RUN/mode" "$SL_RUN/knobs"
[ $PURGE -eq 1 ] && purge_files
left=$(awk '{print $1}' "$SL_PIDS" 2>/dev/null | paste -sd' ' - || true)
log "stopped in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s$([ $PURGE -eq 1 ] && echo ', purged')${left:+ (left running, adopted: $left)}"
