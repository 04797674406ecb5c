"""Reading a run's logs: `summarize_run` (summary), the streaming scanner (scan), the cause table (causes),
guard events (run_events), sacct (sacct), metrics (progress; the format is `records/metrics_schema.py`), the
job index (index) and `mopd-logs tail` (tailing). Submodules are imported where used: `import mopd_hpc.logs`
stays light."""
