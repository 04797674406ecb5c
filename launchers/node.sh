#!/usr/bin/env bash
# What `srun` runs on every node of a component: name the het group, then become the node's guard.
#
# usage: node.sh --het-group N --component NAME --run-dir DIR [--roles R1,R2] [--secret-file FILE] \
#          -- GUARD_ARGV...
#
# Exports MOPD_HET_GROUP (no Slurm variable tells a task its component in a multi-group step:
# slurm-local-findings.md §4), MOPD_COMPONENT, MOPD_ROLES, MOPD_RUN_DIR and MOPD_SECRET_FILE (the token's
# path, never the token), then execs `GUARD_ARGV --run-dir DIR --job-id $SLURM_JOB_ID` (the het leader's id).
set -euo pipefail

die() {
  echo "node.sh: $*" >&2
  exit 2
}

het_group='' component='' run_dir='' roles='' secret_file=''
while (($# > 0)); do
  case $1 in
    --het-group | --component | --run-dir | --roles | --secret-file)
      (($# >= 2)) || die "$1 needs a value"
      case $1 in
        --het-group) het_group=$2 ;;
        --component) component=$2 ;;
        --run-dir) run_dir=$2 ;;
        --roles) roles=$2 ;;
        --secret-file) secret_file=$2 ;;
      esac
      shift 2
      ;;
    --)
      shift
      break
      ;;
    *) die "unknown argument '$1' (the guard's argv goes after --)" ;;
  esac
done

[[ $het_group =~ ^[0-9]+$ ]] || die "--het-group '$het_group': expected a het group index (0, 1, ...)"
[[ -n $component ]] || die "--component is required"
[[ -n $run_dir ]] || die "--run-dir is required"
(($# > 0)) || die "no guard command after --"
job_id=${SLURM_JOB_ID:-}
[[ -n $job_id ]] || die "SLURM_JOB_ID is unset: node.sh runs under srun inside the job"

export MOPD_HET_GROUP=$het_group MOPD_COMPONENT=$component MOPD_ROLES=$roles MOPD_RUN_DIR=$run_dir
if [[ -n $secret_file ]]; then
  export MOPD_SECRET_FILE=$secret_file
fi
exec "$@" --run-dir "$run_dir" --job-id "$job_id"
