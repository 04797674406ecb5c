"""Launching jobs: `jobspec` (what a job asks for), `render` (pure: JobSpec → sbatch script), `rundir` (0700 run
dir + 0600 token), `env` (scrub inherited Slurm variables), `slurm` (submit through submitit), `jobids` (het id
folding and sacct/squeue state tables)."""
