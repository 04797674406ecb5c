#!/usr/bin/env bash
# Start a real Slurm 22.05 cluster on this one host for the tests: munged, MariaDB + slurmdbd (full sacct),
# slurmctld and SLURM_LOCAL_NODES (4) slurmd nodes n1..n4 with 2 fake GPUs each (--gres=gpu:N sets
# CUDA_VISIBLE_DEVICES), partition "debug" (default), proctrack/cgroup.
#
# Default: network-namespace mode. Bridge slbr0 holds $SLURM_LOCAL_SUBNET.1/24; node ni lives in netns
# slurm-ni (veth eth0 = .(10+i), own hostname ni through a UTS namespace), so every node has its own
# hostname and address and cross-node traffic is real. No route and no NAT out of the namespaces: only the
# bridge's subnet is reachable from them. SLURM_LOCAL_NETNS=0 is the shared-loopback fallback.
#
# Usage: setup.sh [--status]   (root only; needs Debian 12 packages, which it installs when missing)
# Idempotent: when the cluster already runs with the same configuration it is a fast no-op. When the
# configuration changed (another knob), it restarts the Slurm daemons only. It waits until sinfo shows every
# node idle, then runs a real `srun` on all nodes. PIDs are recorded in /run/slurm-local/pids; stop it all
# with teardown.sh [--purge]. The knobs and files are listed in common.sh. The last line on stdout is
# SLURM_LOCAL_RESULT=started or SLURM_LOCAL_RESULT=already-running (the pytest fixture reads it).
set -euo pipefail
set -o errtrace  # the ERR trap below also reports failures inside functions
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"
# shellcheck source=render_conf.sh
source "$HERE/render_conf.sh"

if [ "${1:-}" = --status ]; then exec "$HERE/status.sh"; fi
[ $# -eq 0 ] || die "unknown argument '$1' (expected none or --status)"
require_root
check_knobs
take_lock
trap 'log "ERROR: setup failed at line $LINENO: $BASH_COMMAND (exit $?)"' ERR
T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }

PACKAGES=(slurmctld slurmd slurm-client munge iproute2 procps)
[ "$SL_ACCOUNTING" = 1 ] && PACKAGES+=(slurmdbd mariadb-server)
SLURM_DAEMONS=(slurmctld)
for n in $(node_names); do SLURM_DAEMONS+=("slurmd-$n"); done

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$SL_INSTALL" = 1 ] || die "missing Debian packages: ${missing[*]} (SLURM_LOCAL_INSTALL=0 forbids apt-get)"
  log "installing ${missing[*]}"
  bash "$HERE/../apt_install.sh" "${missing[@]}" || die "apt-get could not install: ${missing[*]}"
}

# install_configs DIR: copy the rendered files into /etc/slurm; a hand-written original is kept as *.orig.<time>.
install_configs() {
  local src=$1 f dst
  mkdir -p "$SL_ETC"
  for f in "$src"/*.conf; do
    dst="$SL_ETC/$(basename "$f")"
    if [ -f "$dst" ] && ! head -n 1 "$dst" | grep -q -F "$SL_CONF_HEADER"; then
      mv "$dst" "$dst.orig.$(date +%Y%m%d%H%M%S)"
      log "kept the hand-written $dst as $dst.orig.*"
    fi
    cmp -s "$f" "$dst" 2>/dev/null || install -m 0644 "$f" "$dst"
  done
  [ -f "$SL_ETC/slurmdbd.conf" ] && chmod 0600 "$SL_ETC/slurmdbd.conf"
  if [ "$SL_ACCOUNTING" != 1 ] && [ -f "$SL_ETC/slurmdbd.conf" ]; then rm -f "$SL_ETC/slurmdbd.conf"; fi
  return 0
}

prepare_dirs() {
  mkdir -p "$SL_RUN/fakegpu" "$SL_LOGDIR" "$SL_SPOOL_CTLD"
  local n g
  for n in $(node_names); do mkdir -p "$SL_SPOOL_D/$n"; done
  for ((g = 0; g < SL_GPUS; g++)); do ln -sfn /dev/null "$SL_RUN/fakegpu/nvidia$g"; done
}

setup_hosts() {
  local n lines=()
  if [ "$SL_NETNS" = 1 ]; then
    for n in $(node_names); do lines+=("$(node_addr "$n") $n $SL_HOSTS_TAG"); done
  else
    lines+=("127.0.0.1 $(node_names | tr '\n' ' ')$SL_HOSTS_TAG")
  fi
  hosts_set "${lines[@]}"
}

# The bridge and one netns per node (or none of them in loopback mode). Never a default route, never NAT.
setup_network() {
  local n ns want=() have
  if [ "$SL_NETNS" != 1 ]; then
    remove_network
    return 0
  fi
  for n in $(node_names); do want+=("$SL_NETNS_PREFIX$n"); done
  # Namespaces of nodes that no longer exist (fewer nodes than before) go away.
  for have in $(existing_netns); do
    [[ " ${want[*]} " == *" $have "* ]] || ip netns delete "$have" || true
  done
  if ! ip link show "$SL_BRIDGE" >/dev/null 2>&1; then
    ip link add "$SL_BRIDGE" type bridge
  fi
  ip addr replace "$SL_SUBNET.1/24" dev "$SL_BRIDGE"
  ip link set "$SL_BRIDGE" up
  for n in $(node_names); do
    ns=$SL_NETNS_PREFIX$n
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link delete "sl-$n" 2>/dev/null || true
      ip link add "sl-$n" type veth peer name "sl-$n-p"
      ip link set "sl-$n-p" netns "$ns"
      ip -n "$ns" link set "sl-$n-p" name eth0
    fi
    ip -n "$ns" addr replace "$(node_addr "$n")/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip link set "sl-$n" master "$SL_BRIDGE"
    ip link set "sl-$n" up
  done
}

remove_network() {
  local ns
  for ns in $(existing_netns); do ip netns delete "$ns" || true; done
  if ip link show "$SL_BRIDGE" >/dev/null 2>&1; then ip link delete "$SL_BRIDGE" || true; fi
}

start_munge() {
  if recorded_alive munged; then return 0; fi
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    local pid
    pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
    pids_set munged "${pid:-0}" munged adopted
    log "adopted the munged that was already running (pid ${pid:-unknown})"
    return 0
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged </dev/null >>"$SL_LOGDIR/munged.out" 2>&1 9>&- ||
    die "munged did not start" /var/log/munge/munged.log
  record_pidfile munged /run/munge/munged.pid munged /var/log/munge/munged.log
  wait_for 10 "munged" /var/log/munge/munged.log munged sh -c 'munge -n </dev/null | unmunge'
}

start_mariadb() {
  if recorded_alive mariadbd; then return 0; fi
  if mariadb-admin ping >/dev/null 2>&1; then
    pids_set mariadbd "$(cat /run/mysqld/mysqld.pid 2>/dev/null || echo 0)" mariadbd adopted
    log "adopted the MariaDB server that was already running"
    return 0
  fi
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  install -d -o mysql -g mysql -m 0755 /run/mysqld
  setsid /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
    --pid-file=/run/mysqld/mysqld.pid --bind-address=127.0.0.1 --port=3306 \
    --innodb-lock-wait-timeout=900 --log-error="$SL_LOGDIR/mariadb.log" </dev/null >/dev/null 2>&1 9>&- &
  pids_set mariadbd "$!" mariadbd
  wait_for "$SL_TIMEOUT_S" "mariadbd" "$SL_LOGDIR/mariadb.log" mariadbd mariadb-admin ping
}

setup_database() {
  mariadb -u root <<EOF || die "could not create the accounting database" "$SL_LOGDIR/mariadb.log"
CREATE DATABASE IF NOT EXISTS $SL_DB;
CREATE USER IF NOT EXISTS '$SL_DB_USER'@'localhost' IDENTIFIED BY '$SL_DB_PASS';
ALTER USER '$SL_DB_USER'@'localhost' IDENTIFIED BY '$SL_DB_PASS';
GRANT ALL ON $SL_DB.* TO '$SL_DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
  if recorded_alive slurmdbd; then return 0; fi
  rm -f "$SL_RUN/slurmdbd.pid"
  slurmdbd </dev/null >>"$SL_LOGDIR/slurmdbd.out" 2>&1 9>&- || die "slurmdbd did not start" "$SL_LOGDIR/slurmdbd.log"
  record_pidfile slurmdbd "$SL_RUN/slurmdbd.pid" slurmdbd "$SL_LOGDIR/slurmdbd.log"
  wait_for "$SL_TIMEOUT_S" "slurmdbd" "$SL_LOGDIR/slurmdbd.log" slurmdbd sacctmgr -n -P list cluster format=cluster
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$SL_CLUSTER"; then
    sacctmgr -i add cluster "$SL_CLUSTER" >/dev/null || die "sacctmgr add cluster failed" "$SL_LOGDIR/slurmdbd.log"
  fi
}

start_slurmctld() {
  rm -f "$SL_RUN/slurmctld.pid"
  slurmctld </dev/null >>"$SL_LOGDIR/slurmctld.out" 2>&1 9>&- || die "slurmctld did not start" "$SL_LOGDIR/slurmctld.log"
  record_pidfile slurmctld "$SL_RUN/slurmctld.pid" slurmctld "$SL_LOGDIR/slurmctld.log"
  wait_for "$SL_TIMEOUT_S" "slurmctld" "$SL_LOGDIR/slurmctld.log" slurmctld sh -c 'scontrol ping | grep UP'
}

start_slurmd() {
  local n=$1 pidfile="$SL_RUN/slurmd-$1.pid" logf="$SL_LOGDIR/slurmd-$1.log"
  rm -f "$pidfile"
  if [ "$SL_NETNS" = 1 ]; then
    # nsenter --net (not `ip netns exec`, which also makes a mount namespace and remounts /sys, hiding the
    # cgroup mounts); unshare --uts gives the node its own hostname.
    nsenter --net="/run/netns/$SL_NETNS_PREFIX$n" -- unshare --uts -- \
      bash -c 'hostname "$1" && exec slurmd -N "$1"' slurmd-launch "$n" </dev/null >>"$SL_LOGDIR/slurmd-$n.out" 2>&1 9>&- ||
      die "slurmd $n did not start" "$logf"
  else
    slurmd -N "$n" </dev/null >>"$SL_LOGDIR/slurmd-$n.out" 2>&1 9>&- || die "slurmd $n did not start" "$logf"
  fi
  record_pidfile "slurmd-$n" "$pidfile" slurmd "$logf"
}

# record_pidfile NAME PIDFILE COMM LOGFILE: wait for a daemon's pid file, then record it before anything else
# can fail, so that teardown.sh stops it even when setup.sh dies later.
record_pidfile() {
  wait_for 10 "$1 (pid file $2)" "$4" - test -s "$2"
  pids_set "$1" "$(cat "$2")" "$3"
}

# wait_for TIMEOUT_S WHAT LOGFILE DAEMON CMD...: poll CMD every 0.1 s until it succeeds; die with the log's tail
# on timeout, or at once when the recorded DAEMON ("-" for none) has exited.
wait_for() {
  local timeout=$1 what=$2 logf=$3 daemon=$4 deadline last
  shift 4
  deadline=$((SECONDS + timeout))
  until last=$("$@" 2>&1); do
    if [ "$daemon" != - ] && ! recorded_alive "$daemon"; then
      die "$what exited while starting" "$logf"
    fi
    [ $SECONDS -lt $deadline ] || die "$what not ready after ${timeout}s; last check ($(printf '%q ' "$@")) said: ${last:-nothing}" "$logf"
    sleep 0.1
  done
}

# Every node in a usable state (idle, mixed, allocated, completing) and responding (no '*').
nodes_ready() {
  local states
  states=$(sinfo -h -N -p "$SL_PARTITION" -o '%N %T' 2>/dev/null) || return 1
  [ "$(echo "$states" | awk 'NF' | wc -l)" -eq "$SL_NODES" ] || return 1
  ! echo "$states" | awk '{print $2}' | grep -qvE '^(idle|mixed|allocated|completing)$'
}

wait_nodes() {
  local deadline=$((SECONDS + SL_TIMEOUT_S)) resumed=0
  until nodes_ready; do
    for n in $(node_names); do
      recorded_alive "slurmd-$n" || die "slurmd $n exited while registering" "$SL_LOGDIR/slurmd-$n.log"
    done
    if [ $resumed -eq 0 ] && [ $SECONDS -gt $((deadline - SL_TIMEOUT_S + 5)) ]; then
      # Nodes drained by an earlier bad configuration stay drained until resumed.
      local bad
      bad=$(sinfo -h -N -p "$SL_PARTITION" -t drain,down -o '%N' | sort -u | paste -sd, -)
      [ -n "$bad" ] && scontrol update nodename="$bad" state=resume 2>/dev/null || true
      resumed=1
    fi
    if [ $SECONDS -ge $deadline ]; then
      sinfo -N -p "$SL_PARTITION" -o '%N %T %E' >&2 || true
      die "nodes not idle after ${SL_TIMEOUT_S}s" "$SL_LOGDIR/slurmd-n1.log"
    fi
    sleep 0.1
  done
}

healthy() {
  local d
  for d in munged "${SLURM_DAEMONS[@]}"; do recorded_alive "$d" || [ "$(pids_line "$d" | awk '{print $4}')" = adopted ] || return 1; done
  if [ "$SL_ACCOUNTING" = 1 ]; then
    recorded_alive slurmdbd || return 1
    recorded_alive mariadbd || [ "$(pids_line mariadbd | awk '{print $4}')" = adopted ] || return 1
  fi
  scontrol ping 2>/dev/null | grep -q UP && nodes_ready
}

# Jobs recovered from the controller's last life (a test session killed mid-run, a CI machine reused) would
# hold the nodes (a probe job holds them for minutes) and the srun check would wait for them: cancel them. (Not
# `slurmctld -c`: it restarts the job ids, and a slurmd refuses an id whose credential it revoked.)
cancel_leftover_jobs() {
  local ids
  ids=$(squeue -h -o '%i' 2>/dev/null | paste -sd' ' -) || return 0
  [ -z "$ids" ] && return 0
  log "cancelling jobs left from the controller's last life: $ids"
  # shellcheck disable=SC2086
  scancel $ids 2>/dev/null || true
}

check_srun() {
  local out want
  local try
  # a few tries: right after cancelled jobs a slurmd can refuse the first step ("Job credential revoked")
  for try in 1 2 3 4 5; do
    out=$(timeout 60 srun -N "$SL_NODES" -n "$SL_NODES" --ntasks-per-node=1 -t 1 hostname 2>&1) && break
    [ "$try" -lt 5 ] && sleep 2
  done || die "a test srun on all nodes failed: $out" "$SL_LOGDIR/slurmctld.log"
  if [ "$SL_NETNS" = 1 ]; then
    want=$(node_names | sort)
    [ "$(echo "$out" | sort)" = "$want" ] || die "srun hostname printed '$out', expected the node names" "$SL_LOGDIR/slurmd-n1.log"
  fi
}

# record_knobs: the knobs that shape the configs, as used now, for a later `setup.sh` that must keep them (the
# pytest fixture passes them back, so that a running cluster takes a changed render_conf.sh with its own knobs).
record_knobs() {
  local tmp="$SL_RUN/knobs.tmp.$$"
  mkdir -p "$SL_RUN"
  printf '%s\n' "SLURM_LOCAL_NODES=$SL_NODES" "SLURM_LOCAL_NETNS=$SL_NETNS" "SLURM_LOCAL_SUBNET=$SL_SUBNET" \
    "SLURM_LOCAL_CPUS_PER_NODE=$SL_CPUS" "SLURM_LOCAL_MEM_MB=$SL_MEM_MB" "SLURM_LOCAL_GPUS_PER_NODE=$SL_GPUS" \
    "SLURM_LOCAL_ACCOUNTING=$SL_ACCOUNTING" "SLURM_LOCAL_MEMLIMIT=$SL_MEMLIMIT" >"$tmp"
  mv -f "$tmp" "$SL_RUN/knobs"
}

main() {
  local fingerprint old_fingerprint
  install_packages
  tmp=$(mktemp -d)
  trap 'rm -rf "${tmp:-}"' EXIT
  render_configs "$tmp"
  fingerprint=$(cat "$tmp"/*.conf | sha256sum | cut -c1-16)
  old_fingerprint=$(cat "$SL_RUN/fingerprint" 2>/dev/null || true)
  if [ "$fingerprint" = "$old_fingerprint" ] && healthy; then
    log "already running ($(cat "$SL_RUN/mode") mode, $SL_NODES nodes, config $fingerprint): nothing to do ($(elapsed) s)"
    [ -f "$SL_RUN/knobs" ] || record_knobs
    echo "SLURM_LOCAL_RESULT=already-running"
    return 0
  fi
  prepare_dirs
  if [ -n "$old_fingerprint" ] && [ "$fingerprint" != "$old_fingerprint" ]; then
    log "configuration changed ($old_fingerprint -> $fingerprint): restarting the Slurm daemons"
    stop_recorded "${SLURM_DAEMONS[@]}" $(awk '$1 ~ /^slurmd-/ {print $1}' "$SL_PIDS" 2>/dev/null) slurmdbd
  else
    # A daemon died: restart the Slurm layer as a whole (a few seconds) rather than guess what else broke.
    stop_recorded "${SLURM_DAEMONS[@]}"
  fi
  install_configs "$tmp"
  setup_hosts
  setup_network
  start_munge
  if [ "$SL_ACCOUNTING" = 1 ]; then
    start_mariadb
    setup_database
    start_slurmdbd
  else
    stop_recorded slurmdbd
  fi
  start_slurmctld
  for n in $(node_names); do start_slurmd "$n"; done
  wait_nodes
  cancel_leftover_jobs
  check_srun
  if [ "$SL_NETNS" = 1 ]; then echo netns >"$SL_RUN/mode"; else echo loopback >"$SL_RUN/mode"; fi
  echo "$fingerprint" >"$SL_RUN/fingerprint"
  record_knobs
  echo "SLURM_LOCAL_RESULT=started"
  log "up in $(elapsed) s: $(cat "$SL_RUN/mode") mode, nodes $(node_names | paste -sd, -), partition $SL_PARTITION, accounting $([ "$SL_ACCOUNTING" = 1 ] && echo slurmdbd || echo none)"
}

main
