"""Launching jobs (the job plan is `mopd_hpc.plan`'s): `jobspec` (what a job asks for), `render`
(pure: JobSpec → sbatch script), `rundir` (0700 run dir + 0600 token), `env` (scrub inherited Slurm variables),
`slurm` (submit through submitit), `local` and `local_setup` (the local backend and what a local run prepares),
`paths` (configured paths missing here)."""
