# shellcheck shell=bash
# render_configs OUTDIR: write slurm.conf, gres.conf, cgroup.conf (and slurmdbd.conf with accounting) for the
# knobs of common.sh into OUTDIR. Pure: reads only the knobs and the host name, starts nothing.
# Sourced by setup.sh after common.sh.

render_configs() {
  local out=$1 host ctl_addr node addr i last_gpu task_plugin ram_space
  host=$(host_short)
  if [ "$SL_NETNS" = 1 ]; then ctl_addr="$SL_SUBNET.1"; else ctl_addr=127.0.0.1; fi
  if [ "$SL_MEMLIMIT" = 1 ]; then task_plugin=task/cgroup ram_space=yes; else task_plugin=task/none ram_space=no; fi

  {
    echo "$SL_CONF_HEADER (mode: $([ "$SL_NETNS" = 1 ] && echo netns || echo loopback)). Do not edit."
    cat <<EOF
ClusterName=$SL_CLUSTER
SlurmctldHost=$host($ctl_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short credential lifetime: a requeued job may rerun cred_expire + 1 s after its requeue (6 s here, 121 s by
# default); 5 is the least Slurm takes (src/common/slurm_cred.c).
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/cgroup
TaskPlugin=$task_plugin
ReturnToService=2
SlurmctldPort=6817
SlurmctldPidFile=$SL_RUN/slurmctld.pid
SlurmdPidFile=$SL_RUN/slurmd-%n.pid
StateSaveLocation=$SL_SPOOL_CTLD
SlurmdSpoolDir=$SL_SPOOL_D/%n
SlurmctldLogFile=$SL_LOGDIR/slurmctld.log
SlurmdLogFile=$SL_LOGDIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Each node claims the CPUs and memory below, whatever the host has (4 nodes on 2 real cores).
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# Only the backfill scheduler starts het jobs: run it every second so they do not wait ~30 s.
SchedulerParameters=bf_interval=1,bf_hetjob_immediate
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without DefMemPerCPU every job gets the node's whole RealMemory and only one job fits per node.
DefMemPerCPU=500
MailProg=/bin/true
KillWait=5
InactiveLimit=0
MinJobAge=300
# slurmctld pings the nodes every SlurmdTimeout/3 s, and a ping's answer (the node's load) is what wakes the
# backfill scheduler when nothing else changes: a requeued het job waited 20-40 s past its begin time at 60.
# A node is marked DOWN after SlurmdTimeout s without an answer.
SlurmdTimeout=15
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
EOF
    if [ "$SL_GPUS" -gt 0 ]; then echo "GresTypes=gpu"; fi
    if [ "$SL_ACCOUNTING" = 1 ]; then
      echo "AccountingStorageType=accounting_storage/slurmdbd"
      echo "AccountingStorageHost=$ctl_addr"
      echo "AccountingStoragePort=6819"
      if [ "$SL_GPUS" -gt 0 ]; then echo "AccountingStorageTRES=gres/gpu"; fi
      echo "JobCompType=jobcomp/none"
    else
      echo "AccountingStorageType=accounting_storage/none"
      echo "JobCompType=jobcomp/filetxt"
      echo "JobCompLoc=$SL_LOGDIR/jobcomp.txt"
    fi
    local gres=""
    if [ "$SL_GPUS" -gt 0 ]; then gres=" Gres=gpu:$SL_GPUS"; fi
    for node in $(node_names); do
      i=${node#n}
      if [ "$SL_NETNS" = 1 ]; then
        addr=$(node_addr "$node")
        echo "NodeName=$node NodeHostname=$node NodeAddr=$addr Port=6818 CPUs=$SL_CPUS RealMemory=$SL_MEM_MB$gres State=UNKNOWN"
      else
        echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$SL_CPUS RealMemory=$SL_MEM_MB$gres State=UNKNOWN"
      fi
    done
    echo "PartitionName=$SL_PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$out/slurm.conf"

  {
    echo "$SL_CONF_HEADER. Do not edit."
    if [ "$SL_GPUS" -gt 0 ]; then
      last_gpu=$((SL_GPUS - 1))
      # Symlinks to /dev/null: a character device, so slurmd accepts them and sets CUDA_VISIBLE_DEVICES.
      echo "NodeName=n[1-$SL_NODES] Name=gpu File=$SL_RUN/fakegpu/nvidia[0-$last_gpu]"
    fi
  } >"$out/gres.conf"

  cat >"$out/cgroup.conf" <<EOF
$SL_CONF_HEADER. Do not edit.
CgroupPlugin=autodetect
CgroupMountpoint=/sys/fs/cgroup
IgnoreSystemd=yes
ConstrainCores=no
ConstrainDevices=no
ConstrainRAMSpace=$ram_space
EOF

  if [ "$SL_ACCOUNTING" = 1 ]; then
    cat >"$out/slurmdbd.conf" <<EOF
$SL_CONF_HEADER. Do not edit.
AuthType=auth/munge
DbdHost=$host
DbdPort=6819
SlurmUser=root
LogFile=$SL_LOGDIR/slurmdbd.log
PidFile=$SL_RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$SL_DB_USER
StoragePass=$SL_DB_PASS
StorageLoc=$SL_DB
EOF
  fi
}
