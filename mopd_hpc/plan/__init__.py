"""What is decided before anything starts, from the config alone: `placement` (config → job plan: which child
runs on which node and GPUs, `runtime/plan.py` the record the guards read), `transfer_ranks` (AWEX's transfer
ranks and the pre-spawn layout checks), `memory_plan` (what each child holds on each GPU, per phase) and
`residency_plan` (which teachers leave their GPU between phases, decided from the memory plan)."""
