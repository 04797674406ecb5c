"""What the processes of a run write into its run directory for others to read: the layout (`run_dir`), the
metrics contract and its writer (`metrics_schema`, `metrics`), and the end-of-job marker (`job_end`). The floor
below every writer (guard, roles, trainer, launch) and every reader (the summarizer): it imports nothing of the
project but `atomic`."""
