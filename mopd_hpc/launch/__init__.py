"""Launching jobs (the job plan is `mopd_hpc.plan`'s). The submit pipeline `mopd-submit` and `mopd-debug run`
share: `prepare` (config → a job ready to start, or every refusal), `rundir` (0700 run dir + 0600 token, then
config.yaml, plan.json, unverified.json), `start` (claim the run dir, run here or sbatch, the job index);
`check` (`mopd-submit --check`). Their parts: `jobspec` (what a job asks for), `render` (pure: JobSpec → sbatch
script), `env` (scrub inherited Slurm variables), `slurm` (submit through submitit), `local` and `local_setup`
(the local backend and what a local run prepares), `paths` (configured paths missing here)."""
